//! Lease mode on SQLite, with a typed row and a JSON payload: reminders to send, acked rows kept
//! and marked (`processed_at`), a delayed retry, and a reminder that can never be sent marked as
//! a dead letter in a column of its own.
//!
//! Run it with `cargo run -p broker-sqlite --example sqlite_lease`; it needs no server (a file
//! in the temp folder, removed at the end).
//!
//! `#[derive(sqlx::FromRow)]` and `sqlx::types::Json` need `sqlx` as a dependency of your own
//! crate, with the `derive` and `json` features, and `serde` for the payload type (see
//! docs/typed-rows.md).

use std::time::{Duration, Instant};

use broker_sqlite::{
    BoxError, ColumnType, DeadLetter, Job, MetricsSnapshot, NewJob, Outcome, SqliteBackend,
    SubscribeOptions, Subscription, TableDescription,
};
use serde::{Deserialize, Serialize};
use sqlx::types::Json;

/// The payload, stored as JSON text.
#[derive(Debug, Serialize, Deserialize)]
struct Reminder {
    to: String,
    text: String,
}

/// What the handler reads of a row: columns by name.
#[derive(Debug, sqlx::FromRow)]
struct ReminderRow {
    channel: String,
    payload: Json<Reminder>,
}

async fn remind(job: Job<ReminderRow>) -> Result<Outcome, BoxError> {
    let row = job.payload();
    let Json(reminder) = &row.payload;
    match row.channel.as_str() {
        // Nothing can send these: no use trying again.
        "fax" => return Ok(Outcome::DeadLetter),
        // The gateway is "busy" on the first attempt: try again a little later.
        "sms" if job.attempt() == 1 => return Ok(Outcome::RetryAfter(Duration::from_millis(200))),
        _ => {}
    }
    println!(
        "{} to {}: {} (row {}, attempt {})",
        row.channel,
        reminder.to,
        reminder.text,
        job.id(),
        job.attempt()
    );
    Ok(Outcome::Ack)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let path = std::env::temp_dir().join("sqlx-broker-example-lease.db");
    let remove = || {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    };
    remove();
    let broker = SqliteBackend::connect(&format!("sqlite://{}", path.display())).await?;
    let table = TableDescription::builder("reminders")
        .payload("payload", ColumnType::Json)
        .column("channel", ColumnType::Text)
        .locked_until("locked_until") // lease mode
        .due_at("due_at") // for the delayed retry
        .processed_at("processed_at") // an ack marks the row instead of deleting it
        .max_attempts(3)
        .dead_letter(DeadLetter::Column("dead_at".into())) // a dead letter marks the row too
        .build()?;
    broker.create_tables(&table).await?;
    let queue = broker.queue::<ReminderRow>(table).await?;

    let reminder = |channel: &str, to: &str, text: &str| {
        NewJob::new(Json(Reminder {
            to: to.to_owned(),
            text: text.to_owned(),
        }))
        .column("channel", channel)
    };
    let ids = queue
        .publish_batch(&[
            reminder("mail", "ada@example.com", "the invoice is due"),
            reminder("sms", "+15550100", "your table is ready"),
            reminder("fax", "+15550199", "a fax"),
        ])
        .await?;

    let sub = queue.subscribe(SubscribeOptions::new().concurrency(2), remind)?;
    wait_for(&sub, |m| m.acked == 2 && m.dead_lettered == 1).await?;
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

    // Acked and dead-lettered rows stay, marked. The attempt column starts at 1 and, in lease
    // mode, counts every claim.
    for id in ids {
        let state = queue
            .row_state(id)
            .await?
            .ok_or("rows stay in this table")?;
        println!(
            "row {id}: attempt column {}, processed {}, dead {}",
            state.attempt, state.processed, state.dead
        );
    }

    broker.close().await;
    remove();
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
