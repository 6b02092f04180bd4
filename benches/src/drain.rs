//! Draining a filled table: by the engine (a subscription), and by loop sides (plain tokio tasks:
//! the hand-written loop of [`handwritten`](crate::handwritten), or the strategy loop below),
//! timed the same way.
//!
//! # How a run is timed
//! The first rows of a run are a warm-up (connections opened, statements prepared, the engine's
//! claim loop started); the clock starts when the acked count reaches the warm-up count and stops
//! when it reaches the row count, so both sides are timed over the same steady-state stretch.
//! A watcher reads the acked count every millisecond; it also records the longest gap between two
//! acks (a stall) and, for the engine, the mean number of deliveries in work. A run that passes
//! its time cap stops there and reports the rate it had (marked capped).
//!
//! # The strategy loop
//! N tokio tasks, each: claim (up to the batch size), then settle each row in turn with an ack,
//! using the same [`Prepared`] strategy objects the engine uses, so the statements are the ones
//! the engine runs (the baseline of FIFO tables, which have no hand-written loop). Per mode:
//! - row lock: `claim(now)` → `settle(tx, ..)` with the attempt as read;
//! - lease: `claim(batch, now, expiry)` → `settle(token, ..)` per row, attempt + 1;
//! - advisory: `candidates(max(4 × batch, 16))` (or, when every candidate's key is held, as on
//!   FIFO tables, `walk_keys` from the first key), then per candidate until `batch` rows are done:
//!   `try_lock` → `take` → `settle` → `unlock` (one key held at a time per task), with an
//!   in-process set of keys in work so a task does not spend a statement on a key another task
//!   holds (the engine keeps the same set).
//!
//! A task whose claim comes back empty (a FIFO group's head is in work, or the table's tail is
//! in other tasks' hands) waits until another task settles a row (or 5 ms) and claims again.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_core::driver::{
    Action, AdvisoryStrategy, ClaimedRow, LeaseStrategy, LeaseToken, Prepared, RowLockStrategy,
    Settle,
};
use broker_core::{
    Backend, Broker, ClaimMode, ColumnType, NewJob, Outcome, Payload, Queue, SubscribeOptions,
    TableDescription, driver::clock,
};
use sqlx::{Database, FromRow};
use std::future::Future;
use std::pin::Pin;

use tokio::sync::Notify;
use tokio::sync::futures::Notified;

use crate::BoxError;
use crate::scenario::Scenario;
use crate::timed::{Stats, StatsSnapshot, count_f64};

/// The row type both sides read: the payload column as text.
pub type Row = Payload<String>;

/// How long a raw task whose claim came back empty waits at most before claiming again.
const EMPTY_WAIT: Duration = Duration::from_millis(5);

/// How many distinct advisory keys a table's rows use (row `i` gets key `i % KEYS`).
pub const KEYS: usize = 1024;

/// The description of a benchmark table: a text payload, a due-time column, plus what `mode` needs
/// (`locked_until`; or a key column `k` with the template `"k-{k}"`), and a group column with
/// `fifo(true)` when `fifo_groups` is set.
pub fn describe(
    name: &str,
    mode: ClaimMode,
    fifo_groups: Option<usize>,
) -> Result<TableDescription, BoxError> {
    // A due-time column, as real job tables have (scheduled rows, delayed retries): the claim
    // then filters on it, as it would in production.
    let mut b = TableDescription::builder(name)
        .payload("payload", ColumnType::Text)
        .due_at("due_at");
    b = match mode {
        ClaimMode::RowLock => b,
        ClaimMode::Lease => b.locked_until("locked_until"),
        ClaimMode::Advisory => b.column("k", ColumnType::Text).advisory_lock("k-{k}"),
        other => panic!("no bench table for {other:?}"),
    };
    if fifo_groups.is_some() {
        b = b.group("grp").fifo(true);
    }
    Ok(b.build()?)
}

