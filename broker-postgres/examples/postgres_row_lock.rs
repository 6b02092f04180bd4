//! Row lock mode on PostgreSQL: an order and the job that ships it commit in one transaction,
//! and the handler marks the order shipped through the claim's transaction, so that write
//! commits with the ack (a retry would roll it back).
//!
//! Run it with `cargo run -p broker-postgres --example postgres_row_lock`. The server comes from
//! `SQLX_BROKER_PG_URL` (default `postgres://postgres@127.0.0.1:5432/test`); the example creates
//! its tables and drops them at the end.

use std::time::{Duration, Instant};

use broker_postgres::{
    BoxError, ColumnType, HandlerResult, Job, MetricsSnapshot, NewJob, Outcome, Payload, PgBackend,
    PgJobTransaction, SubscribeOptions, Subscription, TableDescription, sqlx,
};

/// The handler: its write goes through the delivery's transaction.
async fn ship(job: Job<Payload<i64>>, tx: PgJobTransaction) -> HandlerResult {
    let order = job.payload().0;
    let mut tx = tx.get().await?;
    sqlx::query("UPDATE example_orders SET shipped = true WHERE id = $1")
        .bind(order)
        .execute(&mut **tx)
        .await?;
    println!(
        "shipped order {order} (row {}, attempt {})",
        job.id(),
        job.attempt()
    );
    Ok(Outcome::Ack)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let broker = PgBackend::connect(&url).await?;
    sqlx::query("DROP TABLE IF EXISTS example_orders")
        .execute(broker.pool())
        .await?;
    sqlx::query(
        "CREATE TABLE example_orders (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
         item TEXT NOT NULL, shipped BOOLEAN NOT NULL DEFAULT false)",
    )
    .execute(broker.pool())
    .await?;

    // No mode set: row lock.
    let table = TableDescription::builder("example_shipments")
        .payload("order_id", ColumnType::BigInt)
        .build()?;
    broker.drop_tables(&table).await?; // what a run cut short may have left
    broker.create_tables(&table).await?;
    let queue = broker.queue::<Payload<i64>>(table).await?;

    // Each order and its job commit together; the last transaction rolls back, and takes its
    // job with it.
    for (item, commit) in [
        ("lamp", true),
        ("desk", true),
        ("chair", true),
        ("sofa", false),
    ] {
        let mut tx = broker.pool().begin().await?;
        let order: i64 =
            sqlx::query_scalar("INSERT INTO example_orders (item) VALUES ($1) RETURNING id")
                .bind(item)
                .fetch_one(&mut *tx)
                .await?;
        queue.publish_in(&mut *tx, &[NewJob::new(order)]).await?;
        if commit {
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
    }
    queue.wake(); // publish_in wakes nothing before the commit

    let sub = queue.subscribe_with_transaction(SubscribeOptions::new().concurrency(2), ship)?;
    wait_for(&sub, |m| m.acked == 3).await?;
    // Warnings (a concurrency lowered to fit the pool, a missing claim index) and rows that do
    // not decode into the row type reach you without a tracing subscriber: in health(), and
    // once on standard error while no subscriber is installed.
    let health = sub.health();
    println!(
        "healthy: {}, warnings: {:?}",
        health.is_healthy(),
        health.warnings
    );
    let report = sub.shutdown().await;

    let (orders, shipped): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE shipped) FROM example_orders")
            .fetch_one(broker.pool())
            .await?;
    println!("{orders} orders, {shipped} shipped; {report:?}");
    assert_eq!((orders, shipped), (3, 3));

    broker.drop_tables(queue.table()).await?;
    sqlx::query("DROP TABLE example_orders")
        .execute(broker.pool())
        .await?;
    broker.close().await;
    Ok(())
}

/// Waits until the queue's counters satisfy `done`, for at most 30 s.
async fn wait_for(
    sub: &Subscription,
    done: impl Fn(&MetricsSnapshot) -> bool,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done(&sub.metrics()) {
        if Instant::now() > deadline {
            return Err(format!("not done after 30 s: {:?}", sub.metrics()).into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}
