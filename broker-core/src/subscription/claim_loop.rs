//! The claim loop: one task per subscription that waits for what [`Machine::step`] asks for,
//! starts claims for free worker slots, hands claimed rows to delivery tasks, and at shutdown
//! lets them finish within the deadline. Its decisions live in [`state`](super::state); this
//! file is the I/O around them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{Database, FromRow};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

use super::handler::Handler;
use super::options::SubscribeOptions;
use super::pause::PauseWatch;
use super::plan::{Plan, pool_size};
use super::state::{Claimed, Happened, Limits, Machine, Wait};
use super::timing::{claim_backoff, spread};
use super::work::{Engine, work};
use super::{Health, InFlight, ShutdownReport, Waiting};
use crate::delivery::{self, Delivery};
use crate::driver::{Backend, Wakeup};
use crate::error::SqlxBrokerError;
use crate::metrics::Counter;
use crate::mode::QueueInner;

/// What a claim task tells the loop as soon as its claim returns: how it came back, and the
/// claimed rows beyond the first (the task runs the first itself) for the loop to start.
struct ClaimReport<B: Backend, T> {
    claimed: Claimed,
    extras: Vec<(Delivery<B, T>, OwnedSemaphorePermit)>,
    /// The loop's [`Machine::seq`] when the claim started.
    seq: u64,
}

/// Sends a claim task's report exactly once: an unsent report goes out (as failed, with no
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
                claimed: Claimed::Failed,
                extras: Vec::new(),
                seq: self.seq,
            });
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

/// The claim loop: its state machine, the claims and delivery tasks it runs, and what it waits
/// on.
struct ClaimLoop<B: Backend, T> {
    engine: Arc<Engine<B, T>>,
    plan: Plan,
    /// Rows held: in work, waiting for a slot, or asked for by a claim in flight.
    window: Arc<Semaphore>,
    reports_tx: mpsc::UnboundedSender<ClaimReport<B, T>>,
    reports: mpsc::UnboundedReceiver<ClaimReport<B, T>>,
    /// Each task says whether it ran a delivery.
    tasks: JoinSet<bool>,
    /// What the loop is doing, and what its decisions remember.
    machine: Machine,
    /// Whether the queue is paused (see [`Queue::pause`](crate::Queue::pause)): no claims
    /// start while it is.
    pause: PauseWatch,
    stop: watch::Receiver<bool>,
    broker_stop: watch::Receiver<bool>,
}

/// Runs a subscription until it or the broker stops, then shuts it down.
/// The health state, whatever a panic elsewhere left in it.
pub(super) fn lock(health: &Mutex<Health>) -> std::sync::MutexGuard<'_, Health> {
    health.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) async fn run<B, T>(
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
    let gate = shared.broker.gate(table.name());
    let wakeup = Arc::new(Wakeup::new(wake.clone(), gate.clone()));
    let listener = match shared.broker.backend.listen(&table, wakeup.clone()).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(parent: &span, error = %e, "cross-process wake-ups unavailable; polling");
            None
        }
    };
    // Reading whether pauses can be watched waits on the database as a claim does: health
    // shows it.
    let mut stops = (stop.clone(), shared.broker.shutdown.subscribe());
    let pause = {
        let _timed = InFlight::begin(&health, Waiting::PauseRead);
        PauseWatch::new(&shared, wakeup.clone(), gate.clone(), stopped(&mut stops)).await
    };
    // Stopped before it could read whether pauses can be watched: it claims nothing, and
    // shuts down with nothing to wait for.
    let pause = pause.unwrap_or_else(|| PauseWatch::stopped(wakeup.clone()));
    if pause.control {
        super::cancels::start(
            shared.clone(),
            gate.clone(),
            options.poll_interval,
            stop.clone(),
            shared.broker.shutdown.subscribe(),
        )
        .await;
    }
    let plan = Plan::new(&options, &table, pool_size(&queue));
    let (reports_tx, reports) = mpsc::unbounded_channel();
    let mut claim_loop = ClaimLoop {
        window: Arc::new(Semaphore::new(options.concurrency + plan.prefetch)),
        machine: Machine::new(Limits::new(
            &plan,
            options.poll_interval,
            options.poll_cooldown,
        )),
        engine: Arc::new(Engine {
            slots: Arc::new(Semaphore::new(options.concurrency)),
            queue,
            handler,
            options: Arc::new(options),
            wake,
            gate,
            freed: std::sync::atomic::AtomicU64::new(0),
            settlements: std::sync::atomic::AtomicU64::new(0),
            holding: std::sync::atomic::AtomicUsize::new(0),
            health,
            stop: stop.clone(),
            broker_stop: shared.broker.shutdown.subscribe(),
            span: span.clone(),
        }),
        plan,
        reports_tx,
        reports,
        tasks: JoinSet::new(),
        pause,
        broker_stop: shared.broker.shutdown.subscribe(),
        stop,
    };
    claim_loop.run().await;
    let deadline = Deadline::new(claim_loop.engine.options.shutdown_timeout);
    let report = claim_loop.shut_down(&deadline).await;
    drop(listener);
    claim_loop.engine.queue.release_kept();
    // The rows of dropped deliveries go back in clean-up tasks (lease releases, key unlocks);
    // a database that does not answer keeps them waiting, and shutdown returns at its deadline
    // whatever the database does. Left running, they end on their own (a lease release gives
    // up when its lease runs out; a key's connection that is dropped frees the key).
    if tokio::time::timeout_at(deadline.end, shared.broker.drain_cleanups())
        .await
        .is_err()
    {
        tracing::warn!(parent: &span, "shutdown deadline passed while dropped deliveries' rows were given back; that goes on in the background");
    }
    tracing::info!(parent: &span, finished = report.finished, dropped = report.dropped, "subscription stopped");
    report
}

