//! Job kinds against one type (issue #48): does a kinds table drain as fast as a one-type table
//! of the same rows? Per database and claim mode, `--rows` rows are published up front and one
//! subscription (concurrency 8, the default options otherwise) drains them with a handler that
//! only counts:
//!
//! - **kinds**: a kinds table (`kind` column, JSON `args`), 10 kinds with the same fields
//!   (`{n, s}`), the rows spread evenly over them (row `i` is of kind `i % 10`), one
//!   [`Queue::work`] subscription registering all 10 workers;
//! - **one type**: the same rows' JSON in a one-type table (JSON `args`, read as
//!   `Payload<Json<Args>>`, so both sides decode the JSON into a struct) with one
//!   [`Queue::subscribe`].
//!
//! Both tables have a due-time column, as the other benches' tables do. Each round makes both
//! tables afresh, and the sides run in turn (kinds first in odd rounds, one type first in even
//! ones), `--rounds` times; each drain is timed from the subscribe until every row is acked, and
//! checked: every row's number seen once, none twice, none missing. The report gives per
//! database and mode the median jobs/s of each side, the median of the per-round ratios
//! kinds / one type with their min–max, the client CPU per 1,000 jobs and what the claims cost
//! (through [`Timed`]). Prints a markdown table and writes `benches/results/kinds.md` (`--out`).
//!
//! `cargo run --manifest-path benches/Cargo.toml --release --bin kinds` (see `--help`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use benches::BoxError;
use benches::Timed;
use benches::cli::ServerUrls;
use benches::host;
use benches::scenario::{Db, parse_mode};
use benches::timed::{Op, OpTotals, count_f64};
use broker_core::{
    Backend, Broker, ClaimMode, ColumnType, Job, JobKind, Json, KindRow, NewJob, Outcome, Payload,
    SubscribeOptions, Subscription, TableDescription, Workers,
};
use broker_mysql::MySqlBackend;
use broker_postgres::PgBackend;
use broker_sqlite::SqliteBackend;
use clap::Parser;
use serde::{Deserialize, Serialize};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{Database, FromRow};

/// A kinds table with 10 kinds against a one-type table of the same rows: drain throughput.
#[derive(Debug, Parser)]
struct Args {
    /// Databases (postgres, mariadb, sqlite).
    #[arg(long, value_delimiter = ',', default_value = "postgres,mariadb,sqlite")]
    db: Vec<String>,
    /// Claim modes (lease, row-lock); row lock runs on PostgreSQL and MariaDB only.
    #[arg(long, value_delimiter = ',', default_value = "lease,row-lock")]
    mode: Vec<String>,
    /// Rows published up front, each round and side.
    #[arg(long, default_value_t = 20_000)]
    rows: usize,
    /// Deliveries in work at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Rounds; each runs both sides, in turn.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Connections in the pool (row lock holds one per delivery in work, so more than
    /// `--concurrency`: at 10, row lock would lower concurrency 8 to 7).
    #[arg(long, default_value_t = 16)]
    pool: u32,
    /// Seconds one drain may take before the run fails.
    #[arg(long, default_value_t = 300)]
    limit: u64,
    /// Where to write `kinds.md`.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    out: PathBuf,
    /// Print only.
    #[arg(long)]
    no_write: bool,
    /// The servers.
    #[command(flatten)]
    servers: ServerUrls,
}

fn main() -> ExitCode {
    let args = Args::parse();
    benches::block_on(run(&args))
}

/// The arguments every row carries: its number and a short text. The 10 kinds have these
/// fields, so a row's JSON is the same whichever side it is published to.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Row {
    /// The row's number, 0..rows: how the handler tells which rows it saw.
    n: i64,
    /// A short text, as real arguments have.
    s: String,
}

