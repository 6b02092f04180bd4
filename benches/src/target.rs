//! One database's broker, and everything that runs on it: claim scenarios (engine and raw),
//! publish throughput, and wake-up latency.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use broker_core::{
    Backend, Broker, ClaimMode, NewJob, Outcome, Queue, SubscribeOptions, TableDescription,
};
use broker_mysql::MySqlBackend;
use broker_postgres::PgBackend;
use broker_sqlite::SqliteBackend;
use sqlx::{Database, FromRow};

use crate::BoxError;
use crate::drain::{self, Row, RunLimits, RunResult};
use crate::host::remove_sqlite_files;
use crate::scenario::{Db, Scenario};
use crate::timed::Timed;
use crate::{handwritten, peer};

/// Where the server databases are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Urls {
    /// PostgreSQL (`SQLX_BROKER_PG_URL`).
    pub postgres: String,
    /// MariaDB or MySQL (`SQLX_BROKER_MYSQL_URL`).
    pub mysql: String,
    /// The folder of SQLite's file (`--url sqlite://..`: the folder of that file); the temp
    /// folder when `None`.
    pub sqlite_dir: Option<PathBuf>,
}

impl Urls {
    /// From the environment, with the local test servers as defaults.
    pub fn from_env() -> Self {
        Self {
            postgres: std::env::var("SQLX_BROKER_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
            mysql: std::env::var("SQLX_BROKER_MYSQL_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
            sqlite_dir: None,
        }
    }

    /// The URLs with `url` (the user's server, `--url`) in its database's place; the database
    /// it is for.
    ///
    /// # Errors
    /// A URL of no database the bench knows.
    pub fn with_url(mut self, url: &str) -> Result<(Self, Db), String> {
        let db = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            self.postgres = url.to_owned();
            Db::Postgres
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            self.mysql = url.to_owned();
            Db::MariaDb
        } else if let Some(path) = url
            .strip_prefix("sqlite://")
            .or(url.strip_prefix("sqlite:"))
        {
            let path = path.split('?').next().unwrap_or(path);
            let dir = std::path::Path::new(path)
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), std::path::Path::to_owned);
            self.sqlite_dir = Some(dir);
            Db::Sqlite
        } else {
            return Err(format!(
                "--url {}: give a postgres://, mysql:// (MariaDB too) or sqlite:// URL",
                broker_core::redact_passwords(url)
            ));
        };
        Ok((self, db))
    }

    /// The URL of a server database (SQLite: a temporary file, so `None`).
    pub fn of(&self, db: Db) -> Option<&str> {
        match db {
            Db::Sqlite => None,
            Db::Postgres => Some(&self.postgres),
            Db::MariaDb => Some(&self.mysql),
        }
    }
}

/// A connected database: a broker whose strategy calls are timed.
#[derive(Debug)]
pub enum Target {
    /// SQLite in a temporary file, removed by [`close`](Self::close).
    Sqlite {
        /// The broker.
        broker: Broker<Timed<SqliteBackend>>,
        /// The database file.
        file: PathBuf,
    },
    /// PostgreSQL.
    Postgres(Broker<Timed<PgBackend>>),
    /// MariaDB or MySQL.
    MariaDb(Broker<Timed<MySqlBackend>>),
}

/// Runs `$body` with `$b` bound to the target's broker, whatever its backend.
macro_rules! on_broker {
    ($target:expr, $b:ident => $body:expr) => {
        match $target {
            Target::Sqlite { broker: $b, .. } => $body,
            Target::Postgres($b) => $body,
            Target::MariaDb($b) => $body,
        }
    };
}

/// How long connecting to a server may take before it counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Which side of a scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The engine: a subscription.
    Engine,
    /// The hand-written sqlx loop ([`handwritten`](crate::handwritten)), the baseline of plain
    /// tables.
    HandWritten,
    /// The strategy loop: plain tasks calling the backend's own strategy methods. It shares the
    /// engine's statements, so it only shows what the engine's scheduling costs; it is the
    /// baseline of FIFO tables, which have no hand-written loop.
    StrategyLoop,
    /// ruststream-sqlx, the peer crate (PostgreSQL row lock and lease only).
    Peer,
}

impl Side {
    /// A short label for logs and tables.
    pub fn label(self) -> &'static str {
        match self {
            Side::Engine => "sqlx-broker",
            Side::HandWritten => "hand-written",
            Side::StrategyLoop => "strategy loop",
            Side::Peer => "ruststream-sqlx",
        }
    }
}

