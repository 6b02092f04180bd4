//! Publishing on PostgreSQL: single-job publishes from several tasks against a hand-written
//! `INSERT`, and publish → handler latency across processes.
//!
//! `cargo run --manifest-path benches/Cargo.toml --release --bin publish` (see `--help`).
//!
//! - **Throughput**: `tasks` tasks each publish one job per call until `jobs` are in, three ways
//!   in the same run on the same table shape: `queue.publish`, a hand-written
//!   `INSERT .. VALUES ($1)` (the baseline, written here, sharing no statement text with the
//!   backend), and the same `INSERT` with `pg_notify` in it (what a notification per publish
//!   costs). Each side runs `rounds` times on a fresh table; the median is reported.
//! - **Latency across processes**: this binary starts itself again as a subscriber process (a
//!   lease subscription whose poll is an hour, so only a notification wakes it in time), then
//!   publishes one job at a time, each after the subscriber went idle; each payload carries its
//!   publish time, and the subscriber prints how long after it the handler began.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use benches::BoxError;
use benches::host::unix_us;
use broker_core::{ColumnType, NewJob, Outcome, Payload, SubscribeOptions, TableDescription};
use broker_postgres::{PgBackend, PgBroker};
use clap::Parser;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

/// Publish throughput and cross-process wake-up latency on PostgreSQL.
#[derive(Debug, Parser)]
struct Args {
    /// The server (its database holds the bench tables).
    #[arg(
        long,
        env = "SQLX_BROKER_PG_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    url: String,
    /// Jobs per throughput run.
    #[arg(long, default_value_t = 4000)]
    jobs: usize,
    /// Publishing tasks.
    #[arg(long, default_value_t = 8)]
    tasks: usize,
    /// Runs per side (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Latency samples.
    #[arg(long, default_value_t = 40)]
    samples: usize,
    /// Internal: run as the subscriber process of the latency run, on this table.
    #[arg(long, hide = true)]
    subscriber: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match &args.subscriber {
        Some(table) => benches::block_on(subscriber(&args.url, table)),
        None => benches::block_on(bench(&args)),
    }
}

fn table(name: &str) -> TableDescription {
    TableDescription::builder(name)
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .build()
        .expect("the bench table's description is valid")
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Publishes `jobs` rows from `tasks` tasks, `publish(i)` per row; returns jobs per second.
async fn drive<F, Fut>(jobs: usize, tasks: usize, publish: F) -> Result<f64, BoxError>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let publish = Arc::new(publish);
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let publish = publish.clone();
        handles.push(tokio::spawn(async move {
            let mut i = t;
            while i < jobs {
                publish(i).await?;
                i += tasks;
            }
            Ok::<(), BoxError>(())
        }));
    }
    for h in handles {
        h.await??;
    }
    Ok(jobs as f64 / start.elapsed().as_secs_f64())
}

async fn fresh(broker: &PgBroker, name: &str) -> Result<TableDescription, BoxError> {
    let t = table(name);
    let _ = broker.drop_tables(&t).await;
    broker.create_tables(&t).await?;
    Ok(t)
}

