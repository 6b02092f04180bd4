//! The subscription engine: overlapping claims for free worker slots, handlers with lease
//! renewal, settlement, and graceful shutdown. Backend-independent.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use sqlx::{Database, FromRow};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::claim_mode::ClaimMode;
use crate::delivery::{self, Delivery, Job, JobTransaction, Outcome};
use crate::driver::Backend;
use crate::error::SqlxBrokerError;
use crate::metrics::{Counter, InWork, MetricsSnapshot};
use crate::mode::QueueInner;
use crate::table::TableDescription;

/// A boxed, sendable future, as handlers return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A handler's error: it becomes a retry (with the subscription's backoff), never a lost row.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a handler returns.
pub type HandlerResult = Result<Outcome, BoxError>;

/// The shortest [`SubscribeOptions::poll_interval`] accepted: an idle subscription claims at
/// most 20 times a second.
pub const MIN_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The default [`SubscribeOptions::poll_cooldown`]: a busy subscription that drained its table
/// looks again after 25 ms.
pub const DEFAULT_POLL_COOLDOWN: Duration = Duration::from_millis(25);

/// How a subscription runs.
#[derive(Debug, Clone)]
#[must_use]
pub struct SubscribeOptions {
    name: String,
    concurrency: usize,
    batch_size: Option<usize>,
    poll_interval: Duration,
    poll_cooldown: Duration,
    shutdown_timeout: Duration,
    error_backoff: Duration,
    error_backoff_max: Duration,
    max_claims_in_flight: Option<usize>,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        Self {
            name: "subscription".into(),
            concurrency: 1,
            batch_size: None,
            poll_interval: Duration::from_secs(1),
            poll_cooldown: DEFAULT_POLL_COOLDOWN,
            shutdown_timeout: Duration::from_secs(30),
            error_backoff: Duration::from_secs(1),
            error_backoff_max: Duration::from_secs(300),
            max_claims_in_flight: None,
        }
    }
}

impl SubscribeOptions {
    /// The defaults: 1 delivery in work, batches as large as the concurrency, a 1 s poll, a 30 s
    /// shutdown deadline, and an error backoff of 1 s doubling to 5 min.
    pub fn new() -> Self {
        Self::default()
    }
    /// A name for logs and spans.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
    /// How many handlers may run at once (at least 1; 0 is refused at subscribe).
    ///
    /// In lease mode without FIFO groups a delivery settles after its handler gives its slot
    /// back, beside the next handler, so acks that finish close together can share a
    /// statement; the rows the subscription holds stay bounded all the same (a claim waits
    /// until rows held by settlements still running fit beside the slots). In the other modes
    /// a slot is held until its row is settled.
    ///
    /// In row lock mode, and in advisory mode where keys are held on connections (PostgreSQL,
    /// MySQL), every delivery in work holds a pool connection: a concurrency beyond what the
    /// pool can serve is lowered at subscribe to three quarters of the pool (with a warning),
    /// so the rest of the pool stays free for claims, publishes and settlements.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }
    /// The most rows one claim asks for (at least 1; default: the concurrency).
    ///
    /// - Lease mode prefetches: a claim asks for a whole batch once that many rows fit beside
    ///   the deliveries in work and two batches of waiting rows (or as many rows as the
    ///   concurrency, if that is more), so the next batch is claimed while the last still feeds
    ///   the slots, and up to `max(2 * batch_size, concurrency)` claimed rows may wait in the
    ///   subscription for a free slot. Their leases are renewed while they wait; at
    ///   shutdown they are started like the rest within the deadline. A larger batch means
    ///   fewer claim statements per row but more rows held by this process: with slow handlers
    ///   and several processes, keep it near the concurrency. FIFO tables do not prefetch (a
    ///   claim made while a group's head is in work finds nothing in that group).
    /// - Advisory mode locks and takes one key after another, and each held key holds a
    ///   connection on PostgreSQL and MySQL, so it runs one single-row claim per free slot side
    ///   by side instead; they share candidate reads (a read returns a few times more rows than
    ///   it needs, kept briefly for the next claims).
    /// - Row lock mode claims one row per transaction, so its claims run side by side too.
    ///
    /// 0 is refused at subscribe.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = Some(n);
        self
    }
    /// How long an idle subscription waits before it looks again when nothing wakes it (at
    /// least [`MIN_POLL_INTERVAL`]; shorter is refused at subscribe, since an idle subscription
    /// would then keep a core and the database busy with empty claims).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }
    /// How soon a subscription looks again after it drained the table, while its claims keep
    /// finding rows (default [`DEFAULT_POLL_COOLDOWN`]). Rows that arrive without a wake-up
    /// (inserted by plain SQL, a trigger or another service; on MySQL, MariaDB and SQLite also
    /// those another process publishes) are then found within about this long instead of at
    /// the next poll. The wait grows with the time since a claim last found rows, up to the
    /// poll interval, so a subscription whose table stays empty looks once per poll interval,
    /// as before. Zero is refused at subscribe.
    pub fn poll_cooldown(mut self, cooldown: Duration) -> Self {
        self.poll_cooldown = cooldown;
        self
    }
    /// How long shutdown waits for handlers in work before it drops them (their rows are
    /// released as a dropped delivery's are).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }
    /// The delay before retrying a row whose handler failed or panicked: `base` doubled per
    /// attempt, at most `max`. Zero retries at once. Needs a due-time column; without one,
    /// failed rows are retried at once. A base above its maximum is refused at subscribe. Rows
    /// whose settlement failed back off by it too (see the crate docs).
    pub fn error_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.error_backoff = base;
        self.error_backoff_max = max;
        self
    }
    /// How many claims may run at once (default: enough to fill every slot, `concurrency /
    /// batch_size` rounded up; in row lock and advisory modes, where each claim takes one row,
    /// `concurrency`). 0 is refused at subscribe. Every claim in flight uses a pool connection,
    /// so it is lowered to half the pool (with a warning) where it would ask for more.
    pub fn max_claims_in_flight(mut self, n: usize) -> Self {
        self.max_claims_in_flight = Some(n);
        self
    }

    /// Refuses values the engine cannot run with, naming the option and what is accepted.
    pub(crate) fn check(&self, table: &str) -> crate::Result<()> {
        let refuse = |option, value: String, accepted, why| {
            Err(SqlxBrokerError::InvalidOption {
                table: table.to_owned(),
                option,
                value,
                accepted,
                why,
            })
        };
        if self.concurrency == 0 {
            return refuse(
                "concurrency",
                "0".into(),
                "1 or more",
                "a subscription with no delivery slot would never run a handler",
            );
        }
        if self.batch_size == Some(0) {
            return refuse(
                "batch_size",
                "0".into(),
                "1 or more (or leave it unset for the concurrency)",
                "a claim for no rows would never take one",
            );
        }
        if self.max_claims_in_flight == Some(0) {
            return refuse(
                "max_claims_in_flight",
                "0".into(),
                "1 or more (or leave it unset)",
                "with no claim allowed the subscription would never take a row",
            );
        }
        if self.poll_interval < MIN_POLL_INTERVAL {
            return refuse(
                "poll_interval",
                format!("{:?}", self.poll_interval),
                "50ms or more",
                "an idle subscription would keep a core and the database busy with empty claims",
            );
        }
        if self.poll_cooldown.is_zero() {
            return refuse(
                "poll_cooldown",
                "0s".into(),
                "1ms or more",
                "a subscription would claim in a loop while rows trickle in",
            );
        }
        if self.error_backoff > self.error_backoff_max {
            return refuse(
                "error_backoff",
                format!(
                    "{:?} up to {:?}",
                    self.error_backoff, self.error_backoff_max
                ),
                "a base no larger than its maximum",
                "the base delay would be cut to the maximum at once",
            );
        }
        Ok(())
    }

    fn backoff(&self, attempt: i64) -> Duration {
        if self.error_backoff.is_zero() {
            return Duration::ZERO;
        }
        let doublings = u32::try_from(attempt.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
        self.error_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.error_backoff_max)
    }
}

