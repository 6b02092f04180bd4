//! Many queues on one pool (issue #32, item 1): a broker whose pool has 10 connections serves 50
//! lease tables, one subscription each, all with the same options (8 deliveries in work, batch
//! as large, the default 1 s poll and 25 ms cooldown). Per database:
//!
//! 1. **Idle**: once the subscriptions have settled, the most pool connections out
//!    (`size - idle`, read every 5 ms for 2 s), the connections the pool has open, and on
//!    PostgreSQL the server sessions of the broker's application name (`pg_stat_activity`, the
//!    listening connection included). Want: at most 2 out of the pool.
//! 2. **Many**: 100 rows published into each queue (one batch per queue, queue after queue) from
//!    another broker on a pool of its own, so only the database can wake the subscriptions
//!    (LISTEN/NOTIFY on PostgreSQL; the poll elsewhere), and the time from the first publish until
//!    all 5,000 are acked.
//! 3. **One**: the same 5,000 rows (50 batches of 100) published into one queue that one
//!    subscription with the same options drains, on a broker whose pool also has 10 connections.
//!
//! Many and one alternate, `--rounds` times each, and the medians are reported with their ratio
//! (many rows/s over one rows/s; want: about 1). Prints a markdown table and writes
//! `benches/results/queues.md`.
//!
//! `cargo run --manifest-path benches/Cargo.toml --release --bin queues` (see `--help`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use benches::BoxError;
use benches::Timed;
use benches::cli::ServerUrls;
use benches::drain::{self, Row};
use benches::host;
use benches::scenario::Db;
use benches::timed::{Op, OpTotals, Stats, StatsSnapshot};
use broker_core::{
    Backend, Broker, ClaimMode, NewJob, Outcome, Queue, SubscribeOptions, Subscription,
    TableDescription,
};
use broker_mysql::MySqlBackend;
use broker_postgres::PgBackend;
use broker_sqlite::SqliteBackend;
use clap::Parser;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{Database, FromRow, PgPool};

/// Many queue tables on one pool: connections held at idle, and 100 rows in each of 50 queues
/// against 5,000 rows in one.
#[derive(Debug, Parser)]
struct Args {
    /// Databases (postgres, mariadb, sqlite).
    #[arg(long, value_delimiter = ',', default_value = "postgres,mariadb,sqlite")]
    db: Vec<String>,
    /// Queue tables, one subscription each.
    #[arg(long, default_value_t = 50)]
    queues: usize,
    /// Rows published into each queue (the single queue gets queues × rows).
    #[arg(long, default_value_t = 100)]
    rows: usize,
    /// Connections in the consumers' pools.
    #[arg(long, default_value_t = 10)]
    pool: u32,
    /// Deliveries in work at once per subscription.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Runs of each side; the medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds to let the subscriptions settle before the idle reading.
    #[arg(long, default_value_t = 3.0)]
    settle: f64,
    /// Seconds of the idle reading.
    #[arg(long, default_value_t = 2.0)]
    idle: f64,
    /// Where to write `queues.md`.
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

/// What one database measured.
#[derive(Debug, Clone)]
struct DbResult {
    db: Db,
    /// Connections the consumer's pool had open at the end of the idle reading.
    open_at_idle: u32,
    /// The most connections out of the consumer's pool during the idle reading.
    out_at_idle: u32,
    /// The share of the idle readings with more than 2 out, per cent.
    above_two_pct: f64,
    /// PostgreSQL: the most server sessions of the consumer's application name.
    sessions_at_idle: Option<i64>,
    /// The most connections out of the consumer's pool while the many queues drained.
    out_in_drain: u32,
    /// Seconds from the first publish to the last ack, each round, many queues.
    many: Vec<f64>,
    /// The same, one queue.
    one: Vec<f64>,
    /// Seconds the publishes took, each round, many queues then one.
    publish_many: Vec<f64>,
    publish_one: Vec<f64>,
    /// Claims that failed (the engine retries them) while draining, many queues then one.
    claim_errors_many: u64,
    claim_errors_one: u64,
    /// Claims the idle subscriptions made per second during the idle reading.
    idle_claims_per_s: f64,
    /// Claims and settlements while draining, all rounds, many queues then one.
    calls_many: Calls,
    calls_one: Calls,
}

/// Claims and settlements made through a [`Timed`] backend, summed over rounds.
#[derive(Debug, Clone, Copy, Default)]
struct Calls {
    claims: OpTotals,
    settles: OpTotals,
}

impl Calls {
    /// Adds what `stats` counted since `before`.
    fn add(&mut self, stats: &Stats, before: &StatsSnapshot) {
        let d = stats.snapshot().since(before);
        for (sum, op) in [
            (&mut self.claims, Op::Claim),
            (&mut self.settles, Op::Settle),
        ] {
            let o = d.op(op);
            sum.calls += o.calls;
            sum.nanos += o.nanos;
            sum.rows += o.rows;
        }
    }

