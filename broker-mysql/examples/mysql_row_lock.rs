//! Row lock mode on MySQL or MariaDB: an order and the job that ships it commit in one
//! transaction, and the handler marks the order shipped through the claim's transaction, so
//! that write commits with the ack (a retry would roll it back).
//!
//! Run it with `cargo run -p broker-mysql --example mysql_row_lock`. The server comes from
//! `SQLX_BROKER_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); the example creates
//! its tables and drops them at the end.

use std::time::{Duration, Instant};

use broker_mysql::{
    BoxError, ColumnType, HandlerResult, Job, MetricsSnapshot, MySqlBackend, MySqlJobTransaction,
    NewJob, Outcome, Payload, SubscribeOptions, Subscription, TableDescription, sqlx,
};

/// The handler: its write goes through the delivery's transaction.
async fn ship(job: Job<Payload<i64>>, tx: MySqlJobTransaction) -> HandlerResult {
    let order = job.payload().0;
    let mut tx = tx.get().await?;
    sqlx::query("UPDATE example_orders SET shipped = TRUE WHERE id = ?")
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
    let url = std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let broker = MySqlBackend::connect(&url).await?;
    sqlx::query("DROP TABLE IF EXISTS example_orders")
        .execute(broker.pool())
        .await?;
    sqlx::query(
        "CREATE TABLE example_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         item VARCHAR(100) NOT NULL, shipped BOOLEAN NOT NULL DEFAULT FALSE)",
    )
    .execute(broker.pool())
    .await?;

    // No mode set: row lock (claims run at READ COMMITTED).
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
        let inserted = sqlx::query("INSERT INTO example_orders (item) VALUES (?)")
            .bind(item)
            .execute(&mut *tx)
            .await?;
        let order = i64::try_from(inserted.last_insert_id())?;
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

    let (orders, shipped): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), CAST(COALESCE(SUM(shipped), 0) AS SIGNED) FROM example_orders",
    )
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
