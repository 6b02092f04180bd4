//! The quickstart: a SQLite file, a lease-mode queue, a few hundred jobs, a subscription with
//! eight workers, and a summary. Run it with `cargo run -p broker-sqlite --example quickstart`.
//!
//! Job `i` succeeds at once, except: every tenth job fails its first attempt (and is retried), and
//! jobs 7, 57, 107, ... always fail, so after three attempts they move to the dead-letter table.

use std::time::{Duration, Instant};

use broker_sqlite::{
    BoxError, ColumnType, DeadLetter, Job, NewJob, Outcome, Payload, SqliteBackend,
    SubscribeOptions, TableDescription,
};

const JOBS: usize = 500;

/// The handler: a plain async function of the job. An error is a retry (after the backoff);
/// after three attempts the row moves to the dead-letter table.
async fn send_mail(job: Job<Payload<String>>) -> Result<Outcome, BoxError> {
    let n: usize = job.payload().0["mail #".len()..].parse()?;
    tokio::time::sleep(Duration::from_millis(2)).await;
    if n % 50 == 7 {
        return Err(format!("mail #{n}: the mail server refuses it").into());
    }
    if n.is_multiple_of(10) && job.attempt() == 1 {
        return Ok(Outcome::RetryAfter(Duration::from_millis(100)));
    }
    Ok(Outcome::Ack)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("sqlx-broker-quickstart.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let broker = SqliteBackend::connect(&format!("sqlite://{}", path.display())).await?;

    // The table: a text payload, a lease column (lease mode), a due time for delayed retries,
    // and at most three attempts before a row moves to `emails_dead`.
    let table = TableDescription::builder("emails")
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .lease_seconds(10)
        .due_at("due_at")
        .max_attempts(3)
        .dead_letter(DeadLetter::Table("emails_dead".into()))
        .build()?;
    broker.create_tables(&table).await?;
    let queue = broker.queue::<Payload<String>>(table).await?;

    let jobs: Vec<_> = (0..JOBS)
        .map(|i| NewJob::new(format!("mail #{i}")))
        .collect();
    queue.publish_batch(&jobs).await?;
    println!("published {JOBS} jobs to {}", path.display());

    let start = Instant::now();
    let sub = queue.subscribe(
        SubscribeOptions::new()
            .name("quickstart")
            .concurrency(8)
            .poll_interval(Duration::from_millis(100))
            .error_backoff(Duration::from_millis(50), Duration::from_millis(200)),
        send_mail,
    )?;

    let expected_dead = (0..JOBS).filter(|n| n % 50 == 7).count() as u64;
    let expected_acked = JOBS as u64 - expected_dead;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = sub.metrics();
        println!(
            "  {:>5.2}s  acked {:>3}  retried {:>3}  dead-lettered {:>2}  in work {}",
            start.elapsed().as_secs_f64(),
            m.acked,
            m.retried,
            m.dead_lettered,
            m.in_work
        );
        if m.acked == expected_acked && m.dead_lettered == expected_dead {
            break;
        }
        if Instant::now() > deadline {
            return Err("the quickstart did not finish within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let m = sub.metrics();
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
    broker.close().await;
    println!(
        "done: processed {}, retried {}, dead-lettered {}, elapsed {:.2}s",
        m.acked,
        m.retried,
        m.dead_lettered,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
