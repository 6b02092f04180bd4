//! The subscription engine: overlapping claims for free worker slots, handlers with lease
//! renewal, settlement, and graceful shutdown. Backend-independent.
//!
//! Read it in this order:
//! - this file: the [`Subscription`] handle a user holds, its [`Health`] and [`ShutdownReport`],
//!   and `start`, which checks the options and spawns the engine;
//! - [`options`]: [`SubscribeOptions`] and the values refused at subscribe;
//! - [`handler`]: the user's handler, boxed once, and the catching of its panics;
//! - [`plan`]: fitting the options to the pool, and how many rows and claims the engine runs;
//! - [`timing`]: how long the loop waits after a drained or a failed claim;
//! - [`state`]: the loop's states ([`state::LoopState`]) and the one function that moves
//!   between them ([`state::Machine::step`]);
//! - [`claim_loop`]: the loop itself, the I/O around `step`, and shutdown;
//! - [`pause`]: how the loop sees a paused queue;
//! - [`cancels`]: how the subscription sees cancel requests for rows in work;
//! - [`work`]: one claimed row, from lease renewal through the handler to settlement.

mod cancels;
mod claim_loop;
mod deadline;
mod handler;
mod options;
mod pause;
mod plan;
mod state;
mod timing;
mod work;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::{Database, FromRow};
use tokio::sync::watch;

pub use handler::{
    BoxError, BoxFuture, HandlerPanicked, HandlerResult, HandlerService, IntoOutcome,
    Unrecoverable, handler_service,
};
pub(crate) use handler::{Handler, Limits};
pub use options::{
    DEFAULT_CANCEL_GRACE, DEFAULT_POLL_COOLDOWN, MIN_POLL_INTERVAL, SubscribeOptions,
};

use crate::claim_mode::ClaimMode;
use crate::driver::Backend;
use crate::error::SqlxBrokerError;
use crate::metrics::MetricsSnapshot;
use crate::mode::QueueInner;