/// The 10 kinds: structs with [`Row`]'s fields, kind names `k0`..`k9`.
macro_rules! kinds {
    ($($name:ident = $kind:literal),* $(,)?) => {
        $(
            #[doc = concat!("Kind `", $kind, "`: the fields of [`Row`].")]
            #[derive(Debug, Clone, Serialize, Deserialize)]
            struct $name {
                n: i64,
                s: String,
            }
            impl JobKind for $name {
                const KIND: &'static str = $kind;
            }
        )*
        /// The kinds' names, in row order (row `i` is of kind `KINDS[i % 10]`).
        const KINDS: &[&str] = &[$($kind),*];
        /// Workers for all 10 kinds, each marking its row's number in `seen`.
        fn all_workers(seen: &Arc<Seen>) -> Workers {
            Workers::new()
            $(
                .register({
                    let seen = seen.clone();
                    move |job: Job<$name>| {
                        seen.mark(job.payload().n);
                        async { Outcome::Ack }
                    }
                })
            )*
        }
    };
}

kinds!(
    K0 = "k0",
    K1 = "k1",
    K2 = "k2",
    K3 = "k3",
    K4 = "k4",
    K5 = "k5",
    K6 = "k6",
    K7 = "k7",
    K8 = "k8",
    K9 = "k9",
);

/// Which row numbers a drain saw, and how many twice.
#[derive(Debug)]
struct Seen {
    rows: Vec<AtomicBool>,
    twice: AtomicU64,
    out_of_range: AtomicU64,
}

impl Seen {
    fn new(rows: usize) -> Self {
        Self {
            rows: (0..rows).map(|_| AtomicBool::new(false)).collect(),
            twice: AtomicU64::new(0),
            out_of_range: AtomicU64::new(0),
        }
    }

    fn mark(&self, n: i64) {
        match usize::try_from(n).ok().and_then(|i| self.rows.get(i)) {
            Some(seen) => {
                if seen.swap(true, Ordering::Relaxed) {
                    self.twice.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                self.out_of_range.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// An error naming the duplicates and the missing rows, if any.
    fn check(&self, side: &str) -> Result<(), BoxError> {
        let missing = self
            .rows
            .iter()
            .filter(|s| !s.load(Ordering::Relaxed))
            .count();
        let twice = self.twice.load(Ordering::Relaxed);
        let odd = self.out_of_range.load(Ordering::Relaxed);
        if missing > 0 || twice > 0 || odd > 0 {
            return Err(format!(
                "{side}: {missing} rows never handled, {twice} handled twice, {odd} of unknown numbers"
            )
            .into());
        }
        Ok(())
    }
}

/// The two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Kinds,
    OneType,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Kinds => "kinds",
            Side::OneType => "one type",
        }
    }
}

/// One drain's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Drain {
    /// Seconds from the subscribe to the last ack.
    secs: f64,
    /// The process's CPU seconds (user + system) over the same span.
    cpu: f64,
    /// Claims made.
    claims: OpTotals,
    /// Settlements made.
    settles: OpTotals,
}

/// What one database and mode measured.
#[derive(Debug, Clone)]
struct Result1 {
    db: Db,
    mode: ClaimMode,
    kinds: Vec<Drain>,
    one: Vec<Drain>,
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => f64::midpoint(v[n / 2 - 1], v[n / 2]),
    }
}

fn min_max(xs: &[f64]) -> (f64, f64) {
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, max)
}

fn rate(rows: usize, secs: f64) -> f64 {
    if secs <= 0.0 {
        return 0.0;
    }
    count_f64(u64::try_from(rows).unwrap_or(u64::MAX)) / secs
}

/// The process's CPU seconds so far (user + system, `/proc/self/stat`; 0 elsewhere).
fn cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // The fields after the command's name (which is in parentheses and may hold spaces):
    // utime and stime are the 14th and 15th fields, in clock ticks of 1/100 s on Linux.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    count_f64(tick(11) + tick(12)) / 100.0
}