    /// `claims (rows per claim, mean ms) / settlements (mean ms)`, per 1,000 rows.
    fn describe(&self, rows: u64) -> String {
        let per_k =
            |n: u64| benches::timed::count_f64(n) * 1000.0 / benches::timed::count_f64(rows.max(1));
        format!(
            "{:.0} claims ({:.1} rows, {:.1} ms each), {:.0} settlements ({:.1} ms each)",
            per_k(self.claims.calls),
            self.claims.rows_per_call(),
            self.claims.mean_ms(),
            per_k(self.settles.calls),
            self.settles.mean_ms(),
        )
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

fn rate(rows: usize, secs: f64) -> f64 {
    if secs <= 0.0 {
        return 0.0;
    }
    benches::timed::count_f64(u64::try_from(rows).unwrap_or(u64::MAX)) / secs
}

async fn run(args: &Args) -> Result<(), BoxError> {
    let dbs: Vec<Db> = args
        .db
        .iter()
        .map(|s| Db::parse(s).ok_or_else(|| format!("unknown database {s:?}")))
        .collect::<Result<_, _>>()?;
    if args.queues == 0 || args.rows == 0 || args.rounds == 0 || args.concurrency == 0 {
        return Err("--queues, --rows, --rounds and --concurrency must be at least 1".into());
    }
    let load_start = host::load_average();
    let mut results = Vec::new();
    for db in dbs {
        eprintln!("== {} ==", db.label());
        let r = match db {
            Db::Postgres => on_postgres(args).await,
            Db::MariaDb => on_mariadb(args).await,
            Db::Sqlite => on_sqlite(args).await,
        }
        .map_err(|e| format!("{}: {e}", db.label()))?;
        results.push(r);
    }
    let md = markdown(args, &results, load_start, host::load_average());
    println!("{md}");
    if !args.no_write {
        std::fs::create_dir_all(&args.out)?;
        let path = args.out.join("queues.md");
        std::fs::write(&path, &md)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The application name of one of this run's pools on PostgreSQL.
fn app_name(role: &str) -> String {
    format!("sxb_queues_{role}_{}", std::process::id())
}

async fn on_postgres(args: &Args) -> Result<DbResult, BoxError> {
    let base = PgConnectOptions::from_str(&args.servers.pg_url)?;
    let pool = |role: &str, size: u32| {
        PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(base.clone().application_name(&app_name(role)))
    };
    let consumer = pool("many", args.pool).await?;
    let single = pool("one", args.pool).await?;
    let publisher = pool("publisher", 4).await?;
    let monitor = pool("monitor", 1).await?;
    let out = measure(
        Db::Postgres,
        args,
        Broker::new(Timed::new(PgBackend::new(consumer.clone()))),
        Broker::new(Timed::new(PgBackend::new(single.clone()))),
        Broker::new(Timed::new(PgBackend::new(publisher.clone()))),
        Some((monitor.clone(), app_name("many"))),
    )
    .await;
    for p in [consumer, single, publisher, monitor] {
        p.close().await;
    }
    out
}

async fn on_mariadb(args: &Args) -> Result<DbResult, BoxError> {
    let options = MySqlBackend::connect_options(&args.servers.mysql_url)?;
    let pool = |size: u32| {
        MySqlPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
    };
    let (consumer, single, publisher) = (
        pool(args.pool).await?,
        pool(args.pool).await?,
        pool(4).await?,
    );
    let out = measure(
        Db::MariaDb,
        args,
        Broker::new(Timed::new(MySqlBackend::new(consumer.clone()))),
        Broker::new(Timed::new(MySqlBackend::new(single.clone()))),
        Broker::new(Timed::new(MySqlBackend::new(publisher.clone()))),
        None,
    )
    .await;
    for p in [consumer, single, publisher] {
        p.close().await;
    }
    out
}

async fn on_sqlite(args: &Args) -> Result<DbResult, BoxError> {
    let file = std::env::temp_dir().join(format!("sxb-queues-{}.db", std::process::id()));
    let options = SqliteBackend::connect_options(&format!("sqlite://{}", file.display()))?;
    let pool = |size: u32| {
        SqlitePoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.clone())
    };
    let (consumer, single, publisher) = (
        pool(args.pool).await?,
        pool(args.pool).await?,
        pool(4).await?,
    );
    let out = measure(
        Db::Sqlite,
        args,
        Broker::new(Timed::new(SqliteBackend::new(consumer.clone()))),
        Broker::new(Timed::new(SqliteBackend::new(single.clone()))),
        Broker::new(Timed::new(SqliteBackend::new(publisher.clone()))),
        None,
    )
    .await;
    for p in [consumer, single, publisher] {
        p.close().await;
    }
    benches::host::remove_sqlite_files(&file);
    out
}

/// The options of every subscription in the run.
fn options(args: &Args, name: String) -> SubscribeOptions {
    SubscribeOptions::new()
        .name(name)
        .concurrency(args.concurrency)
}

/// Connections out of `pool` now.
fn out_of<DB: Database>(pool: &sqlx::Pool<DB>) -> u32 {
    pool.size()
        .saturating_sub(u32::try_from(pool.num_idle()).unwrap_or(u32::MAX))
}

/// Connections out of a pool, read every 5 ms.
#[derive(Debug, Default)]
struct OutReading {
    /// The most out at once.
    most: AtomicU32,
    /// Readings taken.
    samples: AtomicU32,
    /// Readings with more than 2 out.
    above_two: AtomicU32,
}

impl OutReading {
    fn most(&self) -> u32 {
        self.most.load(Ordering::Relaxed)
    }

    /// The share of readings with more than 2 out, in per cent.
    fn above_two_pct(&self) -> f64 {
        let n = f64::from(self.samples.load(Ordering::Relaxed).max(1));
        f64::from(self.above_two.load(Ordering::Relaxed)) * 100.0 / n
    }
}

/// Reads the connections out of `pool` every 5 ms until `stop` is set.
fn watch_out<DB: Database>(pool: sqlx::Pool<DB>, stop: Arc<AtomicBool>) -> Arc<OutReading> {
    let reading = Arc::new(OutReading::default());
    let r = reading.clone();
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            let out = out_of(&pool);
            r.most.fetch_max(out, Ordering::Relaxed);
            r.samples.fetch_add(1, Ordering::Relaxed);
            if out > 2 {
                r.above_two.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    reading
}

/// The server sessions of `app` on PostgreSQL.
async fn sessions(monitor: &PgPool, app: &str) -> Result<i64, BoxError> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
            .bind(app)
            .fetch_one(monitor)
            .await?,
    )
}

async fn measure<B: Backend>(
    db: Db,
    args: &Args,
    consumer: Broker<Timed<B>>,
    single: Broker<Timed<B>>,
    publisher: Broker<Timed<B>>,
    pg_sessions: Option<(PgPool, String)>,
) -> Result<DbResult, BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let pid = std::process::id();
    let tables: Vec<TableDescription> = (0..args.queues)
        .map(|i| drain::describe(&format!("sxb_q_{pid}_{i}"), ClaimMode::Lease, None))
        .collect::<Result<_, _>>()?;
    let one = drain::describe(&format!("sxb_q_{pid}_one"), ClaimMode::Lease, None)?;
    let all: Vec<&TableDescription> = tables.iter().chain([&one]).collect();
    for t in &all {
        let _ = consumer.drop_tables(t).await;
        consumer.create_tables(t).await?;
    }
    let result = measure_on(
        db,
        args,
        &consumer,
        &single,
        &publisher,
        &tables,
        &one,
        pg_sessions,
    )
    .await;
    for t in &all {
        let _ = consumer.drop_tables(t).await;
    }
    for b in [&consumer, &single, &publisher] {
        b.close().await;
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn measure_on<B: Backend>(
    db: Db,
    args: &Args,
    consumer: &Broker<Timed<B>>,
    single: &Broker<Timed<B>>,
    publisher: &Broker<Timed<B>>,
    tables: &[TableDescription],
    one: &TableDescription,
    pg_sessions: Option<(PgPool, String)>,
) -> Result<DbResult, BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let handler = |_job| async { Outcome::Ack };
    let mut subs: Vec<Subscription> = Vec::new();
    let mut into: Vec<Queue<Timed<B>, Row>> = Vec::new();
    for (i, t) in tables.iter().enumerate() {
        let q = consumer.queue::<Row>(t.clone()).await?;
        subs.push(q.subscribe(options(args, format!("q{i}")), handler)?);
        into.push(publisher.queue::<Row>(t.clone()).await?);
    }
    let one_sub = single
        .queue::<Row>(one.clone())
        .await?
        .subscribe(options(args, "one".into()), handler)?;
    let into_one = publisher.queue::<Row>(one.clone()).await?;

    tokio::time::sleep(Duration::from_secs_f64(args.settle)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let most = watch_out(consumer.pool().clone(), stop.clone());
    let idle_before = consumer.backend().stats().snapshot();
    let reading = Instant::now();
    let mut most_sessions = None;
    while reading.elapsed().as_secs_f64() < args.idle {
        if let Some((monitor, app)) = &pg_sessions {
            let n = sessions(monitor, app).await?;
            most_sessions = Some(most_sessions.unwrap_or(0).max(n));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let idle_claims = consumer
        .backend()
        .stats()
        .snapshot()
        .since(&idle_before)
        .op(Op::Claim)
        .calls;
    let idle_claims_per_s =
        benches::timed::count_f64(idle_claims) / reading.elapsed().as_secs_f64();
    let out_at_idle = most.most();
    let above_two_pct = most.above_two_pct();
    let open_at_idle = consumer.pool().size();
    eprintln!(
        "idle: at most {out_at_idle} of {open_at_idle} open connections out of the pool (size {}; more than 2 in {above_two_pct:.1}% of readings), {idle_claims_per_s:.0} claims/s{}",
        args.pool,
        most_sessions.map_or(String::new(), |s| format!(", {s} server sessions"))
    );

    let batch: Vec<NewJob<String>> = (0..args.rows)
        .map(|i| NewJob::new(format!("job-{i}")))
        .collect();
    let total = args.queues * args.rows;
    let mut result = DbResult {
        db,
        open_at_idle,
        out_at_idle,
        above_two_pct,
        sessions_at_idle: most_sessions,
        out_in_drain: 0,
        many: vec![],
        one: vec![],
        publish_many: vec![],
        publish_one: vec![],
        claim_errors_many: 0,
        claim_errors_one: 0,
        idle_claims_per_s,
        calls_many: Calls::default(),
        calls_one: Calls::default(),
    };
    let claim_errors =
        |subs: &[&Subscription]| subs.iter().map(|s| s.metrics().claim_errors).sum::<u64>();
    let acked = |subs: &[&Subscription]| subs.iter().map(|s| s.metrics().acked).sum::<u64>();
    let many_subs: Vec<&Subscription> = subs.iter().collect();
    for round in 0..args.rounds {
        // Many queues: a batch into each.
        let stop = Arc::new(AtomicBool::new(false));
        let most = watch_out(consumer.pool().clone(), stop.clone());
        let before = acked(&many_subs);
        let errors_before = claim_errors(&many_subs);
        let stats_before = consumer.backend().stats().snapshot();
        let started = Instant::now();
        for q in &into {
            q.publish_batch(&batch).await?;
        }
        let published = started.elapsed();
        let took = wait_acked(started, || acked(&many_subs) - before, total).await?;
        stop.store(true, Ordering::Relaxed);
        result.claim_errors_many += claim_errors(&many_subs) - errors_before;
        result
            .calls_many
            .add(consumer.backend().stats(), &stats_before);
        result.out_in_drain = result.out_in_drain.max(most.most());
        result.many.push(took.as_secs_f64());
        result.publish_many.push(published.as_secs_f64());
        // One queue: as many batches into it.
        let before = acked(&[&one_sub]);
        let errors_before = claim_errors(&[&one_sub]);
        let stats_before = single.backend().stats().snapshot();
        let started = Instant::now();
        for _ in 0..args.queues {
            into_one.publish_batch(&batch).await?;
        }
        let published = started.elapsed();
        let took_one = wait_acked(started, || acked(&[&one_sub]) - before, total).await?;
        result.claim_errors_one += claim_errors(&[&one_sub]) - errors_before;
        result
            .calls_one
            .add(single.backend().stats(), &stats_before);
        result.one.push(took_one.as_secs_f64());
        result.publish_one.push(published.as_secs_f64());
        eprintln!(
            "round {}: {} queues x {} rows in {:.3} s ({:.0} rows/s), 1 queue x {total} rows in {:.3} s ({:.0} rows/s); failed claims so far {} / {}",
            round + 1,
            args.queues,
            args.rows,
            took.as_secs_f64(),
            rate(total, took.as_secs_f64()),
            took_one.as_secs_f64(),
            rate(total, took_one.as_secs_f64()),
            result.claim_errors_many,
            result.claim_errors_one,
        );
    }
    for s in subs {
        s.shutdown().await;
    }
    one_sub.shutdown().await;
    Ok(result)
}

/// Waits until `acked()` reaches `total`; the time since `started` (the caller's clock, started
/// before its publishes).
async fn wait_acked(
    started: Instant,
    acked: impl Fn() -> u64,
    total: usize,
) -> Result<Duration, BoxError> {
    let total = u64::try_from(total)?;
    let limit = Duration::from_secs(120);
    loop {
        let n = acked();
        if n >= total {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            return Err(format!("only {n} of {total} rows acked in {} s", limit.as_secs()).into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn markdown(
    args: &Args,
    results: &[DbResult],
    load_start: Option<String>,
    load_end: Option<String>,
) -> String {
    let total = args.queues * args.rows;
    let mut md = format!(
        "# Many queues on one pool (issue #32)\n\n\
         {q} lease tables on one broker whose pool has {p} connections, one subscription each \
         (concurrency {c}, batch {c}, poll 1 s, cooldown 25 ms: the defaults but the \
         concurrency). **Idle**: after {settle} s to settle, the most connections out of the \
         pool (size - idle, read every 5 ms for {idle} s, and the share of readings above 2); on PostgreSQL also the server \
         sessions of the pool's application name (its connections and the broker's listening \
         connection). **Many**: {r} rows published into each queue (one batch per queue, queue \
         after queue) from another broker on a pool of its own (so only the database wakes the \
         subscriptions: LISTEN/NOTIFY on PostgreSQL, the poll elsewhere), timed from the first \
         publish to the last ack. **One**: {total} rows (batches of {r}) into one queue that \
         one subscription with the same options drains, on a broker whose pool also has {p} \
         connections. Many and one alternate, {rounds} rounds each; medians. Want: at most 2 \
         connections out at idle; ratio about 1.\n\n\
         | database | open / most out at idle | readings with > 2 out | server sessions at idle | out while draining | many: s (rows/s) | one: s (rows/s) | many / one |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        q = args.queues,
        p = args.pool,
        c = args.concurrency,
        settle = args.settle,
        idle = args.idle,
        r = args.rows,
        rounds = args.rounds,
    );
    for r in results {
        let (many, one) = (median(&r.many), median(&r.one));
        let _ = writeln!(
            md,
            "| {} | {} / **{}** | {:.1}% | {} | {} | {:.3} ({:.0}) | {:.3} ({:.0}) | **{:.2}** |",
            r.db.label(),
            r.open_at_idle,
            r.out_at_idle,
            r.above_two_pct,
            r.sessions_at_idle
                .map_or_else(|| "-".to_owned(), |s| s.to_string()),
            r.out_in_drain,
            many,
            rate(total, many),
            one,
            rate(total, one),
            if many > 0.0 { one / many } else { 0.0 },
        );
    }
    md.push_str("\nEvery round (s from first publish to last ack; of it, publishing), and the claims that failed while draining (the engine retries them), all rounds:\n\n| database | many | one | failed claims many / one |\n|---|---|---|---:|\n");
    for r in results {
        let fmt = |t: &[f64], p: &[f64]| {
            t.iter()
                .zip(p)
                .map(|(t, p)| format!("{t:.3} ({p:.3})"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} / {} |",
            r.db.label(),
            fmt(&r.many, &r.publish_many),
            fmt(&r.one, &r.publish_one),
            r.claim_errors_many,
            r.claim_errors_one,
        );
    }
    md.push_str("\nWhat the consumers ran (per 1,000 rows, all rounds; the statements' time as the client saw it, waits for a connection and a lock included), and the claims the idle subscriptions made per second:\n\n| database | many | one | idle claims/s |\n|---|---|---|---:|\n");
    let rows = u64::try_from(total * args.rounds).unwrap_or(u64::MAX);
    for r in results {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} |",
            r.db.label(),
            r.calls_many.describe(rows),
            r.calls_one.describe(rows),
            r.idle_claims_per_s,
        );
    }
    let _ = writeln!(
        md,
        "\n{} CPUs, load average at start {}, at end {} (a shared machine: indicative figures).",
        host::cpus(),
        load_start.as_deref().unwrap_or("?"),
        load_end.as_deref().unwrap_or("?"),
    );
    let _ = writeln!(md, "\n`{}`", host::command_line());
    md
}