/// What a shutdown found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Deliveries in work when the shutdown began (or started during it, from rows already
    /// claimed) whose handlers finished and were settled before the deadline. A delivery that
    /// had left work before the stop (it shows in the counters as acked, retried, ...) is not
    /// counted, even when its task had not ended yet.
    pub finished: usize,
    /// Deliveries still running at the deadline (a handler, or a settlement waiting for the
    /// database), dropped: their rows are released, and a settlement cut short counts in
    /// `settle_failed` (it may have landed).
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
    /// How long a statement may wait before [`Health::waiting_for_database`] reports it.
    poll_interval: Duration,
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
        h.read_waiting(self.poll_interval);
        let d = self.decode.lock().unwrap_or_else(|p| p.into_inner());
        h.decode_errors_in_a_row = d.in_a_row;
        h.last_decode_error.clone_from(&d.last);
        h
    }

    /// Graceful shutdown: stops claiming, waits for handlers in work up to the shutdown
    /// deadline and settles them, drops the rest (their rows are released), and waits until every
    /// key lock and connection of this subscription is given back.
    ///
    /// It returns within [`SubscribeOptions::shutdown_timeout`] whatever the database does: a
    /// server that went away leaves claims, settlements and releases waiting for a connection,
    /// and what still waits at the deadline is dropped (see `shutdown_timeout` for how the
    /// deadline is shared, and [`ShutdownReport::dropped`]).
    pub async fn shutdown(mut self) -> ShutdownReport {
        self.stop.send_replace(true);
        match self.task.take() {
            Some(task) => match task.await {
                Ok(report) => report,
                Err(e) => {
                    let engine_panic = match e.try_into_panic() {
                        Ok(panic) => handler::panic_message(&panic).to_owned(),
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

/// The shortest wait that [`Health::waiting_for_database`] reports, whatever the poll interval:
/// a statement on a busy server or behind a cold connection may take a moment.
const WAIT_FLOOR: Duration = Duration::from_millis(250);

/// Set in the [`Waiting`] number of a settlement.
const SETTLEMENT_BIT: u64 = 1 << 63;

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
    /// Whether the queue is paused ([`Queue::pause`](crate::Queue::pause), from any process)
    /// as the subscription last read it: no claims start while it is. A paused subscription
    /// is healthy (the pause is an operator's choice), and idle.
    pub paused: bool,
    /// The concurrency the subscription runs at: what `SubscribeOptions::concurrency` asked
    /// for, or less where the pool cannot serve it (then `warnings` says so).
    pub concurrency: usize,
    /// What works but should be fixed, one sentence each with the fix: a concurrency or claim
    /// limit lowered to fit the pool, a claim index missing (from [`Queue::warnings`](crate::Queue::warnings)).
    pub warnings: Vec<String>,
    /// How long the subscription's oldest statement in flight (a claim, a settlement, or the
    /// read of the queue's pause that comes before claims) has waited for the database, once
    /// that is longer than the poll interval and at least 250 ms (a busy server may take a
    /// moment): the database answers nothing (a server down or failing over, a pool with no
    /// connection to give, a lock on the table). `None` while statements come back in time. A
    /// claim that waits shows here before it fails and counts in `claim_errors_in_a_row`; a
    /// settlement that keeps trying after lost connections shows here all along.
    pub waiting_for_database: Option<Duration>,
    /// When each statement in flight began, by [`Waiting`] number.
    in_flight: BTreeMap<u64, Instant>,
}

impl Health {
    /// Whether the last claim worked and the last claimed row decoded. Warnings do not make a
    /// subscription unhealthy.
    pub fn is_healthy(&self) -> bool {
        self.claim_errors_in_a_row == 0
            && self.decode_errors_in_a_row == 0
            && self.waiting_for_database.is_none()
    }

    /// Notes that the statement `what` began now.
    pub(crate) fn began(&mut self, what: Waiting) {
        self.in_flight.insert(what.number(), Instant::now());
    }

    /// Notes that the statement `what` returned.
    pub(crate) fn returned(&mut self, what: Waiting) {
        self.in_flight.remove(&what.number());
    }

    /// Fills in [`waiting_for_database`](Self::waiting_for_database): the oldest statement in
    /// flight, if it has waited longer than `poll_interval` and [`WAIT_FLOOR`].
    fn read_waiting(&mut self, poll_interval: Duration) {
        let limit = poll_interval.max(WAIT_FLOOR);
        self.waiting_for_database = self
            .in_flight
            .values()
            .min()
            .map(Instant::elapsed)
            .filter(|waited| *waited > limit);
    }
}

/// Times a statement in [`Health`] until it drops (also when its future is dropped midway).
pub(crate) struct InFlight<'a> {
    health: &'a Mutex<Health>,
    what: Waiting,
}

impl<'a> InFlight<'a> {
    /// Notes that `what` began now, in `health`.
    pub(crate) fn begin(health: &'a Mutex<Health>, what: Waiting) -> Self {
        claim_loop::lock(health).began(what);
        Self { health, what }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        claim_loop::lock(self.health).returned(self.what);
    }
}

/// A statement of a subscription that [`Health`] times while it is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waiting {
    /// The claim loop's read of the pause.
    PauseRead,
    /// The claim the loop counted so ([`state::Machine::seq`]).
    Claim(u64),
    /// A delivery's settlement, by a number of the subscription's own.
    Settlement(u64),
}

impl Waiting {
    /// One number per statement: the pause read 0, claims by their count (from 1), settlements
    /// from the top bit up.
    fn number(self) -> u64 {
        match self {
            Self::PauseRead => 0,
            Self::Claim(seq) => seq & !SETTLEMENT_BIT,
            Self::Settlement(n) => n | SETTLEMENT_BIT,
        }
    }
}

/// Checks the options, fits them to the pool and spawns the engine of a new subscription.
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
    options.check_table(&queue.shared.table)?;
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
    for w in options.warnings(&queue.shared.table) {
        tracing::warn!(table = queue.shared.name(), "{w}");
        crate::warnings::report(queue.shared.name(), w.clone());
        warnings.push(w);
    }
    warnings.extend(plan::fit_to_pool(
        &mut options,
        &queue.shared.table,
        plan::pool_size(&queue),
        queue
            .shared
            .broker
            .backend
            .capabilities()
            .process_local_keys,
    ));
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
    let poll_interval = options.poll_interval;
    let task = tokio::spawn(async move {
        let _running = running;
        claim_loop::run(queue, options, handler, stop_rx, engine_health).await
    });
    Ok(Subscription {
        stop,
        health,
        poll_interval,
        decode,
        task: Some(task),
        metrics,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_engine_panic_comes_back_in_the_shutdown_report() {
        let (stop, _) = watch::channel(false);
        let sub = Subscription {
            stop,
            health: Arc::default(),
            poll_interval: Duration::from_secs(1),
            decode: Arc::default(),
            task: Some(tokio::spawn(async { panic!("the engine broke") })),
            metrics: Arc::new(MetricsSnapshot::default),
        };
        let report = sub.shutdown().await;
        assert_eq!(report.engine_panic.as_deref(), Some("the engine broke"));
    }
}