async fn run(args: &Args) -> Result<(), BoxError> {
    let dbs: Vec<Db> = args
        .db
        .iter()
        .map(|s| Db::parse(s).ok_or_else(|| format!("unknown database {s:?}")))
        .collect::<Result<_, _>>()?;
    let modes: Vec<ClaimMode> = args
        .mode
        .iter()
        .map(|s| parse_mode(s).ok_or_else(|| format!("unknown claim mode {s:?}")))
        .collect::<Result<_, _>>()?;
    if modes
        .iter()
        .any(|m| !matches!(m, ClaimMode::Lease | ClaimMode::RowLock))
    {
        return Err("--mode takes lease and row-lock".into());
    }
    if args.rows == 0 || args.rounds == 0 || args.concurrency == 0 {
        return Err("--rows, --rounds and --concurrency must be at least 1".into());
    }
    let load_start = host::load_average();
    let mut results = Vec::new();
    for db in dbs {
        for &mode in &modes {
            if db == Db::Sqlite && mode == ClaimMode::RowLock {
                continue;
            }
            eprintln!("== {} {mode:?} ==", db.label());
            let r = match db {
                Db::Postgres => on_postgres(args, mode).await,
                Db::MariaDb => on_mariadb(args, mode).await,
                Db::Sqlite => on_sqlite(args, mode).await,
            }
            .map_err(|e| format!("{} {mode:?}: {e}", db.label()))?;
            results.push(r);
        }
    }
    let md = markdown(args, &results, load_start, host::load_average());
    println!("{md}");
    if !args.no_write {
        std::fs::create_dir_all(&args.out)?;
        let path = args.out.join("kinds.md");
        std::fs::write(&path, &md)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn on_postgres(args: &Args, mode: ClaimMode) -> Result<Result1, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(args.pool)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&args.servers.pg_url)
        .await
        .map_err(|e| format!("cannot reach PostgreSQL at {}: {e}", args.servers.pg_url))?;
    let out = measure(
        Db::Postgres,
        mode,
        args,
        Broker::new(Timed::new(PgBackend::new(pool.clone()))),
    )
    .await;
    pool.close().await;
    out
}

async fn on_mariadb(args: &Args, mode: ClaimMode) -> Result<Result1, BoxError> {
    let options = MySqlBackend::connect_options(&args.servers.mysql_url)?;
    let pool = MySqlPoolOptions::new()
        .max_connections(args.pool)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot reach MariaDB at {}: {e}", args.servers.mysql_url))?;
    let out = measure(
        Db::MariaDb,
        mode,
        args,
        Broker::new(Timed::new(MySqlBackend::new(pool.clone()))),
    )
    .await;
    pool.close().await;
    out
}

async fn on_sqlite(args: &Args, mode: ClaimMode) -> Result<Result1, BoxError> {
    let file = std::env::temp_dir().join(format!("sxb-kinds-{}.db", std::process::id()));
    let options = SqliteBackend::connect_options(&format!("sqlite://{}", file.display()))?;
    let pool = SqlitePoolOptions::new()
        .max_connections(args.pool)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await?;
    let out = measure(
        Db::Sqlite,
        mode,
        args,
        Broker::new(Timed::new(SqliteBackend::new(pool.clone()))),
    )
    .await;
    pool.close().await;
    benches::host::remove_sqlite_files(&file);
    out
}

/// The kinds table or the one-type table for `mode`: JSON arguments, a due time, and the
/// kind column on the kinds side.
fn describe(name: &str, mode: ClaimMode, kinds: bool) -> Result<TableDescription, BoxError> {
    let mut b = TableDescription::builder(name);
    if kinds {
        b = b.kind("kind");
    }
    b = b.payload("args", ColumnType::Json).due_at("due_at");
    if mode == ClaimMode::Lease {
        b = b.locked_until("locked_until");
    }
    Ok(b.build()?)
}

/// The rows of a round: row `i` has number `i` and is of kind `KINDS[i % 10]` on the kinds side.
fn row(i: usize) -> Row {
    Row {
        n: i64::try_from(i).unwrap_or(i64::MAX),
        s: format!("row {i} of the bench"),
    }
}

