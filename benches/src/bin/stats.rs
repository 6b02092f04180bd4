//! `Queue::stats()` on a large table (issue #29): the backlog bench's "not due" table (1,000,000
//! rows, the first 200,000 scheduled an hour ahead) on each database, filled, analyzed, and
//! `stats()` called a few times; prints the median time of a call and what it read.
//!
//! `cargo run --manifest-path benches/Cargo.toml --release --bin stats --
//! [--db postgres,mariadb,sqlite] [--rows N]`

use std::process::ExitCode;
use std::time::{Duration, Instant};

use benches::BoxError;
use benches::backlog::{self, Shape};
use benches::cli::ServerUrls;
use benches::scenario::Db;
use broker_core::{Backend, Broker, ClaimMode, QueueStats};
use broker_mysql::MySqlBackend;
use broker_postgres::PgBackend;
use broker_sqlite::SqliteBackend;
use clap::Parser;
use sqlx::{AssertSqlSafe, Executor};

/// `stats()` on a large table.
#[derive(Debug, Parser)]
struct Args {
    /// Databases (postgres, mariadb, sqlite).
    #[arg(long, value_delimiter = ',', default_value = "postgres,mariadb,sqlite")]
    db: Vec<String>,
    /// Rows in the table; the first fifth are scheduled an hour ahead.
    #[arg(long, default_value_t = 1_000_000)]
    rows: usize,
    /// Calls to time.
    #[arg(long, default_value_t = 5)]
    calls: usize,
    /// The servers.
    #[command(flatten)]
    servers: ServerUrls,
}

/// Fills the table, then times `stats()`; returns the median and the last reading.
async fn measure<B: Backend>(
    broker: &Broker<B>,
    db: Db,
    args: &Args,
) -> Result<(Duration, QueueStats), BoxError>
where
    for<'c> &'c sqlx::Pool<B::Db>: Executor<'c, Database = B::Db>,
{
    let name = format!("stats_bench_{}", std::process::id());
    let table = backlog::describe(&name, Shape::NotDue, ClaimMode::Lease)?;
    broker.create_tables(&table).await?;
    let result = async {
        let pool = broker.pool();
        pool.execute(AssertSqlSafe(backlog::fill_sql(
            db,
            &table,
            Shape::NotDue,
            args.rows,
            args.rows / 5,
        )))
        .await?;
        pool.execute(AssertSqlSafe(backlog::analyze_sql(db, table.name())))
            .await?;
        let queue = broker.queue::<()>(table.clone()).await?;
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..args.calls.max(1) {
            let start = Instant::now();
            let s = queue.stats().await?;
            times.push(start.elapsed());
            last = Some(s);
        }
        times.sort();
        Ok::<_, BoxError>((times[times.len() / 2], last.expect("one call at least")))
    }
    .await;
    broker.drop_tables(&table).await?;
    result
}

fn line(db: Db, rows: usize, median: Duration, s: &QueueStats) -> String {
    format!(
        "| {} | {rows} | {:.1} | {} | {} | {} | {} |",
        db.label(),
        median.as_secs_f64() * 1000.0,
        s.due,
        s.scheduled,
        s.in_work,
        s.lag()
            .map_or("-".into(), |d| format!("{:.1} s", d.as_secs_f64())),
    )
}

async fn run(args: &Args) -> Result<(), BoxError> {
    println!("| database | rows | stats() median ms | due | scheduled | in work | lag |");
    println!("|---|---|---|---|---|---|---|");
    for name in &args.db {
        let db = Db::parse(name).ok_or_else(|| format!("unknown database {name:?}"))?;
        let (median, s) = match db {
            Db::Postgres => {
                let b = PgBackend::connect(&args.servers.pg_url).await?;
                let out = measure(&b, db, args).await;
                b.close().await;
                out?
            }
            Db::MariaDb => {
                let b = MySqlBackend::connect(&args.servers.mysql_url).await?;
                let out = measure(&b, db, args).await;
                b.close().await;
                out?
            }
            Db::Sqlite => {
                let file = std::env::temp_dir()
                    .join(format!("sqlx-broker-stats-{}.db", std::process::id()));
                let b = SqliteBackend::connect(&format!("sqlite://{}", file.display())).await?;
                let out = measure(&b, db, args).await;
                b.close().await;
                benches::host::remove_sqlite_files(&file);
                out?
            }
        };
        println!("{}", line(db, args.rows, median, &s));
    }
    println!("(~ marks a sampled estimate)");
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    benches::block_on(run(&args))
}