impl Target {
    /// Connects to `db`; a server that does not answer is an error naming its URL.
    pub async fn connect(db: Db, urls: &Urls) -> Result<Target, BoxError> {
        // sqlx keeps retrying a refused connection until its acquire timeout; give up sooner.
        let within = |_| -> BoxError {
            format!("no connection within {} s", CONNECT_TIMEOUT.as_secs()).into()
        };
        Ok(match db {
            Db::Sqlite => {
                let file = urls
                    .sqlite_dir
                    .clone()
                    .unwrap_or_else(std::env::temp_dir)
                    .join(format!("sqlx-broker-bench-{}.db", std::process::id()));
                remove_sqlite_files(&file);
                let b = SqliteBackend::connect(&format!("sqlite://{}", file.display())).await?;
                Target::Sqlite {
                    broker: Broker::new(Timed::new(b.backend().clone())),
                    file,
                }
            }
            Db::Postgres => {
                let b = tokio::time::timeout(CONNECT_TIMEOUT, PgBackend::connect(&urls.postgres))
                    .await
                    .map_err(within)??;
                Target::Postgres(Broker::new(Timed::new(b.backend().clone())))
            }
            Db::MariaDb => {
                let b = tokio::time::timeout(CONNECT_TIMEOUT, MySqlBackend::connect(&urls.mysql))
                    .await
                    .map_err(within)??;
                Target::MariaDb(Broker::new(Timed::new(b.backend().clone())))
            }
        })
    }

    /// The server's version and the settings that decide what a commit costs (durability:
    /// every figure here is with fsync on).
    pub async fn server(&self) -> Result<String, BoxError> {
        Ok(match self {
            Target::Sqlite { broker, .. } => {
                let pool = broker.pool();
                let version: String = sqlx::query_scalar("SELECT sqlite_version()")
                    .fetch_one(pool)
                    .await?;
                let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
                    .fetch_one(pool)
                    .await?;
                let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
                    .fetch_one(pool)
                    .await?;
                let sync = match sync {
                    0 => "OFF",
                    1 => "NORMAL",
                    2 => "FULL",
                    3 => "EXTRA",
                    _ => "?",
                };
                format!("SQLite {version}: journal_mode {journal}, synchronous {sync}")
            }
            Target::Postgres(broker) => {
                let pool = broker.pool();
                let mut out = vec![];
                for setting in [
                    "server_version",
                    "fsync",
                    "synchronous_commit",
                    "full_page_writes",
                    "shared_buffers",
                ] {
                    let value: String =
                        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
                            .fetch_one(pool)
                            .await?;
                    out.push(format!("{setting} {value}"));
                }
                format!("PostgreSQL: {}", out.join(", "))
            }
            Target::MariaDb(broker) => {
                let pool = broker.pool();
                let (version, flush, binlog, doublewrite, buffer): (String, i64, i64, i64, i64) =
                    sqlx::query_as(
                        "SELECT version(), CAST(@@innodb_flush_log_at_trx_commit AS SIGNED), \
                         CAST(@@log_bin AS SIGNED), CAST(@@innodb_doublewrite AS SIGNED), \
                         CAST(@@innodb_buffer_pool_size AS SIGNED)",
                    )
                    .fetch_one(pool)
                    .await?;
                format!(
                    "MariaDB/MySQL {version}: innodb_flush_log_at_trx_commit {flush}, log_bin {binlog}, innodb_doublewrite {doublewrite}, innodb_buffer_pool_size {} MiB",
                    buffer / (1024 * 1024)
                )
            }
        })
    }

    /// The database.
    pub fn db(&self) -> Db {
        match self {
            Target::Sqlite { .. } => Db::Sqlite,
            Target::Postgres(_) => Db::Postgres,
            Target::MariaDb(_) => Db::MariaDb,
        }
    }

    /// Runs one side of a scenario on a table of its own: creates it, fills it with
    /// `limits.rows` rows, drains it (timed as [`drain`] describes), and drops it.
    pub async fn run_side(
        &self,
        scenario: &Scenario,
        side: Side,
        limits: RunLimits,
    ) -> Result<RunResult, BoxError> {
        match (self, side) {
            (Target::Postgres(b), Side::HandWritten) => {
                on_table(b, scenario, "h", limits, async |t| {
                    handwritten::postgres(b.pool(), t.name(), scenario, limits).await
                })
                .await
            }
            (Target::MariaDb(b), Side::HandWritten) => {
                on_table(b, scenario, "h", limits, async |t| {
                    handwritten::mysql(b.pool(), t.name(), scenario, limits).await
                })
                .await
            }
            (Target::Sqlite { broker: b, .. }, Side::HandWritten) => {
                on_table(b, scenario, "h", limits, async |t| {
                    handwritten::sqlite(b.pool(), t.name(), scenario, limits).await
                })
                .await
            }
            (Target::Postgres(b), Side::Peer) => peer::run(b, scenario, limits).await,
            (_, Side::Peer) => Err(format!(
                "{}: ruststream-sqlx runs on PostgreSQL only in this bench",
                scenario.id()
            )
            .into()),
            _ => on_broker!(self, b => run_side(b, scenario, side, limits).await),
        }
    }