async fn measure<B: Backend>(
    db: Db,
    mode: ClaimMode,
    args: &Args,
    broker: Broker<Timed<B>>,
) -> Result<Result1, BoxError>
where
    KindRow: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    Payload<Json<Row>>: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    Json<Row>: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let pid = std::process::id();
    let kinds_table = describe(&format!("sxb_kinds_{pid}"), mode, true)?;
    let one_table = describe(&format!("sxb_kinds_one_{pid}"), mode, false)?;
    let mut result = Result1 {
        db,
        mode,
        kinds: vec![],
        one: vec![],
    };
    let outcome = async {
        for round in 0..args.rounds {
            let order = if round % 2 == 0 {
                [Side::Kinds, Side::OneType]
            } else {
                [Side::OneType, Side::Kinds]
            };
            let mut line = format!("round {}:", round + 1);
            for side in order {
                let d = match side {
                    Side::Kinds => drain_kinds(args, &broker, &kinds_table).await?,
                    Side::OneType => drain_one(args, &broker, &one_table).await?,
                };
                let _ = write!(
                    line,
                    " {} {:.3} s ({:.0} jobs/s, {:.2} CPU s);",
                    side.label(),
                    d.secs,
                    rate(args.rows, d.secs),
                    d.cpu
                );
                match side {
                    Side::Kinds => result.kinds.push(d),
                    Side::OneType => result.one.push(d),
                }
            }
            eprintln!("{line}");
        }
        Ok::<_, BoxError>(())
    }
    .await;
    for t in [&kinds_table, &one_table] {
        let _ = broker.drop_tables(t).await;
    }
    broker.close().await;
    outcome.map(|()| result)
}

/// Drops `table` (and what the broker made with it) and makes it again, empty.
async fn fresh<B: Backend>(
    broker: &Broker<Timed<B>>,
    table: &TableDescription,
) -> Result<(), BoxError> {
    let _ = broker.drop_tables(table).await;
    broker.create_tables(table).await?;
    Ok(())
}

/// Side A: the rows in the kinds table, one `work` subscription with all 10 workers.
async fn drain_kinds<B: Backend>(
    args: &Args,
    broker: &Broker<Timed<B>>,
    table: &TableDescription,
) -> Result<Drain, BoxError>
where
    KindRow: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    Json<Row>: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    fresh(broker, table).await?;
    let queue = broker.queue::<KindRow>(table.clone()).await?;
    // The rows of all 10 kinds interleaved (row i of kind i % 10) in batches of one payload
    // type: a kind's row is what `new_kind_job` makes of it, the kind's name in the kind column
    // and its arguments as JSON (checked below against `new_kind_job` for the first kind).
    let kind_column = table.kind().ok_or("the kinds table has no kind column")?;
    let made = queue.new_kind_job(K0 { n: 0, s: row(0).s })?;
    let by_hand = NewJob::new(Json(row(0))).column(kind_column, KINDS[0]);
    if format!("{:?}", made.columns()) != format!("{:?}", by_hand.columns()) {
        return Err(format!(
            "the bench's kind rows differ from new_kind_job's: {:?} against {:?}",
            by_hand.columns(),
            made.columns()
        )
        .into());
    }
    publish(args.rows, |start, end| {
        let jobs: Vec<NewJob<Json<Row>>> = (start..end)
            .map(|i| NewJob::new(Json(row(i))).column(kind_column, KINDS[i % KINDS.len()]))
            .collect();
        let queue = &queue;
        async move { queue.publish_batch(&jobs).await.map(drop) }
    })
    .await?;
    let seen = Arc::new(Seen::new(args.rows));
    let workers = all_workers(&seen);
    timed_drain(args, broker, Side::Kinds, &seen, || {
        // `work` is async (it prepares the served table's statements); block on it here, where
        // the clock has started, so both sides time their subscribe.
        queue.work(options(args), workers)
    })
    .await
}