async fn bench(args: &Args) -> Result<(), BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&args.url)
        .await?;
    let broker = PgBroker::new(PgBackend::new(pool.clone()));
    let name = "sqlx_broker_bench_publish";
    let insert = format!("INSERT INTO {name} (payload) VALUES ($1)");
    let insert_notify = format!(
        "WITH i AS (INSERT INTO {name} (payload) VALUES ($1) RETURNING 1) \
         SELECT pg_notify('bench_publish', '') FROM i"
    );
    let (mut ours, mut raw, mut raw_notify) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        let t = fresh(&broker, name).await?;
        let queue = broker.queue::<Payload<String>>(t).await?;
        ours.push(
            drive(args.jobs, args.tasks, move |i| {
                let queue = queue.clone();
                async move {
                    queue.publish(NewJob::new(format!("job-{i}"))).await?;
                    Ok(())
                }
            })
            .await?,
        );
        for (sql, out) in [(&insert, &mut raw), (&insert_notify, &mut raw_notify)] {
            fresh(&broker, name).await?;
            out.push(by_hand(&pool, sql, args.jobs, args.tasks).await?);
        }
    }
    let (ours, raw, raw_notify) = (median(ours), median(raw), median(raw_notify));
    println!(
        "single-job publish, {} tasks, {} jobs, median of {}:",
        args.tasks, args.jobs, args.rounds
    );
    println!("| side | jobs/s | / hand-written INSERT |");
    println!("|---|---:|---:|");
    println!("| hand-written INSERT | {raw:.0} | 1.00 |");
    println!(
        "| hand-written INSERT with pg_notify | {raw_notify:.0} | {:.2} |",
        raw_notify / raw
    );
    println!("| queue.publish | {ours:.0} | **{:.2}** |", ours / raw);

    let t = fresh(&broker, name).await?;
    latency(args, &broker, t).await?;
    let _ = broker.drop_tables(&table(name)).await;
    broker.close().await;
    Ok(())
}

async fn by_hand(pool: &PgPool, sql: &str, jobs: usize, tasks: usize) -> Result<f64, BoxError> {
    let sql: Arc<str> = sql.into();
    let pool = pool.clone();
    drive(jobs, tasks, move |i| {
        let (pool, sql) = (pool.clone(), sql.clone());
        async move {
            sqlx::query(AssertSqlSafe(sql))
                .bind(format!("job-{i}"))
                .execute(&pool)
                .await?;
            Ok(())
        }
    })
    .await
}

/// Publish → handler latency with the subscriber in another process.
async fn latency(args: &Args, broker: &PgBroker, t: TableDescription) -> Result<(), BoxError> {
    let queue = broker.queue::<Payload<String>>(t.clone()).await?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--url", &args.url, "--subscriber", t.name()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no child stdout")?).lines();
    // The subscriber says when it listens.
    lines.next().ok_or("the subscriber ended early")??;
    let mut samples = Vec::new();
    for _ in 0..args.samples {
        // Let the subscriber go idle, so only a notification can wake it before its poll.
        tokio::time::sleep(Duration::from_millis(60)).await;
        queue.publish(NewJob::new(unix_us().to_string())).await?;
        let line =
            tokio::task::block_in_place(|| lines.next()).ok_or("the subscriber ended early")??;
        samples.push(line.trim().parse::<f64>()? / 1000.0);
    }
    let _ = child.kill();
    let _ = child.wait();
    samples.sort_by(f64::total_cmp);
    // The sample at `percent` per cent of the sorted list.
    let pct = |percent: usize| samples[(samples.len() - 1) * percent / 100];
    println!(
        "publish -> handler across processes ({} samples, subscriber idle, poll 1 h): median {:.1} ms, p90 {:.1} ms, max {:.1} ms",
        samples.len(),
        pct(50),
        pct(90),
        pct(100)
    );
    Ok(())
}

/// The subscriber process: prints a line when it listens, then one per job with the
/// microseconds between its publish and the handler's start.
async fn subscriber(url: &str, name: &str) -> Result<(), BoxError> {
    let broker = PgBackend::connect(url).await?;
    let queue = broker.queue::<Payload<String>>(table(name)).await?;
    let sub = queue
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_secs(3600)),
            |job| {
                let sent: i64 = job.payload().0.parse().unwrap_or(0);
                println!("{}", unix_us().saturating_sub(sent).max(0));
                async { Outcome::Ack }
            },
        )
        .expect("subscribe");
    // LISTEN runs before the first claim; give it a moment, then tell the parent.
    tokio::time::sleep(Duration::from_millis(300)).await;
    println!("ready");
    // Runs until the parent kills it.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    sub.shutdown().await;
    Ok(())
}