/// Completes when the subscription (first) or the broker (second) is told to stop, or is gone.
async fn stopped(stops: &mut (watch::Receiver<bool>, watch::Receiver<bool>)) {
    let (sub, broker) = stops;
    let told = |r: &mut watch::Receiver<bool>| *r.borrow_and_update();
    if told(sub) || told(broker) {
        return;
    }
    tokio::select! {
        _ = sub.wait_for(|s| *s) => {}
        _ = broker.wait_for(|s| *s) => {}
    }
}

/// The most of a shutdown's deadline kept for giving back the rows of the deliveries it drops
/// (at most half of it): handlers get the rest.
const RELEASE_RESERVE: Duration = Duration::from_secs(1);

/// When a shutdown drops the handlers still running, and when it returns whatever the
/// database does.
struct Deadline {
    /// Claims in flight and handlers in work get until here.
    handlers: tokio::time::Instant,
    /// Shutdown returns by here: the dropped deliveries' rows are given back meanwhile.
    end: tokio::time::Instant,
}

impl Deadline {
    fn new(timeout: Duration) -> Self {
        let now = tokio::time::Instant::now();
        // A deadline past what the clock can hold means no deadline.
        let far = || now + Duration::from_secs(100 * 365 * 24 * 3600);
        let end = now.checked_add(timeout).unwrap_or_else(far);
        let reserve = RELEASE_RESERVE.min(timeout / 2);
        Self {
            handlers: end.checked_sub(reserve).unwrap_or(now),
            end,
        }
    }
}