/// Inserts `rows` rows into `table` through the backend's publish (no subscription is woken):
/// row `i` gets payload `job-i`, advisory key `k{i % 1024}`, and FIFO group `g{i % groups}`.
pub async fn fill<B: Backend>(
    broker: &Broker<B>,
    table: &TableDescription,
    rows: usize,
    groups: Option<usize>,
) -> Result<(), BoxError>
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    let mut conn = broker.pool().acquire().await?;
    let mut start = 0;
    while start < rows {
        let end = (start + 500).min(rows);
        let jobs: Vec<NewJob<String>> = (start..end)
            .map(|i| {
                let mut job = NewJob::new(format!("job-{i}"));
                if table.advisory_lock().is_some() {
                    job = job.column("k", format!("k{}", i % KEYS));
                }
                if let Some(g) = groups {
                    job = job.group(format!("g{}", i % g.max(1)));
                }
                job
            })
            .collect();
        broker.backend().publish(&mut *conn, table, &jobs).await?;
        start = end;
    }
    Ok(())
}

/// A table name no other run uses (`side` is e.g. `e` or `r`).
pub fn table_name(side: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("sxb_bench_{}_{n}_{side}", std::process::id())
}

/// How long a run may take, and which of its rows are warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunLimits {
    /// Rows in the table.
    pub rows: u64,
    /// Rows acked before the clock starts.
    pub warmup: u64,
    /// The run stops here even if rows are left.
    pub cap: Duration,
}

impl RunLimits {
    /// `rows` rows with a tenth of them as warm-up (at least one batch per worker, at most half).
    pub fn new(rows: u64, scenario: &Scenario, cap: Duration) -> Self {
        let per_round = u64::try_from(scenario.workers * scenario.batch).unwrap_or(u64::MAX);
        let warmup = (rows / 10).max(per_round).min(rows / 2);
        Self { rows, warmup, cap }
    }
}

/// What one side of a scenario did in its timed stretch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunResult {
    /// Rows acked while the clock ran.
    pub timed_rows: u64,
    /// How long the clock ran.
    pub elapsed: Duration,
    /// Whether the run hit its time cap with rows left.
    pub capped: bool,
    /// The longest gap between two acks while the clock ran.
    pub max_stall: Duration,
    /// Engine only: mean deliveries in work while the clock ran.
    pub mean_in_work: Option<f64>,
    /// Strategy calls made while the clock ran, when the backend is [`Timed`](crate::Timed).
    pub stats: Option<StatsSnapshot>,
    /// CPU time the whole bench process used while the clock ran (user and system; on Linux,
    /// else `None`). Only one side runs at a time, so it is that side's client work, plus
    /// SQLite's own where the database runs in the process.
    pub cpu: Option<Duration>,
}

impl RunResult {
    /// Messages per second (0 when nothing was timed).
    pub fn rate(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs <= 0.0 {
            return 0.0;
        }
        count_f64(self.timed_rows) / secs
    }

    /// The process's CPU time per acked row while the clock ran, in microseconds.
    pub fn cpu_us_per_row(&self) -> Option<f64> {
        let cpu = self.cpu?;
        (self.timed_rows > 0).then(|| cpu.as_secs_f64() * 1e6 / count_f64(self.timed_rows))
    }
}

/// CPU time this process has used so far (user and system, every thread, those ended too),
/// from `/proc/self/stat`: `None` where that is not there. Linux counts it in ticks of 1/100 s
/// (`USER_HZ`), fine enough against timed stretches of a second or more.
fn process_cpu() -> Option<Duration> {
    const TICKS_PER_SECOND: u64 = 100;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count from after it.
    // Field 3 is the state; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis(
        (utime + stime) * 1000 / TICKS_PER_SECOND,
    ))
}

/// What the watcher reads.
struct Progress {
    acked: u64,
    in_work: u64,
    failed: bool,
}

