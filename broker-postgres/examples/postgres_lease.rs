//! Lease mode on PostgreSQL, with a typed row and a JSON payload: invoices to bill, an urgent
//! one first (a priority column), and one that always fails, so that after three attempts it
//! ends in the dead-letter table.
//!
//! Run it with `cargo run -p broker-postgres --example postgres_lease`. The server comes from
//! `SQLX_BROKER_PG_URL` (default `postgres://postgres@127.0.0.1:5432/test`); the example creates
//! its tables and drops them at the end.
//!
//! `#[derive(sqlx::FromRow)]` and `sqlx::types::Json` need `sqlx` as a dependency of your own
//! crate, with the `derive` and `json` features, and `serde` for the payload type (see
//! docs/typed-rows.md).

use std::time::{Duration, Instant};

use broker_postgres::{
    BoxError, ColumnType, DeadLetter, Job, MetricsSnapshot, NewJob, Outcome, PgBackend,
    SubscribeOptions, Subscription, TableDescription,
};
use serde::{Deserialize, Serialize};
use sqlx::types::Json;

/// The payload, stored as JSONB.
#[derive(Debug, Serialize, Deserialize)]
struct Invoice {
    customer: String,
    cents: i64,
}

/// What the handler reads of a row: columns by name.
#[derive(Debug, sqlx::FromRow)]
struct InvoiceRow {
    account: String,
    payload: Json<Invoice>,
}

async fn bill(job: Job<InvoiceRow>) -> Result<Outcome, BoxError> {
    let row = job.payload();
    let Json(invoice) = &row.payload;
    if invoice.cents < 0 {
        // An error is a retry after the backoff; the third failure dead-letters the row.
        return Err(format!(
            "row {}: a negative amount (attempt {})",
            job.id(),
            job.attempt()
        )
        .into());
    }
    println!(
        "billed {} cents to {} (account {}, row {}, attempt {})",
        invoice.cents,
        invoice.customer,
        row.account,
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
    let table = TableDescription::builder("example_invoices")
        .payload("payload", ColumnType::Json)
        .column("account", ColumnType::Text)
        .locked_until("locked_until") // lease mode
        .lease_seconds(30)
        .due_at("due_at")
        .priority("priority")
        .max_attempts(3)
        .dead_letter(DeadLetter::Table("example_invoices_dead".into()))
        .build()?;
    broker.drop_tables(&table).await?; // what a run cut short may have left
    broker.create_tables(&table).await?;
    let queue = broker.queue::<InvoiceRow>(table).await?;

    let invoice = |account: &str, customer: &str, cents| {
        NewJob::new(Json(Invoice {
            customer: customer.to_owned(),
            cents,
        }))
        .column("account", account)
    };
    queue
        .publish_batch(&[
            invoice("acme", "Ada", 1250),
            invoice("acme", "Bob", 990),
            invoice("globex", "Cy", -5),
            invoice("initech", "Dee", 4000).priority(10),
        ])
        .await?;

    let options = SubscribeOptions::new()
        .name("billing")
        .concurrency(4)
        .error_backoff(Duration::from_millis(50), Duration::from_millis(200));
    let sub = queue.subscribe(options, bill)?;
    wait_for(&sub, |m| m.acked == 3 && m.dead_lettered == 1).await?;
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
    println!("{report:?}, {:?}", queue.metrics());

    broker.drop_tables(queue.table()).await?;
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