impl<B, T> ClaimLoop<B, T>
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    fn stopped(&self) -> bool {
        *self.stop.borrow() || *self.broker_stop.borrow()
    }

    /// Moves the state machine on; returns what the loop waits for next.
    fn happen(&mut self, happened: Happened) -> Wait {
        let (machine, wait) = self.machine.step(happened, tokio::time::Instant::now());
        self.machine = machine;
        wait
    }

    /// Claims until the subscription or the broker stops.
    async fn run(&mut self) {
        while !self.stopped() {
            if self.pause.control {
                let _timed = InFlight::begin(&self.engine.health, Waiting::PauseRead);
                let mut stops = (self.stop.clone(), self.broker_stop.clone());
                self.pause
                    .refresh(
                        &self.engine.queue.shared,
                        self.engine.options.poll_interval,
                        stopped(&mut stops),
                    )
                    .await;
            }
            let paused = self.pause.paused();
            lock(&self.engine.health).paused = paused;
            let wait = self.happen(Happened::Ready {
                paused,
                claim_errors: self.engine.claim_errors_in_a_row(),
            });
            match self.next_event(wait).await {
                Event::Stop | Event::TaskDone => {}
                Event::Look => {
                    self.happen(Happened::Woken);
                }
                Event::Report(report) => self.on_report(report),
                Event::Permits(permits) => self.start_claim(permits),
            }
        }
    }

    /// Waits for what `wait` asks for, and in every state for a stop, a returning claim or an
    /// ending task.
    async fn next_event(&mut self, wait: Wait) -> Event<B, T> {
        let window = self.window.clone();
        let wanted = u32::try_from(wait.claim.unwrap_or(1)).unwrap_or(u32::MAX);
        let look = wait.look.is_some();
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
            _ = self.engine.wake.notified(), if look => Event::Look,
            _ = tokio::time::sleep(spread(wait.look.unwrap_or_default(), fastrand::f64())), if look => Event::Look,
            permits = window.acquire_many_owned(wanted), if wait.claim.is_some() => {
                Event::Permits(permits.expect("the window semaphore is never closed"))
            }
        }
    }

    /// A claim returned: its rows beyond the first start, and the state machine hears how it
    /// came back.
    fn on_report(&mut self, report: ClaimReport<B, T>) {
        for (d, permit) in report.extras {
            self.tasks
                .spawn(work(self.engine.clone(), d, permit).instrument(self.engine.span.clone()));
        }
        self.happen(Happened::ClaimReturned {
            seq: report.seq,
            claimed: report.claimed,
        });
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
        if self.pause.rescan_asked() {
            self.engine.queue.shared.head.rescan();
        }
        let e = self.engine.clone();
        self.happen(Happened::ClaimStarted);
        let seq = self.machine.seq();
        let mut reporter = Reporter {
            tx: Some(self.reports_tx.clone()),
            seq,
        };
        self.tasks.spawn(
            async move {
                let freed = e.freed.load(Ordering::SeqCst);
                let timed = InFlight::begin(&e.health, Waiting::Claim(seq));
                let result =
                    delivery::claim::<B, T>(&e.queue, permits.num_permits(), Some(&e.options.name))
                        .await;
                drop(timed);
                let (claimed, mut rows) = e.sort_claim(result, permits, freed);
                let first = (!rows.is_empty()).then(|| rows.remove(0));
                reporter.send(ClaimReport {
                    claimed,
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
    /// handlers get until the deadline, and what still runs is dropped (their rows released):
    /// handlers, settlements and claims that wait for a database that does not answer.
    async fn shut_down(&mut self, deadline: &Deadline) -> ShutdownReport {
        let mut report = ShutdownReport::default();
        let claims = async {
            while self.machine.claims() > 0 {
                let Some(claim) = self.reports.recv().await else {
                    break;
                };
                self.on_report(claim);
            }
        };
        let claims_returned = tokio::time::timeout_at(deadline.handlers, claims)
            .await
            .is_ok();
        let tasks = &mut self.tasks;
        let waited = claims_returned
            && tokio::time::timeout_at(deadline.handlers, async {
                while let Some(done) = tasks.join_next().await {
                    if matches!(done, Ok(true)) {
                        report.finished += 1;
                    }
                }
            })
            .await
            .is_ok();
        if !waited {
            // Tasks that hold a row: a claim task still waiting for its claim holds none.
            report.dropped = self.engine.holding.load(Ordering::SeqCst);
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
    /// how the claim came back.
    #[allow(clippy::type_complexity)]
    fn sort_claim(
        &self,
        result: crate::Result<Vec<Delivery<B, T>>>,
        mut permits: OwnedSemaphorePermit,
        freed: u64,
    ) -> (Claimed, Vec<(Delivery<B, T>, OwnedSemaphorePermit)>) {
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
                let freed = self.freed.load(Ordering::SeqCst) != freed;
                (Claimed::Rows { asked, got, freed }, rows)
            }
            Err(e) if self.is_conflict(&e) => {
                // The backend's quick retries met the conflict again: claim again at once
                // rather than back off.
                self.queue.shared.metrics.add(Counter::ClaimConflicts, 1);
                tracing::debug!(parent: &self.span, error = %e, "claim conflict; claiming again");
                (Claimed::Conflict, Vec::new())
            }
            Err(e) => {
                self.queue.shared.metrics.add(Counter::ClaimErrors, 1);
                let failing = self.set_health(Some(e.to_string()));
                let wait = claim_backoff(self.options.poll_interval, failing);
                tracing::warn!(parent: &self.span, error = %e, in_a_row = failing, ?wait, "claim failed; trying again after a backoff");
                (Claimed::Failed, Vec::new())
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
            // Only the claim errors clear: the concurrency and warnings stay what they were.
            None => {
                h.claim_errors_in_a_row = 0;
                h.last_claim_error = None;
            }
        }
        h.claim_errors_in_a_row
    }

    fn claim_errors_in_a_row(&self) -> u32 {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .claim_errors_in_a_row
    }
}