/// Side B: the same rows in a one-type table, one `subscribe`.
async fn drain_one<B: Backend>(
    args: &Args,
    broker: &Broker<Timed<B>>,
    table: &TableDescription,
) -> Result<Drain, BoxError>
where
    Payload<Json<Row>>: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    Json<Row>: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    fresh(broker, table).await?;
    let queue = broker.queue::<Payload<Json<Row>>>(table.clone()).await?;
    publish(args.rows, |start, end| {
        let jobs: Vec<NewJob<Json<Row>>> =
            (start..end).map(|i| NewJob::new(Json(row(i)))).collect();
        let queue = &queue;
        async move { queue.publish_batch(&jobs).await.map(drop) }
    })
    .await?;
    let seen = Arc::new(Seen::new(args.rows));
    let marks = seen.clone();
    timed_drain(args, broker, Side::OneType, &seen, || async {
        queue.subscribe(options(args), move |job: Job<Payload<Json<Row>>>| {
            marks.mark(job.payload().0.0.n);
            async { Outcome::Ack }
        })
    })
    .await
}

/// Publishes `rows` rows in batches of 500 through `batch(start, end)`.
async fn publish<F, Fut>(rows: usize, batch: F) -> Result<(), BoxError>
where
    F: Fn(usize, usize) -> Fut,
    Fut: std::future::Future<Output = broker_core::Result<()>>,
{
    let mut start = 0;
    while start < rows {
        let end = (start + 500).min(rows);
        batch(start, end).await?;
        start = end;
    }
    Ok(())
}

fn options(args: &Args) -> SubscribeOptions {
    SubscribeOptions::new().concurrency(args.concurrency)
}