/// What a handler's future may return: an [`Outcome`], or a `Result` of one with any error
/// that converts into [`BoxError`] (an error becomes a retry, with the subscription's backoff).
pub trait IntoOutcome {
    /// The outcome, or the handler's error.
    fn into_outcome(self) -> HandlerResult;
}

impl IntoOutcome for Outcome {
    fn into_outcome(self) -> HandlerResult {
        Ok(self)
    }
}

impl<E: Into<BoxError>> IntoOutcome for Result<Outcome, E> {
    fn into_outcome(self) -> HandlerResult {
        self.map_err(Into::into)
    }
}

type HandlerFn<B, T> =
    dyn Fn(Job<T>, Option<JobTransaction<B>>) -> BoxFuture<'static, HandlerResult> + Send + Sync;

/// The handler, boxed once so the engine's tasks can share it.
pub(crate) struct Handler<B: Backend, T> {
    f: Arc<HandlerFn<B, T>>,
    /// Whether the handler takes the row lock transaction.
    lends_transaction: bool,
}

impl<B: Backend, T> Clone for Handler<B, T> {
    fn clone(&self) -> Self {
        Self {
            f: self.f.clone(),
            lends_transaction: self.lends_transaction,
        }
    }
}

impl<B: Backend, T: Send + 'static> Handler<B, T> {
    /// A handler of jobs.
    pub(crate) fn plain<F, Fut>(f: F) -> Self
    where
        F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
    {
        let f = Arc::new(f);
        Self {
            // The call runs inside the boxed future, so a panic in the handler's synchronous
            // part is caught like one in its body.
            f: Arc::new(move |job, _| {
                let f = f.clone();
                Box::pin(async move { f(job).await.into_outcome() })
            }),
            lends_transaction: false,
        }
    }

    /// A handler of jobs and their row lock transaction.
    pub(crate) fn with_transaction<F, Fut>(f: F) -> Self
    where
        F: Fn(Job<T>, JobTransaction<B>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
    {
        let f = Arc::new(f);
        Self {
            f: Arc::new(move |job, tx: Option<JobTransaction<B>>| {
                let f = f.clone();
                Box::pin(async move {
                    let tx = tx.expect("a row lock delivery lends its transaction");
                    f(job, tx).await.into_outcome()
                })
            }),
            lends_transaction: true,
        }
    }
}

/// What a shutdown found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Deliveries in work when the shutdown began (or started during it, from rows already
    /// claimed) whose handlers finished and were settled before the deadline. A delivery that
    /// had left work before the stop (it shows in the counters as acked, retried, ...) is not
    /// counted, even when its task had not ended yet.
    pub finished: usize,
    /// Handlers still running at the deadline, dropped (their rows released).
    pub dropped: usize,
    /// The engine's own panic, if its task panicked (a bug in sqlx-broker: please report it).
    /// The subscription had stopped claiming at that point; rows it held were given back as
    /// their modes give back a dropped delivery's.
    pub engine_panic: Option<String>,
}

/// A running subscription. Dropping it stops claiming and lets the engine wind down in the
/// background; [`shutdown`](Self::shutdown) waits for that.
pub struct Subscription {
    stop: watch::Sender<bool>,
    health: Arc<Mutex<Health>>,
    decode: Arc<Mutex<crate::warnings::DecodeHealth>>,
    task: Option<tokio::task::JoinHandle<ShutdownReport>>,
    metrics: Arc<dyn Fn() -> MetricsSnapshot + Send + Sync>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("metrics", &self.metrics())
            .finish_non_exhaustive()
    }
}

impl Subscription {
    /// The counters of the subscription's queue.
    pub fn metrics(&self) -> MetricsSnapshot {
        (self.metrics)()
    }

    /// Whether the subscription works now, and what it warns about, without a `tracing`
    /// subscriber: a table the role cannot write, a dropped table or a lost server shows as
    /// claims failing in a row, with the last error (the engine keeps trying, backing off); a
    /// row type that does not match the table as claimed rows failing to decode, with the last
    /// error (each such row is retried and in the end dead-lettered); a concurrency the pool
    /// cannot serve, lowered, and a missing claim index, in `warnings`.
    pub fn health(&self) -> Health {
        let mut h = self
            .health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let d = self.decode.lock().unwrap_or_else(|p| p.into_inner());
        h.decode_errors_in_a_row = d.in_a_row;
        h.last_decode_error.clone_from(&d.last);
        h
    }