    /// Publish throughput: one row per statement, then batches of `batch` rows.
    pub async fn publish(
        &self,
        single: usize,
        batched: usize,
        batch: usize,
    ) -> Result<PublishResult, BoxError> {
        on_broker!(self, b => publish(b, single, batched, batch).await)
    }

    /// Latency from publish to handler start, for each way a subscription can be woken on this
    /// database: in-process, LISTEN/NOTIFY (PostgreSQL) and polling only.
    pub async fn latency(
        &self,
        wake_samples: usize,
        poll_samples: usize,
    ) -> Result<Vec<LatencyResult>, BoxError> {
        on_broker!(self, b => latency(b, wake_samples, poll_samples).await)
    }

    /// Closes the pool (and removes the SQLite file).
    pub async fn close(self) {
        on_broker!(&self, b => b.close().await);
        if let Target::Sqlite { file, .. } = &self {
            remove_sqlite_files(file);
        }
    }
}

/// Creates a table of its own for one side of `scenario`, fills it with `limits.rows` rows,
/// drains it with `drain`, and drops it.
async fn on_table<B: Backend>(
    broker: &Broker<Timed<B>>,
    scenario: &Scenario,
    tag: &str,
    limits: RunLimits,
    drain: impl AsyncFnOnce(&TableDescription) -> Result<RunResult, BoxError>,
) -> Result<RunResult, BoxError>
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let table = drain::describe(&drain::table_name(tag), scenario.mode, scenario.fifo_groups)?;
    broker.create_tables(&table).await?;
    let result = async {
        let rows = usize::try_from(limits.rows)?;
        drain::fill(broker, &table, rows, scenario.fifo_groups).await?;
        drain(&table).await
    }
    .await;
    let dropped = broker.drop_tables(&table).await;
    let result = result?;
    dropped?;
    Ok(result)
}

async fn run_side<B: Backend>(
    broker: &Broker<Timed<B>>,
    scenario: &Scenario,
    side: Side,
    limits: RunLimits,
) -> Result<RunResult, BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let stats = broker.backend().stats().clone();
    let tag = if side == Side::Engine { "e" } else { "s" };
    on_table(broker, scenario, tag, limits, async |table| {
        if side == Side::Engine {
            let queue = broker.queue::<Row>(table.clone()).await?;
            drain::engine_run(&queue, scenario, limits, Some(&stats)).await
        } else {
            let prepared = broker.backend().prepare(&Arc::new(table.clone())).await?;
            drain::strategy_run(Arc::new(prepared), table, scenario, limits, Some(&stats)).await
        }
    })
    .await
}

/// Publish throughput on one database.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PublishResult {
    /// Rows per second, one `publish` call per row.
    pub single: f64,
    /// Rows per second, `publish_batch` of [`batch`](Self::batch) rows per call.
    pub batched: f64,
    /// Rows per batch.
    pub batch: usize,
}

fn rate(rows: usize, took: Duration) -> f64 {
    crate::timed::count_f64(u64::try_from(rows).unwrap_or(u64::MAX)) / took.as_secs_f64().max(1e-9)
}

async fn publish<B: Backend>(
    broker: &Broker<Timed<B>>,
    single: usize,
    batched: usize,
    batch: usize,
) -> Result<PublishResult, BoxError>
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    // queue() needs the row type to read (its bound since #47's check of the payload type).
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    let table = drain::describe(&drain::table_name("p"), ClaimMode::Lease, None)?;
    broker.create_tables(&table).await?;
    let result = async {
        let queue = broker.queue::<Row>(table.clone()).await?;
        let t = Instant::now();
        for i in 0..single {
            queue.publish(NewJob::new(format!("job-{i}"))).await?;
        }
        let single_rate = rate(single, t.elapsed());
        let jobs: Vec<Vec<NewJob<String>>> = (0..batched)
            .collect::<Vec<_>>()
            .chunks(batch.max(1))
            .map(|c| c.iter().map(|i| NewJob::new(format!("job-{i}"))).collect())
            .collect();
        let t = Instant::now();
        for chunk in &jobs {
            queue.publish_batch(chunk).await?;
        }
        let batched_rate = rate(batched, t.elapsed());
        Ok::<_, BoxError>(PublishResult {
            single: single_rate,
            batched: batched_rate,
            batch,
        })
    }
    .await;
    let dropped = broker.drop_tables(&table).await;
    let result = result?;
    dropped?;
    Ok(result)
}