/// Starts the subscription `subscribe` makes, waits until it has acked every row, stops it and
/// checks what its handler saw.
async fn timed_drain<B, F, Fut>(
    args: &Args,
    broker: &Broker<Timed<B>>,
    side: Side,
    seen: &Seen,
    subscribe: F,
) -> Result<Drain, BoxError>
where
    B: Backend,
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = broker_core::Result<Subscription>>,
{
    let total = u64::try_from(args.rows)?;
    let limit = Duration::from_secs(args.limit);
    let stats_before = broker.backend().stats().snapshot();
    let cpu_before = cpu_secs();
    let started = Instant::now();
    let sub = subscribe().await?;
    let took = loop {
        let acked = sub.metrics().acked;
        if acked >= total {
            break started.elapsed();
        }
        if started.elapsed() > limit {
            sub.shutdown().await;
            return Err(format!(
                "{}: only {acked} of {total} rows acked in {} s",
                side.label(),
                limit.as_secs()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let cpu = cpu_secs() - cpu_before;
    let d = broker.backend().stats().snapshot().since(&stats_before);
    let failed = sub.metrics();
    sub.shutdown().await;
    seen.check(side.label())?;
    if failed.acked != total {
        return Err(format!("{}: {} acks for {total} rows", side.label(), failed.acked).into());
    }
    Ok(Drain {
        secs: took.as_secs_f64(),
        cpu,
        claims: d.op(Op::Claim),
        settles: d.op(Op::Settle),
    })
}

fn mode_label(mode: ClaimMode) -> &'static str {
    match mode {
        ClaimMode::RowLock => "row lock",
        ClaimMode::Lease => "lease",
        _ => "other",
    }
}

fn markdown(
    args: &Args,
    results: &[Result1],
    load_start: Option<String>,
    load_end: Option<String>,
) -> String {
    let mut md = format!(
        "# Job kinds against one type (issue #48)\n\n\
         {rows} rows published up front, then drained by one subscription (concurrency {c}, \
         the default options otherwise; a pool of {pool} connections) whose handler only counts. **kinds**: a kinds table \
         (kind column, JSON arguments, due time), 10 kinds with the same fields `{{n, s}}`, \
         row i of kind i % 10, one `work` subscription registering all 10. **one type**: the \
         same rows' JSON in a one-type table (JSON arguments, due time) read as \
         `Payload<Json<Row>>`, one `subscribe`. Timed from the subscribe to the last ack; every \
         drain checked (each row handled once, none missing). Both tables made afresh each \
         round; the sides alternate (kinds first in odd rounds), {rounds} rounds. Jobs/s are \
         medians; the ratio is the median of the per-round ratios kinds / one type, with their \
         min–max. Want: a ratio of 0.95 or more.\n\n\
         | database | mode | kinds jobs/s | one type jobs/s | kinds / one type (min–max) | client CPU ms per 1,000 jobs, kinds / one type |\n\
         |---|---|---:|---:|---:|---:|\n",
        rows = args.rows,
        c = args.concurrency,
        pool = args.pool,
        rounds = args.rounds,
    );
    for r in results {
        let secs = |d: &[Drain]| d.iter().map(|d| d.secs).collect::<Vec<_>>();
        let cpu_per_k = |d: &[Drain]| {
            median(&d.iter().map(|d| d.cpu).collect::<Vec<_>>()) * 1e6
                / count_f64(u64::try_from(args.rows).unwrap_or(u64::MAX))
        };
        let ratios: Vec<f64> = r
            .kinds
            .iter()
            .zip(&r.one)
            .map(|(k, o)| if k.secs > 0.0 { o.secs / k.secs } else { 0.0 })
            .collect();
        let (lo, hi) = min_max(&ratios);
        let _ = writeln!(
            md,
            "| {} | {} | {:.0} | {:.0} | **{:.3}** ({lo:.3}–{hi:.3}) | {:.1} / {:.1} |",
            r.db.label(),
            mode_label(r.mode),
            rate(args.rows, median(&secs(&r.kinds))),
            rate(args.rows, median(&secs(&r.one))),
            median(&ratios),
            cpu_per_k(&r.kinds),
            cpu_per_k(&r.one),
        );
    }
    md.push_str(
        "\nEvery round (jobs/s, kinds then one type), and the claims and settlements of all \
         rounds (per 1,000 rows: claims, rows per claim, mean ms as the client saw it; \
         settlements and their mean ms):\n\n\
         | database | mode | rounds: kinds / one type jobs/s | kinds calls | one type calls |\n\
         |---|---|---|---|---|\n",
    );
    for r in results {
        let rounds = r
            .kinds
            .iter()
            .zip(&r.one)
            .map(|(k, o)| {
                format!(
                    "{:.0} / {:.0}",
                    rate(args.rows, k.secs),
                    rate(args.rows, o.secs)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            md,
            "| {} | {} | {rounds} | {} | {} |",
            r.db.label(),
            mode_label(r.mode),
            calls(&r.kinds, args.rows),
            calls(&r.one, args.rows),
        );
    }
    let _ = writeln!(
        md,
        "\n{} CPUs, shared with other builds and tests while this ran (indicative figures); \
         load average at start {}, at end {}. The database servers run on the same machine, so \
         the client CPU column is the bench process's alone. PostgreSQL runs here with \
         autovacuum off (each round's tables are new, so no round inherits another's dead rows).",
        host::cpus(),
        load_start.as_deref().unwrap_or("?"),
        load_end.as_deref().unwrap_or("?"),
    );
    let _ = writeln!(md, "\n`{}`", host::command_line());
    md
}

/// `claims (rows per claim, ms) / settlements (ms)` per 1,000 rows over all rounds of a side.
fn calls(drains: &[Drain], rows: usize) -> String {
    let mut claims = OpTotals::default();
    let mut settles = OpTotals::default();
    for d in drains {
        for (sum, o) in [(&mut claims, d.claims), (&mut settles, d.settles)] {
            sum.calls += o.calls;
            sum.nanos += o.nanos;
            sum.rows += o.rows;
        }
    }
    let all = count_f64(u64::try_from(rows * drains.len().max(1)).unwrap_or(u64::MAX));
    format!(
        "{:.0} claims ({:.1} rows, {:.2} ms), {:.0} settlements ({:.2} ms)",
        count_f64(claims.calls) * 1000.0 / all,
        claims.rows_per_call(),
        claims.mean_ms(),
        count_f64(settles.calls) * 1000.0 / all,
        settles.mean_ms(),
    )
}