    /// Graceful shutdown: stops claiming, waits for handlers in work up to the shutdown
    /// deadline and settles them, drops the rest (their rows are released), and waits until every
    /// key lock and connection of this subscription is given back.
    pub async fn shutdown(mut self) -> ShutdownReport {
        self.stop.send_replace(true);
        match self.task.take() {
            Some(task) => match task.await {
                Ok(report) => report,
                Err(e) => {
                    let engine_panic = match e.try_into_panic() {
                        Ok(panic) => panic_message(&panic).to_owned(),
                        Err(e) => e.to_string(),
                    };
                    tracing::error!(panic = engine_panic, "the subscription's engine panicked");
                    ShutdownReport {
                        engine_panic: Some(engine_panic),
                        ..ShutdownReport::default()
                    }
                }
            },
            None => ShutdownReport::default(),
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// What a subscription's claims look like now (see [`Subscription::health`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// Claims that failed since the last one that worked.
    pub claim_errors_in_a_row: u32,
    /// The error of the last failed claim, while claims keep failing.
    pub last_claim_error: Option<String>,
    /// Claimed rows of the queue that did not decode into the handler's row type since the last
    /// one that did (counted for every claim of the queue in this process).
    pub decode_errors_in_a_row: u32,
    /// The last decode error (`row 7: ...`), while rows keep failing to decode.
    pub last_decode_error: Option<String>,
    /// The concurrency the subscription runs at: what `SubscribeOptions::concurrency` asked
    /// for, or less where the pool cannot serve it (then `warnings` says so).
    pub concurrency: usize,
    /// What works but should be fixed, one sentence each with the fix: a concurrency or claim
    /// limit lowered to fit the pool, a claim index missing (from [`Queue::warnings`](crate::Queue::warnings)).
    pub warnings: Vec<String>,
}

impl Health {
    /// Whether the last claim worked and the last claimed row decoded. Warnings do not make a
    /// subscription unhealthy.
    pub fn is_healthy(&self) -> bool {
        self.claim_errors_in_a_row == 0 && self.decode_errors_in_a_row == 0
    }
}

pub(crate) fn start<B, T>(
    queue: Arc<QueueInner<B>>,
    mut options: SubscribeOptions,
    handler: Handler<B, T>,
) -> crate::Result<Subscription>
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    options.check(queue.shared.name())?;
    if handler.lends_transaction && queue.shared.table.mode() != ClaimMode::RowLock {
        return Err(SqlxBrokerError::Unsupported {
            table: queue.shared.name().to_owned(),
            message: format!(
                "subscribe_with_transaction lends the row lock transaction, and this table is in {:?} mode, which holds none; use subscribe",
                queue.shared.table.mode()
            ),
        });
    }
    let mut warnings = queue.shared.warnings.clone();
    warnings.extend(fit_to_pool(&mut options, &queue));
    let (stop, stop_rx) = watch::channel(false);
    let metrics_queue = queue.shared.clone();
    let metrics = Arc::new(move || metrics_queue.metrics.snapshot());
    let health = Arc::new(Mutex::new(Health {
        concurrency: options.concurrency,
        warnings,
        ..Health::default()
    }));
    let decode = queue.shared.decode.clone();
    let running = queue.shared.broker.engine_started();
    let engine_health = health.clone();
    let task = tokio::spawn(async move {
        let _running = running;
        run(queue, options, handler, stop_rx, engine_health).await
    });
    Ok(Subscription {
        stop,
        health,
        decode,
        task: Some(task),
        metrics,
    })
}

/// The pool size the engine plans with.
fn pool_size<B: Backend>(queue: &QueueInner<B>) -> usize {
    usize::try_from(
        queue
            .shared
            .broker
            .backend
            .pool()
            .options()
            .get_max_connections(),
    )
    .unwrap_or(usize::MAX)
    .max(1)
}

/// The most claims in flight a pool of `pool` connections serves: each claim holds a connection
/// while it runs, and the other half of the pool stays free for settlements and publishes.
fn claims_for_pool(pool: usize) -> usize {
    (pool / 2).max(1)
}

/// Lowers a concurrency the pool cannot serve where every delivery holds a connection (row lock,
/// and advisory keys held on connections), and an explicit claim limit above what the pool
/// serves, each with a warning. Beyond the pool, more workers only queue for connections: at
/// concurrency 10,000 on a pool of 5, claims and settlements timed out by the hundred thousand
/// and throughput fell below that of 8 workers. Returns the warnings, for
/// [`Health::warnings`] (and standard error without a `tracing` subscriber).
fn fit_to_pool<B: Backend>(options: &mut SubscribeOptions, queue: &QueueInner<B>) -> Vec<String> {
    let mut warnings = Vec::new();
    let pool = pool_size(queue);
    let table = &queue.shared.table;
    let holds_connection = match table.mode() {
        ClaimMode::RowLock => true,
        ClaimMode::Advisory => {
            !queue
                .shared
                .broker
                .backend
                .capabilities()
                .process_local_keys
        }
        ClaimMode::Lease => false,
    };
    let most = (pool * 3 / 4).max(1);
    if holds_connection && options.concurrency > most {
        tracing::warn!(
            table = table.name(),
            asked = options.concurrency,
            pool,
            using = most,
            "every delivery in work holds a pool connection in this mode; lowering the concurrency to three quarters of the pool (grow the pool for more)"
        );
        let text = format!(
            "concurrency {} lowered to {most}: in {:?} mode every delivery in work holds one of the pool's {pool} connections; grow the pool (max_connections {}) for more",
            options.concurrency,
            table.mode(),
            options.concurrency.saturating_mul(4).div_ceil(3),
        );
        crate::warnings::report(table.name(), text.clone());
        warnings.push(text);
        options.concurrency = most;
    }
    let claims = claims_for_pool(pool);
    if let Some(n) = options.max_claims_in_flight
        && n > claims
    {
        tracing::warn!(
            table = table.name(),
            asked = n,
            pool,
            using = claims,
            "each claim in flight holds a pool connection; lowering max_claims_in_flight to half the pool"
        );
        let text = format!(
            "max_claims_in_flight {n} lowered to {claims}: each claim in flight holds one of the pool's {pool} connections"
        );
        crate::warnings::report(table.name(), text.clone());
        warnings.push(text);
        options.max_claims_in_flight = Some(claims);
    }
    warnings
}

/// The wait after `failures` claims failed in a row: the poll interval doubled per failure, at
/// most [`CLAIM_BACKOFF_MAX`] (or the poll interval, if that is longer). A wake-up from a
/// publish or settlement still cuts it short (those need a working database).
fn claim_backoff(poll: Duration, failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(20);
    poll.saturating_mul(1u32 << doublings)
        .min(CLAIM_BACKOFF_MAX.max(poll))
}

/// How long a drained subscription waits before it looks again when nothing wakes it: the time
/// since a claim last found rows, at least the poll cooldown and at most the poll interval. A
/// table that rows keep arriving in is so claimed from every cooldown (rows inserted without a
/// wake-up wait about that long), and each look that finds nothing about doubles the wait, so
/// a subscription whose table stays empty is back at the poll interval within a few looks.
fn drained_wait(options: &SubscribeOptions, last_found: Option<tokio::time::Instant>) -> Duration {
    let Some(found) = last_found else {
        return options.poll_interval;
    };
    found
        .elapsed()
        .max(options.poll_cooldown)
        .min(options.poll_interval)
}

/// The longest wait between failing claims.
const CLAIM_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What a claim task tells the loop as soon as its claim returns: what to do next, and the
/// claimed rows beyond the first (the task runs the first itself) for the loop to start.
struct ClaimReport<B: Backend, T> {
    next: Next,
    /// Whether the claim found rows.
    found: bool,
    extras: Vec<(Delivery<B, T>, OwnedSemaphorePermit)>,
    /// The loop's [`ClaimLoop::seq`] when the claim started.
    seq: u64,
}

/// Sends a claim task's report exactly once: an unsent report goes out (as drained, with no
/// rows) when the task unwinds, so the loop never waits for a claim that is gone.
struct Reporter<B: Backend, T> {
    tx: Option<mpsc::UnboundedSender<ClaimReport<B, T>>>,
    seq: u64,
}

impl<B: Backend, T> Reporter<B, T> {
    fn send(&mut self, report: ClaimReport<B, T>) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(report);
        }
    }
}

