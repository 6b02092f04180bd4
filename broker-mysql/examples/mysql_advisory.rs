//! Advisory lock mode on MySQL or MariaDB: ledger entries keyed by account, so that one account's
//! entries run one at a time while other accounts' run beside them.
//!
//! Run it with `cargo run -p broker-mysql --example mysql_advisory`. The server comes from
//! `SQLX_BROKER_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); the example creates
//! its table and drops it at the end. Keys are `GET_LOCK` names made of the database's name and
//! the key, so they need a session: not a proxy that multiplexes sessions.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use broker_mysql::{
    BoxError, ColumnType, Job, MetricsSnapshot, MySqlBackend, NewJob, Outcome, Payload,
    SubscribeOptions, Subscription, TableDescription,
};

/// The keys whose entry runs now: a key must never be in here twice.
static IN_WORK: Mutex<Vec<String>> = Mutex::new(Vec::new());

async fn post(job: Job<Payload<String>>) -> Result<Outcome, BoxError> {
    // The template filled in from the row, e.g. "ledger-acme".
    let key = job.key().unwrap_or_default().to_owned();
    {
        let mut in_work = IN_WORK.lock().unwrap();
        if in_work.contains(&key) {
            return Err(format!("{key} is in work twice").into());
        }
        in_work.push(key.clone());
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    IN_WORK.lock().unwrap().retain(|k| k != &key);
    println!("{key}: {}", job.payload().0);
    Ok(Outcome::Ack)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let broker = MySqlBackend::connect(&url).await?;
    let table = TableDescription::builder("example_ledger")
        .payload("payload", ColumnType::Text)
        .column("account", ColumnType::Text) // a column of your own ...
        .advisory_lock("ledger-{account}") // ... that the key reads: advisory mode
        .build()?;
    broker.drop_tables(&table).await?; // what a run cut short may have left
    broker.create_tables(&table).await?;
    let queue = broker.queue::<Payload<String>>(table).await?;

    let jobs: Vec<_> = (1..=4)
        .flat_map(|i| {
            ["acme", "globex", "initech"]
                .map(|account| NewJob::new(format!("entry {i}")).column("account", account))
        })
        .collect();
    queue.publish_batch(&jobs).await?;

    let sub = queue.subscribe(SubscribeOptions::new().concurrency(4), post)?;
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
    let m = queue.metrics();
    println!("{m:?}");
    assert_eq!(m.handler_errors, 0, "a key was in work twice");

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
