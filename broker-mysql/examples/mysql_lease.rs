//! Lease mode with FIFO groups on MySQL or MariaDB, with a typed row and a JSON payload: each
//! customer's steps run in the order they were published, one at a time, while other
//! customers' steps run beside them.
//!
//! Run it with `cargo run -p broker-mysql --example mysql_lease`. The server comes from
//! `SQLX_BROKER_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); the example creates
//! its table and drops it at the end.
//!
//! `#[derive(sqlx::FromRow)]` and `sqlx::types::Json` need `sqlx` as a dependency of your own
//! crate, with the `derive` and `json` features, and `serde` for the payload type (see
//! docs/typed-rows.md).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use broker_mysql::{
    BoxError, ColumnType, DeadLetter, Job, MetricsSnapshot, MySqlBackend, NewJob, Outcome,
    SubscribeOptions, Subscription, TableDescription,
};
use serde::{Deserialize, Serialize};
use sqlx::types::Json;

/// The payload, stored as JSON.
#[derive(Debug, Serialize, Deserialize)]
struct Step {
    seq: u32,
    what: String,
}

/// What the handler reads of a row: columns by name.
#[derive(Debug, sqlx::FromRow)]
struct StepRow {
    customer: String,
    payload: Json<Step>,
}

/// The steps in the order they ran.
static RAN: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());

async fn run_step(job: Job<StepRow>) -> Result<Outcome, BoxError> {
    let row = job.into_payload();
    let Json(step) = row.payload;
    tokio::time::sleep(Duration::from_millis(10)).await;
    println!("{}: step {} ({})", row.customer, step.seq, step.what);
    RAN.lock().unwrap().push((row.customer, step.seq));
    Ok(Outcome::Ack)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let broker = MySqlBackend::connect(&url).await?;
    let table = TableDescription::builder("example_steps")
        .payload("payload", ColumnType::Json)
        .locked_until("locked_until") // lease mode
        .group("customer")
        .fifo(true) // each customer's rows in id order, one at a time
        .max_attempts(5) // a head that keeps failing would block its group:
        .dead_letter(DeadLetter::Column("dead_at".into())) // this lets the group move on
        .build()?;
    broker.drop_tables(&table).await?; // what a run cut short may have left
    broker.create_tables(&table).await?;
    let queue = broker.queue::<StepRow>(table).await?;

    let mut jobs = Vec::new();
    for (seq, what) in (1..).zip(["order", "pay", "pack", "ship"]) {
        for customer in ["ada", "bob", "cy"] {
            let step = Step {
                seq,
                what: what.to_owned(),
            };
            jobs.push(NewJob::new(Json(step)).group(customer));
        }
    }
    queue.publish_batch(&jobs).await?;

    let sub = queue.subscribe(SubscribeOptions::new().concurrency(3), run_step)?;
    wait_for(&sub, |m| m.acked == 12).await?;
    // Warnings (a concurrency lowered to fit the pool, a missing claim index) and rows that do
    // not decode into the row type reach you without a tracing subscriber: in health(), and
    // once on standard error while no subscriber is installed.
    let health = sub.health();
    println!(
        "healthy: {}, warnings: {:?}",
        health.is_healthy(),
        health.warnings
    );
    sub.shutdown().await;

    let ran = RAN.lock().unwrap().clone();
    for customer in ["ada", "bob", "cy"] {
        let order: Vec<u32> = ran
            .iter()
            .filter(|(c, _)| c == customer)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(order, [1, 2, 3, 4], "{customer}'s steps out of order");
    }

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