impl<B: Backend, T> Drop for Reporter<B, T> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            tracing::error!("a claim task ended without a report (it panicked or was cancelled)");
            let _ = tx.send(ClaimReport {
                next: Next::Drained,
                found: false,
                extras: Vec::new(),
                seq: self.seq,
            });
        }
    }
}

/// What the claim loop does after a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// The claim got every row it asked for, or came back short while a settlement freed rows:
    /// keep every claim slot busy.
    More,
    /// The claim came back short (or failed): wait for a wake-up or the poll.
    Drained,
    /// A wake-up or the poll ended a wait: one claim looks whether rows are there, and only a
    /// full one fans out to every claim slot. An idle subscription so runs one empty claim per
    /// poll instead of one per claim slot.
    Probe,
}

/// Whether a subscription's queue is paused, read from the control table at most once per poll
/// interval, and at once after a pause or resume through this broker.
struct PauseWatch {
    paused: bool,
    /// Whether the control table existed when the subscription started; without it nothing
    /// can pause the queue, and nothing is read.
    control: bool,
    read_at: Option<tokio::time::Instant>,
    /// The broker's pause counter at the last read.
    epoch: u64,
}

impl PauseWatch {
    async fn new<B: Backend>(shared: &crate::inner::Shared<B>) -> Self {
        let control = match shared.broker.backend.has_control_table().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(table = shared.name(), error = %e, "cannot tell whether the control table exists; pauses from other processes are not seen");
                false
            }
        };
        if !control {
            tracing::debug!(
                table = shared.name(),
                "no control table ({}): this subscription does not watch for pauses",
                crate::driver::CONTROL_TABLE
            );
        }
        Self {
            paused: false,
            control,
            read_at: None,
            epoch: shared.broker.pause_epoch.load(Ordering::SeqCst),
        }
    }

    /// Reads the pause again when the poll interval passed since the last read, or this broker
    /// paused or resumed a queue since. A read that fails keeps the last state.
    async fn refresh<B: Backend>(&mut self, shared: &crate::inner::Shared<B>, poll: Duration) {
        if !self.control {
            return;
        }
        let epoch = shared.broker.pause_epoch.load(Ordering::SeqCst);
        let due = self
            .read_at
            .is_none_or(|at| at.elapsed() >= poll || epoch != self.epoch);
        if !due {
            return;
        }
        self.epoch = epoch;
        self.read_at = Some(tokio::time::Instant::now());
        match shared.broker.backend.pause_state(shared.name()).await {
            Ok(state) => {
                let paused = state.is_some();
                if paused != self.paused {
                    tracing::info!(table = shared.name(), paused, "the queue's pause changed");
                }
                self.paused = paused;
            }
            Err(e) => {
                tracing::warn!(table = shared.name(), error = %e, "reading the queue's pause failed; keeping the last state");
            }
        }
    }
}

/// What every delivery task of a subscription shares.
struct Engine<B: Backend, T> {
    queue: Arc<QueueInner<B>>,
    handler: Handler<B, T>,
    options: Arc<SubscribeOptions>,
    /// One permit per delivery whose handler runs.
    slots: Arc<Semaphore>,
    wake: Arc<Notify>,
    /// Settlements that may have made rows claimable (see [`frees_rows`]). A claim that found
    /// too few rows while one landed looks again at once: it may have run before that row was
    /// free, and the wake-up the settlement sent may have gone to a claim that lost the row to
    /// it.
    freed: AtomicU64,
    /// What [`Subscription::health`] reads; claims update it.
    health: Arc<Mutex<Health>>,
    /// The subscription's and the broker's stop, read when a delivery leaves work: it counts
    /// in the [`ShutdownReport`] only if it was still in work when the stop came.
    stop: watch::Receiver<bool>,
    broker_stop: watch::Receiver<bool>,
    span: tracing::Span,
}

/// How a subscription claims: rows per claim, claims in flight, and rows held beyond the slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    /// The most rows one claim asks for.
    batch: usize,
    /// The most claims in flight.
    max_claims: usize,
    /// Claimed rows that may wait for a slot (lease mode only).
    prefetch: usize,
}