/// Watches a run until `limits.rows` rows are acked, the cap passes, or the run fails.
async fn watch(
    limits: RunLimits,
    stats: Option<&Stats>,
    engine: bool,
    read: impl Fn() -> Progress,
) -> RunResult {
    let begin = Instant::now();
    let deadline = begin + limits.cap;
    let begin_stats = stats.map(Stats::snapshot);
    let mut start: Option<(Instant, u64, Option<StatsSnapshot>)> = None;
    let mut cpu0 = process_cpu();
    let mut last_acked = 0;
    let mut last_change = begin;
    // The longest gap between acks while the clock ran, and since the beginning (reported for
    // a run capped during its warm-up).
    let (mut max_stall, mut max_stall_all) = (Duration::ZERO, Duration::ZERO);
    let (mut in_work_sum, mut samples) = (0u64, 0u64);
    let (end, acked_end, capped) = loop {
        let now = Instant::now();
        let p = read();
        if p.acked != last_acked {
            if start.is_some() {
                max_stall = max_stall.max(now - last_change);
            }
            max_stall_all = max_stall_all.max(now - last_change);
            last_acked = p.acked;
            last_change = now;
        }
        if start.is_none() && p.acked >= limits.warmup {
            start = Some((now, p.acked, stats.map(Stats::snapshot)));
            cpu0 = process_cpu();
        }
        if start.is_some() {
            in_work_sum += p.in_work;
            samples += 1;
        }
        if p.acked >= limits.rows || p.failed {
            break (now, p.acked, false);
        }
        if now >= deadline {
            max_stall = max_stall.max(now - last_change);
            max_stall_all = max_stall_all.max(now - last_change);
            break (now, p.acked, true);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    // A run capped during its warm-up is timed from its beginning.
    if start.is_none() {
        max_stall = max_stall_all;
    }
    let (t0, acked0, stats0) = start.unwrap_or((begin, 0, begin_stats));
    let cpu = process_cpu()
        .zip(cpu0)
        .map(|(end, begin)| end.saturating_sub(begin));
    RunResult {
        timed_rows: acked_end.saturating_sub(acked0),
        elapsed: end - t0,
        capped,
        max_stall,
        mean_in_work: (engine && samples > 0).then(|| count_f64(in_work_sum) / count_f64(samples)),
        stats: match (stats, stats0) {
            (Some(s), Some(s0)) => Some(s.snapshot().since(&s0)),
            _ => None,
        },
        cpu,
    }
}

/// Times a side whose acks `read` counts (see [`watch`]).
pub async fn watch_count(limits: RunLimits, read: impl Fn() -> u64) -> RunResult {
    watch(limits, None, false, || Progress {
        acked: read(),
        in_work: 0,
        failed: false,
    })
    .await
}

/// The engine side: subscribes with `concurrency(workers)` and `batch_size(batch)` and an
/// instant-ack handler, and times it until the table's rows are acked.
pub async fn engine_run<B: Backend>(
    queue: &Queue<B, Row>,
    scenario: &Scenario,
    limits: RunLimits,
    stats: Option<&Stats>,
) -> Result<RunResult, BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    let base = queue.metrics();
    let sub = queue.subscribe(
        SubscribeOptions::new()
            .name("bench")
            .concurrency(scenario.workers)
            .batch_size(scenario.batch)
            .shutdown_timeout(Duration::from_secs(10)),
        |_| async { Outcome::Ack },
    )?;
    let result = watch(limits, stats, true, || {
        let m = queue.metrics();
        Progress {
            acked: m.acked - base.acked,
            in_work: m.in_work,
            failed: false,
        }
    })
    .await;
    sub.shutdown().await;
    let m = queue.metrics();
    let lost = m.lease_lost - base.lease_lost;
    let retried = m.retried - base.retried;
    if lost + retried > 0 {
        return Err(format!(
            "{}: the engine lost {lost} leases and retried {retried} rows; every row should be acked once",
            scenario.id()
        )
        .into());
    }
    Ok(result)
}

/// State the tasks of a loop side (the hand-written loop or the strategy loop) share.
#[derive(Debug, Default)]
pub struct LoopShared {
    total: u64,
    acked: AtomicU64,
    stop: AtomicBool,
    failed: AtomicBool,
    /// Wakes tasks whose claim came back empty: a settled row may have freed a FIFO group.
    settled: Notify,
    /// Advisory keys in work in this process.
    keys: Mutex<HashSet<String>>,
}

impl LoopShared {
    /// Whether the run is over (every row acked, or stopped).
    pub fn finished(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.acked.load(Ordering::Relaxed) >= self.total
    }

    /// Counts one acked row and wakes idle tasks.
    pub fn acked_one(&self) {
        self.acked.fetch_add(1, Ordering::Relaxed);
        self.settled.notify_waiters();
    }

    /// Counts a fenced ack: exactly one row must have changed, or the lease was lost, which no
    /// run without failures may see.
    pub fn fenced(&self, id: i64, changed: u64) -> Result<(), BoxError> {
        if changed != 1 {
            return Err(format!("row {id}: the lease was lost before its ack").into());
        }
        self.acked_one();
        Ok(())
    }

    /// Takes an in-process key; `false` when another task holds it.
    pub fn reserve(&self, key: &str) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_owned())
    }

    /// Frees an in-process key.
    pub fn release(&self, key: &str) {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }

    /// The signal [`idle`](Self::idle) waits for; take it (pinned and enabled) before a claim,
    /// so a settlement during the claim is not missed.
    pub fn idle_signal(&self) -> Notified<'_> {
        self.settled.notified()
    }

    /// After an empty claim: waits until another task settles a row, or a short while.
    pub async fn idle(&self, signal: Pin<&mut Notified<'_>>) {
        if self.finished() {
            return;
        }
        tokio::select! {
            () = signal => {}
            () = tokio::time::sleep(EMPTY_WAIT) => {}
        }
    }
}

