//! Unique jobs and a periodic schedule on SQLite: two brokers publish one key and get one row;
//! two brokers run one every-second schedule and each tick lands once.
//!
//! Run it with `cargo run -p broker-sqlite --example sqlite_unique_and_cron`; it needs no
//! server, runs for about five seconds, and prints what it saw.

use std::time::{Duration, SystemTime};

use broker_sqlite::{
    BoxError, ColumnType, JobState, NewJob, Outcome, Page, Payload, Schedule, SqliteBackend,
    SubscribeOptions, TableDescription,
};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let path = std::env::temp_dir().join("sqlx-broker-example-unique-cron.db");
    let remove = || {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    };
    remove();
    let url = format!("sqlite://{}", path.display());
    let table = TableDescription::builder("reports")
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .processed_at("processed_at")
        .unique_key("unique_key")
        .build()?;
    // Two brokers stand for two processes of one service.
    let a = SqliteBackend::connect(&url).await?;
    let b = SqliteBackend::connect(&url).await?;
    a.create_tables(&table).await?;
    let qa = a.queue::<Payload<String>>(table.clone()).await?;
    let qb = b.queue::<Payload<String>>(table).await?;

    // Unique jobs: the second publish of a key finds the first row.
    let job = || NewJob::new("rebuild account 7".to_owned()).unique_key("rebuild:7");
    let first = qa.publish_unique(job()).await?;
    let second = qb.publish_unique(job()).await?;
    assert!(!first.duplicate && second.duplicate && second.id == first.id);
    println!(
        "unique: row {} published once, the second publish was a duplicate",
        first.id
    );
    qa.claim(1)
        .await?
        .pop()
        .expect("the keyed row")
        .ack()
        .await?;
    assert!(!qb.publish_unique(job()).await?.duplicate);
    println!("unique: after the ack the key was free again");

    // A schedule in both processes: each tick lands once.
    let tick_job = |tick: SystemTime| {
        let ms = tick
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        NewJob::new(format!("tick {ms}"))
    };
    let every_second = || Schedule::new("every-second", "* * * * * *");
    let sa = qa.schedule(every_second()?, tick_job).await?;
    let sb = qb.schedule(every_second()?, tick_job).await?;
    let worker = qa.subscribe(SubscribeOptions::default(), |_job| async { Outcome::Ack })?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    sa.stop().await;
    sb.stop().await;
    worker.shutdown().await;

    let mut ticks = Vec::new();
    for state in [JobState::Finished, JobState::Due, JobState::InWork] {
        for row in qa.jobs(state, Page::first(Page::MAX)).await? {
            let payload = row.payload.unwrap_or_default();
            if payload.starts_with("tick ") {
                ticks.push(payload);
            }
        }
    }
    ticks.sort();
    let published = ticks.len();
    ticks.dedup();
    assert_eq!(ticks.len(), published, "a tick landed twice");
    println!("cron: two brokers, {published} ticks, each published once");
    for s in a.schedules().await? {
        println!(
            "cron: schedule {:?} \"{}\" ({}), last tick {:?}",
            s.name, s.expression, s.time_zone, s.last_tick_ms
        );
    }
    a.close().await;
    b.close().await;
    remove();
    Ok(())
}