impl Plan {
    fn new(options: &SubscribeOptions, table: &TableDescription, pool: usize) -> Self {
        let mode = table.mode();
        // Row lock claims one row per transaction, and an advisory claim locks and takes one
        // key after another, so those modes run one single-row claim per slot side by side
        // (advisory claims share their candidate reads); lease claims take a batch in one
        // statement.
        let batch = match mode {
            ClaimMode::RowLock | ClaimMode::Advisory => 1,
            ClaimMode::Lease => options.batch_size.unwrap_or(options.concurrency),
        };
        // Enough claims in flight to fill every slot: one per batch of slots, and a single one
        // for a single worker, which on SQLite would only contend with itself for the one
        // writer.
        let max_claims = options.max_claims_in_flight.unwrap_or_else(|| {
            options
                .concurrency
                .div_ceil(batch)
                .clamp(1, options.concurrency)
                .min(claims_for_pool(pool))
        });
        // Rows this subscription holds: in work, waiting for a slot, or asked for by a claim in
        // flight. A lease costs nothing while it waits (renewal keeps it), so lease mode claims
        // whole batches and holds up to two beyond the slots: the next batch is claimed while
        // the last one still feeds the slots, and no slot waits for a claim. Small batches hold
        // at least one row per slot beyond them: a row keeps its place in the window until its
        // ack's statement returns, and acks wait for the one in flight (they share it), so with
        // two single-row batches the window filled with rows waiting for their ack and the
        // claims stalled (lease, batch 1, PostgreSQL: 0.87-0.94 of the hand-written loop at 4-8
        // workers with two, 1.03-1.20 with one per slot, alternating runs). A row lock or a
        // key holds a connection, so those modes hold no more rows than slots. Neither do FIFO
        // tables: while a group's head is in work a claim finds nothing in that group, so
        // claims beside the rows in work mostly come back empty, having scanned the group and
        // contended with the others.
        let prefetch = if mode == ClaimMode::Lease && !table.fifo() {
            (2 * batch).max(options.concurrency)
        } else {
            0
        };
        Self {
            batch,
            max_claims,
            prefetch,
        }
    }
}

/// What woke the claim loop.
enum Event<B: Backend, T> {
    /// The subscription or the broker is stopping.
    Stop,
    /// A wake-up (a publish, a settlement) or the poll: look again.
    Look,
    /// A claim returned.
    Report(ClaimReport<B, T>),
    /// A delivery task ended.
    TaskDone,
    /// Window permits for a new claim.
    Permits(OwnedSemaphorePermit),
}

/// The claim loop's state: claims in flight, delivery tasks, and whether the table looked
/// drained.
struct ClaimLoop<B: Backend, T> {
    engine: Arc<Engine<B, T>>,
    plan: Plan,
    /// Rows held: in work, waiting for a slot, or asked for by a claim in flight.
    window: Arc<Semaphore>,
    reports_tx: mpsc::UnboundedSender<ClaimReport<B, T>>,
    reports: mpsc::UnboundedReceiver<ClaimReport<B, T>>,
    /// Claims in flight.
    claims: usize,
    /// Each task says whether it ran a delivery.
    tasks: JoinSet<bool>,
    /// After a short claim the table looked drained: wait for a wake-up or the poll. Otherwise
    /// every claim slot stays busy, even where most claims come back empty (a FIFO group has
    /// one claimable head at a time): claims started at different moments overlap the head's
    /// settlement at different points, so one of them usually takes the next head right away.
    /// One claim at a time would make every row wait out a whole claim (measured: 0.14 of the
    /// raw loop on a one-group lease table).
    state: Next,
    /// Counts the claims started and the wake-ups and polls taken, in the order the loop saw
    /// them; each claim carries the count at its start.
    seq: u64,
    /// The count of what set `state`: a claim's report changes it only if the claim started
    /// after that, or found rows (see [`ClaimLoop::on_report`]).
    state_seq: u64,
    /// When a claim last found rows: the wait after a drained claim grows with the time since
    /// (see [`drained_wait`]). `None` until a claim finds rows.
    last_found: Option<tokio::time::Instant>,
    /// Whether the queue is paused (see [`Queue::pause`](crate::Queue::pause)): no claims
    /// start while it is.
    pause: PauseWatch,
    stop: watch::Receiver<bool>,
    broker_stop: watch::Receiver<bool>,
}

async fn run<B, T>(
    queue: Arc<QueueInner<B>>,
    options: SubscribeOptions,
    handler: Handler<B, T>,
    stop: watch::Receiver<bool>,
    health: Arc<Mutex<Health>>,
) -> ShutdownReport
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    let shared = queue.shared.clone();
    let table = shared.table.clone();
    let span =
        tracing::info_span!("subscription", subscription = %options.name, table = table.name());
    let wake = Arc::new(Notify::new());
    shared.broker.register_waker(table.name(), &wake);
    let listener = match shared.broker.backend.listen(&table, wake.clone()).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(parent: &span, error = %e, "cross-process wake-ups unavailable; polling");
            None
        }
    };
    let plan = Plan::new(&options, &table, pool_size(&queue));
    let (reports_tx, reports) = mpsc::unbounded_channel();
    let mut claim_loop = ClaimLoop {
        window: Arc::new(Semaphore::new(options.concurrency + plan.prefetch)),
        engine: Arc::new(Engine {
            slots: Arc::new(Semaphore::new(options.concurrency)),
            queue,
            handler,
            options: Arc::new(options),
            wake,
            freed: AtomicU64::new(0),
            health,
            stop: stop.clone(),
            broker_stop: shared.broker.shutdown.subscribe(),
            span: span.clone(),
        }),
        plan,
        reports_tx,
        reports,
        claims: 0,
        tasks: JoinSet::new(),
        state: Next::Probe,
        seq: 0,
        state_seq: 0,
        last_found: None,
        pause: PauseWatch::new(&shared).await,
        broker_stop: shared.broker.shutdown.subscribe(),
        stop,
    };
    claim_loop.run().await;
    let report = claim_loop.shut_down().await;
    drop(listener);
    claim_loop.engine.queue.release_kept();
    shared.broker.drain_cleanups().await;
    tracing::info!(parent: &span, finished = report.finished, dropped = report.dropped, "subscription stopped");
    report
}