/// Runs a loop side: `scenario.workers` tasks, each the future `worker` makes, timed until the
/// table's rows are acked (see [`watch`]); the first task error fails the run.
pub async fn run_loop<F, Fut>(
    scenario: &Scenario,
    limits: RunLimits,
    worker: F,
) -> Result<RunResult, BoxError>
where
    F: Fn(Arc<LoopShared>) -> Fut,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    run_loop_timed(scenario, limits, None, worker).await
}

async fn run_loop_timed<F, Fut>(
    scenario: &Scenario,
    limits: RunLimits,
    stats: Option<&Stats>,
    worker: F,
) -> Result<RunResult, BoxError>
where
    F: Fn(Arc<LoopShared>) -> Fut,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let shared = Arc::new(LoopShared {
        total: limits.rows,
        ..LoopShared::default()
    });
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..scenario.workers {
        let sh = shared.clone();
        let work = worker(sh.clone());
        tasks.spawn(async move {
            let r = work.await;
            if r.is_err() {
                sh.failed.store(true, Ordering::Relaxed);
            }
            r
        });
    }
    let result = watch(limits, stats, false, || Progress {
        acked: shared.acked.load(Ordering::Relaxed),
        in_work: 0,
        failed: shared.failed.load(Ordering::Relaxed),
    })
    .await;
    shared.stop.store(true, Ordering::Relaxed);
    shared.settled.notify_waiters();
    let mut first_error = None;
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(e) => {
                first_error.get_or_insert(e.into());
            }
        }
    }
    match first_error {
        Some(e) => Err(format!("{}: the loop failed: {e}", scenario.id()).into()),
        None => Ok(result),
    }
}

/// The strategy loop: `workers` tokio tasks drive `prepared` (see the module docs), timed until
/// the table's rows are acked.
pub async fn strategy_run<B: Backend>(
    prepared: Arc<Prepared<B>>,
    table: &TableDescription,
    scenario: &Scenario,
    limits: RunLimits,
    stats: Option<&Stats>,
) -> Result<RunResult, BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    let batch = scenario.batch;
    let lease_seconds = table.lease_seconds();
    run_loop_timed(scenario, limits, stats, move |sh| {
        let p = prepared.clone();
        async move { strategy_worker(&p, &sh, batch, lease_seconds).await }
    })
    .await
}

async fn strategy_worker<B: Backend>(
    prepared: &Prepared<B>,
    shared: &LoopShared,
    batch: usize,
    lease_seconds: u32,
) -> Result<(), BoxError>
where
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    while !shared.finished() {
        let idle = shared.idle_signal();
        tokio::pin!(idle);
        idle.as_mut().enable();
        let got = match prepared {
            Prepared::RowLock(s) => raw_row_lock(s, shared).await?,
            Prepared::Lease(s) => raw_lease(s, shared, batch, lease_seconds).await?,
            Prepared::Advisory(s) => raw_advisory(s, shared, batch).await?,
        };
        if got == 0 {
            shared.idle(idle).await;
        }
    }
    Ok(())
}