/// How the subscription in a latency run learns of a new row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Published through the subscription's own broker, which wakes it in the process.
    InProcess,
    /// Published from a second broker; PostgreSQL `LISTEN/NOTIFY` wakes the subscription.
    Notify,
    /// Published from a second broker with cross-process wake-ups off: the poll finds the row.
    Polling {
        /// The subscription's poll interval.
        interval: Duration,
    },
}

impl Wake {
    /// The name in reports.
    pub fn label(&self) -> String {
        match self {
            Wake::InProcess => "in-process".into(),
            Wake::Notify => "LISTEN/NOTIFY".into(),
            Wake::Polling { interval } => format!("polling only ({} ms)", interval.as_millis()),
        }
    }
}

/// Latency from publish to handler start.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyResult {
    /// How the subscription was woken.
    pub wake: Wake,
    /// One latency per delivered sample, sorted.
    pub samples: Vec<Duration>,
    /// Samples not delivered within the wait (counted, not in `samples`).
    pub lost: usize,
}

impl LatencyResult {
    /// The quantile of the samples at `permille` (500: the median), nearest rank; `None`
    /// without samples.
    pub fn quantile(&self, permille: u64) -> Option<Duration> {
        crate::report::quantile(&self.samples, permille)
    }
}

/// The poll interval of the polling-only latency run.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

async fn latency<B: Backend>(
    broker: &Broker<Timed<B>>,
    wake_samples: usize,
    poll_samples: usize,
) -> Result<Vec<LatencyResult>, BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let table = drain::describe(&drain::table_name("l"), ClaimMode::Lease, None)?;
    broker.create_tables(&table).await?;
    // A second broker on the same pool: its publishes wake only what the database wakes.
    let other = Broker::new(broker.backend().clone());
    let polling = Broker::new(broker.backend().without_listen());
    let result = async {
        let own = broker.queue::<Row>(table.clone()).await?;
        let from_other = other.queue::<Row>(table.clone()).await?;
        let polled = polling.queue::<Row>(table.clone()).await?;
        // Long enough that a wake-up that never comes shows as a lost sample or a 1 s tail.
        let wake_poll = Duration::from_secs(1);
        let jitter = Duration::from_millis(3);
        let mut out =
            vec![latency_run(Wake::InProcess, &own, &own, wake_poll, wake_samples, jitter).await?];
        if broker.backend().capabilities().cross_process_wakeups {
            out.push(
                latency_run(
                    Wake::Notify,
                    &own,
                    &from_other,
                    wake_poll,
                    wake_samples,
                    jitter,
                )
                .await?,
            );
        }
        // Publishing at a random point of the poll cycle: the mean wait is half an interval.
        let wake = Wake::Polling {
            interval: POLL_INTERVAL,
        };
        out.push(
            latency_run(
                wake,
                &polled,
                &from_other,
                POLL_INTERVAL,
                poll_samples,
                POLL_INTERVAL,
            )
            .await?,
        );
        Ok::<_, BoxError>(out)
    }
    .await;
    let dropped = broker.drop_tables(&table).await;
    let result = result?;
    dropped?;
    Ok(result)
}

/// A small deterministic generator for publish jitter.
fn next_jitter(state: &mut u64, max: Duration) -> Duration {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let max_us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX).max(1);
    Duration::from_micros(*state % max_us)
}

async fn latency_run<B: Backend>(
    wake: Wake,
    subscriber: &Queue<B, Row>,
    publisher: &Queue<B, Row>,
    poll: Duration,
    samples: usize,
    jitter: Duration,
) -> Result<LatencyResult, BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
    let sub = subscriber.subscribe(
        SubscribeOptions::new()
            .name("latency")
            .concurrency(4)
            .poll_interval(poll),
        move |job| {
            let started = Instant::now();
            let index = job.payload().0.parse().unwrap_or(usize::MAX);
            let _ = tx.send((index, started));
            async { Outcome::Ack }
        },
    )?;
    // Let the subscription start (and LISTEN) and go idle before the first sample.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let wait = (poll * 3).max(Duration::from_secs(2));
    let mut state = 0x2545_F491_4F6C_DD1D_u64;
    let mut out = LatencyResult {
        wake,
        samples: Vec::with_capacity(samples),
        lost: 0,
    };
    for i in 0..samples {
        tokio::time::sleep(next_jitter(&mut state, jitter)).await;
        let published = Instant::now();
        publisher.publish(NewJob::new(i.to_string())).await?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some((index, started))) if index == i => {
                    out.samples
                        .push(started.saturating_duration_since(published));
                    break;
                }
                // A sample that came after its wait ran out.
                Ok(Some(_)) => {}
                Ok(None) => return Err("the latency subscription stopped".into()),
                Err(_) => {
                    out.lost += 1;
                    break;
                }
            }
        }
    }
    sub.shutdown().await;
    out.samples.sort_unstable();
    Ok(out)
}