impl<B, T> ClaimLoop<B, T>
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    fn stopped(&self) -> bool {
        *self.stop.borrow() || *self.broker_stop.borrow()
    }

    /// Claims until the subscription or the broker stops.
    async fn run(&mut self) {
        while !self.stopped() {
            let was_paused = self.pause.paused;
            self.pause
                .refresh(&self.engine.queue.shared, self.engine.options.poll_interval)
                .await;
            if was_paused && !self.pause.paused {
                // Resumed: look at once, as after a wake-up.
                self.seq += 1;
                self.state = Next::Probe;
                self.state_seq = self.seq;
            }
            match self.next_event().await {
                Event::Stop | Event::TaskDone => {}
                Event::Look => {
                    self.seq += 1;
                    self.state = Next::Probe;
                    self.state_seq = self.seq;
                }
                Event::Report(report) => self.on_report(report),
                Event::Permits(permits) => self.start_claim(permits),
            }
        }
    }

    /// Waits for what the loop needs next: a wake-up or the poll while the table looks
    /// drained, a returning claim while all claims are in flight, window permits otherwise;
    /// and in every state a stop, a returning claim or an ending task.
    async fn next_event(&mut self) -> Event<B, T> {
        let drained = self.state == Next::Drained;
        let max_claims = if self.state == Next::Probe {
            1
        } else {
            self.plan.max_claims
        };
        let full = !drained && self.claims >= max_claims;
        let paused = self.pause.paused;
        let wants_permits = !drained && !full && !paused;
        // Paused: wait for a wake-up (a resume in this process) or the poll, then read the
        // pause again.
        let drained = drained || paused;
        let options = &self.engine.options;
        let wait = match self.engine.claim_errors_in_a_row() {
            _ if paused => options.poll_interval,
            0 => drained_wait(options, self.last_found),
            failing => claim_backoff(options.poll_interval, failing),
        };
        // Prefetching claims wait until a whole batch fits; the others start as soon as one
        // slot is free and take what else is free.
        let wanted = if self.plan.prefetch > 0 {
            self.plan.batch
        } else {
            1
        };
        let window = self.window.clone();
        // In this order: a stop is seen at once. Whether a task that ended at the same time
        // counts as finished in the shutdown report is its own to say (see `work`): only if it
        // was still in work when the stop came. Counting every task reaped during shutdown
        // reported `finished: 1` for a handler that had settled before the stop (about one run
        // in four of a test that shut down right after an ack).
        tokio::select! {
            biased;
            _ = self.stop.changed() => Event::Stop,
            _ = self.broker_stop.changed() => Event::Stop,
            Some(report) = self.reports.recv() => Event::Report(report),
            Some(_) = self.tasks.join_next() => Event::TaskDone,
            // A wake-up (a publish, a settlement) cuts a claim backoff short too: it means the
            // database took a write just now, and without one a backoff is never longer than
            // the poll interval was.
            _ = self.engine.wake.notified(), if drained => Event::Look,
            _ = tokio::time::sleep(wait), if drained => Event::Look,
            permits = window.acquire_many_owned(u32::try_from(wanted).unwrap_or(u32::MAX)), if wants_permits => {
                Event::Permits(permits.expect("the window semaphore is never closed"))
            }
        }
    }

    /// A claim returned: its rows beyond the first start, and it sets what the loop does next
    /// unless something later already did. A claim that started before a wake-up (or before a
    /// newer claim that found rows) and came back short says nothing about rows that wake-up
    /// announced: its statement may have run before they were committed. Letting it set
    /// `Drained` would lose the wake-up and leave those rows to the next poll (measured on a
    /// one-group FIFO table: a one-second stall every few hundred rows, a quarter of the
    /// strategy loop's rate).
    fn on_report(&mut self, report: ClaimReport<B, T>) {
        self.claims -= 1;
        if report.found {
            self.last_found = Some(tokio::time::Instant::now());
        }
        let seq = report.seq;
        let next = self.engine.start_extras(report, &mut self.tasks);
        if seq >= self.state_seq {
            self.state = next;
            self.state_seq = seq;
        } else if next == Next::More {
            self.state = Next::More;
        }
    }

    /// Starts a claim for the rows `permits` allow (and what else of the window is free) in a
    /// task of its own, which reports to the loop when the claim returns and then runs the
    /// first claimed row's handler itself: with one row per claim (row lock, advisory, single
    /// workers) a row costs one task and one hand-off, as in a plain loop. The loop starts the
    /// other rows of a batch.
    fn start_claim(&mut self, mut permits: OwnedSemaphorePermit) {
        while permits.num_permits() < self.plan.batch {
            match self.window.clone().try_acquire_owned() {
                Ok(p) => permits.merge(p),
                Err(_) => break,
            }
        }
        let e = self.engine.clone();
        self.seq += 1;
        let seq = self.seq;
        let mut reporter = Reporter {
            tx: Some(self.reports_tx.clone()),
            seq,
        };
        self.claims += 1;
        self.tasks.spawn(
            async move {
                let freed = e.freed.load(Ordering::SeqCst);
                let result =
                    delivery::claim::<B, T>(&e.queue, permits.num_permits(), Some(&e.options.name))
                        .await;
                let (next, mut rows) = e.sort_claim(result, permits, freed);
                let found = !rows.is_empty();
                let first = found.then(|| rows.remove(0));
                reporter.send(ClaimReport {
                    next,
                    found,
                    extras: rows,
                    seq,
                });
                match first {
                    Some((d, permit)) => work(e, d, permit).await,
                    None => false,
                }
            }
            .instrument(self.engine.span.clone()),
        );
    }

    /// Shutdown: claims in flight finish and their rows are handled like the rest; then
    /// handlers get until the deadline, and those still running are dropped (their rows
    /// released).
    async fn shut_down(&mut self) -> ShutdownReport {
        let now = tokio::time::Instant::now();
        // A deadline past what the clock can hold means no deadline.
        let deadline = now
            .checked_add(self.engine.options.shutdown_timeout)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600));
        while self.claims > 0 {
            let Some(report) = self.reports.recv().await else {
                break;
            };
            self.on_report(report);
        }
        let mut report = ShutdownReport::default();
        let tasks = &mut self.tasks;
        let waited = tokio::time::timeout_at(deadline, async {
            while let Some(done) = tasks.join_next().await {
                if matches!(done, Ok(true)) {
                    report.finished += 1;
                }
            }
        })
        .await;
        if waited.is_err() {
            report.dropped = self.tasks.len();
            tracing::warn!(parent: &self.engine.span, dropped = report.dropped, "shutdown deadline passed; dropping handlers in work");
            self.tasks.abort_all();
            while self.tasks.join_next().await.is_some() {}
        }
        report
    }
}