/// Reads the payload as the engine's handler type would, so both sides decode the row.
fn decode<DB: Database>(row: &ClaimedRow<DB>) -> Result<(), BoxError>
where
    Row: for<'r> FromRow<'r, DB::Row>,
{
    Row::from_row(&row.row)?;
    Ok(())
}

async fn raw_row_lock<S: RowLockStrategy>(s: &S, shared: &LoopShared) -> Result<usize, BoxError>
where
    Row: for<'r> FromRow<'r, <S::Db as Database>::Row>,
{
    let Some((tx, row)) = s.claim(clock::now_ms(), None).await? else {
        return Ok(0);
    };
    decode(&row)?;
    let settle = Settle {
        id: row.id,
        action: Action::Ack,
        now_ms: clock::now_ms(),
        attempt: row.attempt,
    };
    s.settle(tx, settle, false, true).await?;
    shared.acked_one();
    Ok(1)
}

async fn raw_lease<S: LeaseStrategy>(
    s: &S,
    shared: &LoopShared,
    batch: usize,
    lease_seconds: u32,
) -> Result<usize, BoxError>
where
    Row: for<'r> FromRow<'r, <S::Db as Database>::Row>,
{
    let now = clock::now_ms();
    let expires_ms = clock::lease_expiry_ms(now, lease_seconds);
    let rows = s.claim(batch, now, expires_ms, None).await?;
    let got = rows.len();
    for row in rows {
        decode(&row)?;
        let attempt = row.attempt + 1;
        let settle = Settle {
            id: row.id,
            action: Action::Ack,
            now_ms: clock::now_ms(),
            attempt,
        };
        let token = LeaseToken {
            expires_ms,
            attempt,
        };
        let changed = u64::from(s.settle(token, settle).await?);
        shared.fenced(row.id, changed)?;
    }
    Ok(got)
}

async fn raw_advisory<S: AdvisoryStrategy>(
    s: &S,
    shared: &LoopShared,
    batch: usize,
) -> Result<usize, BoxError>
where
    Row: for<'r> FromRow<'r, <S::Db as Database>::Row>,
{
    let mut candidates = s
        .candidates(batch.saturating_mul(4).max(16), 0, clock::now_ms(), None)
        .await?;
    // As the engine does when the claim order offers nothing free (and always on FIFO tables,
    // whose claim order holds only rows without a group): walk the keys or groups, here from
    // the first each time.
    if candidates.iter().all(|c| c.held) {
        candidates = s.walk_keys(None, 32, clock::now_ms()).await?.candidates;
    }
    let mut done = 0;
    for c in candidates {
        if done >= batch || shared.finished() {
            break;
        }
        if c.held || !shared.reserve(&c.key) {
            continue;
        }
        let r = raw_advisory_one(s, c.id, &c.key).await;
        shared.release(&c.key);
        if r? {
            done += 1;
            shared.acked_one();
        }
    }
    Ok(done)
}

/// Locks one candidate's key, takes and acks the row, and unlocks; `false` when the key or the
/// row was gone.
async fn raw_advisory_one<S: AdvisoryStrategy>(s: &S, id: i64, key: &str) -> Result<bool, BoxError>
where
    Row: for<'r> FromRow<'r, <S::Db as Database>::Row>,
{
    let Some(mut lock) = s.try_lock(key).await? else {
        return Ok(false);
    };
    let row = match s.take(&mut lock, id, clock::now_ms()).await {
        Ok(Some(row)) => row,
        Ok(None) => {
            s.unlock(lock).await?;
            return Ok(false);
        }
        Err(e) => {
            let _ = s.unlock(lock).await;
            return Err(e.into());
        }
    };
    let settled = match decode(&row) {
        Ok(()) => s
            .settle(
                &mut lock,
                Settle {
                    id: row.id,
                    action: Action::Ack,
                    now_ms: clock::now_ms(),
                    attempt: row.attempt + 1,
                },
            )
            .await
            .map_err(BoxError::from),
        Err(e) => Err(e),
    };
    let unlocked = s.unlock(lock).await;
    settled?;
    unlocked?;
    Ok(true)
}