impl<B, T> Engine<B, T>
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    /// Pairs each claimed row with a window permit (those of rows not found go back) and says
    /// what the claim loop does next.
    #[allow(clippy::type_complexity)]
    fn sort_claim(
        &self,
        result: crate::Result<Vec<Delivery<B, T>>>,
        mut permits: OwnedSemaphorePermit,
        freed: u64,
    ) -> (Next, Vec<(Delivery<B, T>, OwnedSemaphorePermit)>) {
        match result {
            Ok(deliveries) => {
                self.set_health(None);
                let asked = permits.num_permits();
                let got = deliveries.len();
                let rows = deliveries
                    .into_iter()
                    .map(|d| {
                        let permit = permits
                            .split(1)
                            .expect("a claim asks for at most its permits");
                        (d, permit)
                    })
                    .collect();
                let next = if got == asked || self.freed.load(Ordering::SeqCst) != freed {
                    Next::More
                } else {
                    Next::Drained
                };
                (next, rows)
            }
            Err(e) if self.is_conflict(&e) => {
                // Another claim took the same rows at the same time (on a Galera cluster, a
                // claim on another node won certification) and the backend's quick retries met
                // it again: rows are there, so claim again at once rather than back off.
                self.queue.shared.metrics.add(Counter::ClaimConflicts, 1);
                tracing::debug!(parent: &self.span, error = %e, "claim conflict; claiming again");
                (Next::More, Vec::new())
            }
            Err(e) => {
                self.queue.shared.metrics.add(Counter::ClaimErrors, 1);
                let failing = self.set_health(Some(e.to_string()));
                let wait = claim_backoff(self.options.poll_interval, failing);
                tracing::warn!(parent: &self.span, error = %e, in_a_row = failing, ?wait, "claim failed; trying again after a backoff");
                (Next::Drained, Vec::new())
            }
        }
    }

    /// Whether a failed claim lost a race with another claim (the server undid it: a deadlock or
    /// a certification conflict), rather than failing.
    fn is_conflict(&self, e: &SqlxBrokerError) -> bool {
        e.sqlx_source().is_some_and(|s| {
            self.queue.shared.broker.backend.classify(s) == crate::driver::ErrorClass::Transient
        })
    }

    /// Records a claim's result in the health state; returns the claims failed in a row.
    fn set_health(&self, error: Option<String>) -> u32 {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        match error {
            Some(e) => {
                h.claim_errors_in_a_row = h.claim_errors_in_a_row.saturating_add(1);
                h.last_claim_error = Some(e);
            }
            None if h.claim_errors_in_a_row == 0 => {}
            None => *h = Health::default(),
        }
        h.claim_errors_in_a_row
    }

    /// Whether the subscription or the broker has been told to stop.
    fn stopping(&self) -> bool {
        *self.stop.borrow() || *self.broker_stop.borrow()
    }

    fn claim_errors_in_a_row(&self) -> u32 {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .claim_errors_in_a_row
    }

    /// Starts a task for each row of a claim beyond its first (it waits for a slot, then runs
    /// the handler), and passes on what the claim loop does next.
    fn start_extras(
        self: &Arc<Self>,
        report: ClaimReport<B, T>,
        handlers: &mut JoinSet<bool>,
    ) -> Next {
        for (d, permit) in report.extras {
            handlers.spawn(work(self.clone(), d, permit).instrument(self.span.clone()));
        }
        report.next
    }
}

/// One claimed row: lease renewal from the start, a slot, the handler, then settlement.
/// Returns whether the delivery was in work (counted in `in_work`) when the subscription or
/// broker was told to stop: what [`ShutdownReport::finished`] counts. A delivery that left work
/// before the stop is not counted, even when its task ends after it.
async fn work<B, T>(
    engine: Arc<Engine<B, T>>,
    mut delivery: Delivery<B, T>,
    held: OwnedSemaphorePermit,
) -> bool
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    let inner = &engine.queue.shared;
    let options = &engine.options;
    let id = delivery.id();
    let attempt = delivery.attempt();
    let span = tracing::info_span!("delivery", id, attempt);
    // Renewal runs beside the slot wait and the handler, in this task: it starts at the claim,
    // so a prefetched row keeps its lease while it waits for a slot. A renewal statement is
    // never cancelled: when the handler ends mid-statement, the statement finishes first.
    let stop_renewal = Notify::new();
    let renewer = delivery.renewer();
    let renewal = async {
        let Some(renewer) = renewer else {
            return;
        };
        let half = table_half_lease(inner.table.lease_seconds());
        loop {
            tokio::select! {
                _ = tokio::time::sleep(half) => {}
                _ = stop_renewal.notified() => return,
            }
            if let Err(e) = renewer.renew().await {
                tracing::warn!(table = inner.name(), id, error = %e, "lease renewal failed");
                if renewer.is_lost() {
                    return;
                }
            }
        }
    };
    let failures = delivery.settle_failures();
    let running = async {
        // A row whose last settlements failed waits before it runs again, holding its claim (so
        // no other claim of this process or another takes it meanwhile), the longer the more
        // failed: a settlement that always fails costs a few runs, never a loop. The wait is
        // at least the claim backoff, whatever error_backoff says.
        if failures > 0 {
            let wait = options
                .backoff(i64::from(failures))
                .max(claim_backoff(options.poll_interval, failures));
            tracing::debug!(parent: &span, failures, ?wait, "the last settlements of this row failed; backing off");
            tokio::time::sleep(wait).await;
        }
        let slot = engine
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the slot semaphore is never closed");
        let in_work = InWork::enter(&inner.metrics);
        if let Some(due) = delivery.due_ms() {
            // Whole milliseconds: exact in an f64 for any due time.
            #[allow(clippy::cast_precision_loss)]
            inner
                .metrics
                .started_after_due((crate::driver::clock::now_ms() - due) as f64 / 1000.0);
        }
        let job = delivery.take_job();
        let lent = if engine.handler.lends_transaction {
            delivery.lend_transaction()
        } else {
            None
        };
        let started = std::time::Instant::now();
        let result = CatchUnwind((engine.handler.f)(job, lent.clone()))
            .instrument(span.clone())
            .await;
        inner.metrics.handler_ran(started.elapsed().as_secs_f64());
        if let Some(lent) = lent {
            delivery.take_back(lent);
        }
        // Stored if the renewal is mid-statement; it stops after that statement.
        stop_renewal.notify_one();
        // Lease mode without FIFO groups: the slot is the handler's, and the next row's
        // handler may start while this one settles (the rows held stay bounded by `held`), so
        // acks that finish close together share a statement. The other modes keep the slot
        // until the row is settled: their settlements are not batched, and a row lock or a key
        // holds a connection until then.
        let keep = if settles_beside_next_handler(&inner.table) {
            // Read before the gauge falls, so a stop seen after it counts this row out.
            let in_shutdown = engine.stopping();
            drop((slot, in_work));
            (None, in_shutdown)
        } else {
            (Some((slot, in_work)), false)
        };
        (result, keep)
    };
    let ((result, (kept, left_in_shutdown)), ()) = tokio::join!(running, renewal);

    let backoff_due = |attempt| {
        let d = options.backoff(attempt);
        if d.is_zero() || inner.table.due_at().is_none() {
            Outcome::Retry
        } else {
            Outcome::RetryAfter(d)
        }
    };
    // What the row's last_error column keeps, where the table has one.
    let error_text = match &result {
        Ok(Err(e)) => Some(e.to_string()),
        Err(panic) => Some(format!("panic: {}", panic_message(panic))),
        Ok(Ok(_)) => None,
    }
    .filter(|_| inner.table.last_error().is_some());
    let outcome = match result {
        Ok(Ok(Outcome::RetryAfter(d))) if inner.table.due_at().is_none() && !d.is_zero() => {
            tracing::warn!(parent: &span, "handler asked for a delayed retry, but the table has no due-time column; retrying at once");
            Outcome::Retry
        }
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => {
            inner.metrics.add(Counter::HandlerErrors, 1);
            tracing::warn!(parent: &span, error = %e, "handler failed; retrying");
            backoff_due(attempt)
        }
        Err(panic) => {
            inner.metrics.add(Counter::Panics, 1);
            tracing::error!(parent: &span, panic = panic_message(&panic), "handler panicked; retrying");
            backoff_due(attempt)
        }
    };
    match delivery.settle(outcome).await {
        Err(e) => {
            tracing::warn!(parent: &span, error = %e, ?outcome, "settlement failed; the row was released");
        }
        Ok(()) => {
            if let Some(text) = error_text {
                // After the settlement, in a statement of its own: only failures pay for it.
                let dead = crate::inner::attempts::retry_or_dead(&inner.table, attempt, None)
                    == crate::driver::Action::DeadLetter;
                let recorded = inner
                    .broker
                    .backend
                    .record_error(&inner.table, id, &text, dead)
                    .await;
                if let Err(e) = recorded {
                    tracing::warn!(parent: &span, error = %e, "writing the handler's error into the row failed");
                }
            }
        }
    }
    let in_shutdown = match kept {
        Some(kept) => {
            let in_shutdown = engine.stopping();
            drop(kept);
            in_shutdown
        }
        None => left_in_shutdown,
    };
    drop(held);
    // Wake the claim loop for rows this settlement freed instead of leaving them to the next
    // poll.
    if frees_rows(&inner.table, outcome) {
        engine.freed.fetch_add(1, Ordering::SeqCst);
        engine.wake.notify_one();
    }
    in_shutdown
}

/// Whether a delivery gives its worker slot back when its handler returns, before it settles:
/// lease tables without FIFO groups, whose acks can share a statement.
fn settles_beside_next_handler(table: &TableDescription) -> bool {
    table.mode() == ClaimMode::Lease && !table.fifo()
}

/// Whether a settlement can make rows claimable that a claim had to pass over: the next row of
/// a FIFO group, rows whose advisory key the delivery held, or the row itself when it is due
/// again at once.
fn frees_rows(table: &TableDescription, outcome: Outcome) -> bool {
    table.fifo() || table.mode() == ClaimMode::Advisory || outcome == Outcome::Retry
}

fn table_half_lease(lease_seconds: u32) -> Duration {
    Duration::from_millis(u64::from(lease_seconds) * 500)
}

fn panic_message(panic: &Box<dyn Any + Send>) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Catches a panic inside the handler's future, so a panicking handler becomes a retry and its
/// worker slot survives.
struct CatchUnwind<F>(F);

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(inner).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_drained_wait_grows_with_the_time_since_a_claim_found_rows() {
        let options = SubscribeOptions::new()
            .poll_interval(Duration::from_secs(1))
            .poll_cooldown(Duration::from_millis(25));
        assert_eq!(
            drained_wait(&options, None),
            Duration::from_secs(1),
            "a subscription that never found rows waits the poll interval"
        );
        let found = tokio::time::Instant::now();
        assert_eq!(
            drained_wait(&options, Some(found)),
            Duration::from_millis(25)
        );
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(
            drained_wait(&options, Some(found)),
            Duration::from_millis(300)
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(drained_wait(&options, Some(found)), Duration::from_secs(1));
    }

    #[tokio::test]
    async fn an_engine_panic_comes_back_in_the_shutdown_report() {
        let (stop, _) = watch::channel(false);
        let sub = Subscription {
            stop,
            health: Arc::default(),
            decode: Arc::default(),
            task: Some(tokio::spawn(async { panic!("the engine broke") })),
            metrics: Arc::new(MetricsSnapshot::default),
        };
        let report = sub.shutdown().await;
        assert_eq!(report.engine_panic.as_deref(), Some("the engine broke"));
    }

    #[test]
    fn a_zero_poll_cooldown_is_refused() {
        let e = SubscribeOptions::new()
            .poll_cooldown(Duration::ZERO)
            .check("jobs")
            .unwrap_err()
            .to_string();
        assert!(e.contains("poll_cooldown"), "{e}");
    }
}
