//! What a delivery task does with one claimed row: lease renewal from the claim on, a worker
//! slot, the handler, settlement, and the wake-up for rows the settlement freed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{Database, FromRow};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tracing::Instrument;

use super::deadline::{self, Ran};
use super::handler::{
    CatchUnwind, Handler, HandlerPanicked, HandlerResult, Unrecoverable, panic_message,
};
use super::options::SubscribeOptions;
use super::timing::claim_backoff;
use super::{Health, InFlight, Waiting};
use crate::claim_mode::ClaimMode;
use crate::delivery::{Delivery, Outcome};
use crate::driver::{AdminDriver, Backend, Gate, Started};
use crate::metrics::{Counter, InWork};
use crate::mode::QueueInner;
use crate::table::TableDescription;

/// What every delivery task of a subscription shares.
pub(super) struct Engine<B: Backend, T> {
    pub(super) queue: Arc<QueueInner<B>>,
    pub(super) handler: Handler<B, T>,
    pub(super) options: Arc<SubscribeOptions>,
    /// One permit per delivery whose handler runs.
    pub(super) slots: Arc<Semaphore>,
    pub(super) wake: Arc<Notify>,
    /// Shut while the queue is paused: every handler passes it right before it starts.
    pub(super) gate: Arc<Gate>,
    /// Settlements that may have made rows claimable (see [`frees_rows`]). A claim that found
    /// too few rows while one landed looks again at once: it may have run before that row was
    /// free, and the wake-up the settlement sent may have gone to a claim that lost the row to
    /// it.
    pub(super) freed: AtomicU64,
    /// Numbers the settlements [`Health`] times (see [`Waiting::Settlement`]).
    pub(super) settlements: AtomicU64,
    /// Delivery tasks that hold a claimed row now (waiting for a slot, in work, or settling):
    /// what a shutdown that passes its deadline reports as dropped.
    pub(super) holding: AtomicUsize,
    /// What [`Subscription::health`](super::Subscription::health) reads; claims update it.
    pub(super) health: Arc<Mutex<Health>>,
    /// The subscription's and the broker's stop, read when a delivery leaves work: it counts
    /// in the [`ShutdownReport`](super::ShutdownReport) only if it was still in work when the stop came.
    pub(super) stop: watch::Receiver<bool>,
    pub(super) broker_stop: watch::Receiver<bool>,
    pub(super) span: tracing::Span,
}

impl<B: Backend, T> Engine<B, T> {
    /// Whether the subscription or the broker has been told to stop.
    pub(super) fn stopping(&self) -> bool {
        *self.stop.borrow() || *self.broker_stop.borrow()
    }

    /// Completes when the subscription or the broker is told to stop.
    fn stopped(&self) -> impl Future<Output = ()> + use<B, T> {
        let (mut sub, mut broker) = (self.stop.clone(), self.broker_stop.clone());
        async move {
            tokio::select! {
                _ = sub.wait_for(|s| *s) => {}
                _ = broker.wait_for(|s| *s) => {}
            }
        }
    }
}

/// One claimed row: lease renewal from the start, a slot, the handler, then settlement.
/// Returns whether the delivery was in work (counted in `in_work`) when the subscription or
/// broker was told to stop: what [`ShutdownReport::finished`](super::ShutdownReport::finished) counts. A delivery that left work
/// before the stop is not counted, even when its task ends after it.
pub(super) async fn work<B, T>(
    engine: Arc<Engine<B, T>>,
    mut delivery: Delivery<B, T>,
    held: OwnedSemaphorePermit,
) -> bool
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    let _holding = Holding::enter(&engine.holding);
    delivery.cap_snoozes(engine.options.max_snoozes);
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
        // Paused: the row waits here holding its claim (its lease renewed beside), and is
        // given back unrun when the subscription stops first (see docs/operating.md).
        let Some(entered) = engine.gate.enter(engine.stopped()).await else {
            stop_renewal.notify_one();
            return None;
        };
        let in_work = InWork::enter(&inner.metrics);
        if let Some(due) = delivery.due_ms() {
            // Whole milliseconds: exact in an f64 for any due time.
            #[allow(clippy::cast_precision_loss)]
            inner
                .metrics
                .started_after_due((crate::driver::clock::now_ms() - due) as f64 / 1000.0);
        }
        let mut job = delivery.take_job();
        // A job kind's limits, read from its row, in place of the subscription's and table's.
        let limits = engine.handler.limits_of(job.payload_mut());
        if let Some(max) = limits.max_attempts {
            delivery.set_max_attempts(max);
        }
        // The job's own timeout, then its kind's, then the subscription's.
        let timeout = delivery.timeout().or(limits.timeout).or(options.timeout);
        // Crashes spent the kind's attempts before this delivery (the claim checked the
        // table's): dead-letter it without running the handler.
        let spent = limits
            .max_attempts
            .is_some_and(|max| attempt > i64::from(max));
        let signal = job.cancel_signal();
        // On the table's board from here until the delivery leaves work: a cancel request for
        // the row raises `signal`, from this process, a NOTIFY or the poll's read.
        let (_on_board, requested) = OnBoard::enter(&engine.gate.cancels, id, &signal);
        if requested {
            // Cancelled while no one ran it (its holder went away, or the request reached this
            // broker before the row did): the handler never starts.
            drop((job, entered));
            tracing::info!(parent: &span, "the row has a cancel request; deleting it without running its handler");
            stop_renewal.notify_one();
            let handled = Handled::Cancelled {
                reason: crate::CancelReason::Cancelled,
                mid_statement: false,
            };
            return Some((handled, (Some((slot, in_work)), false)));
        }
        let lent = if engine.handler.lends_transaction {
            delivery.lend_transaction()
        } else {
            None
        };
        let started = std::time::Instant::now();
        let ran = if spent {
            tracing::warn!(parent: &span, max_attempts = limits.max_attempts, "the job kind's attempts were spent before this delivery (a crash used them); dead-lettering");
            drop((job, entered));
            Ran::Returned(Ok(Ok(Outcome::DeadLetter)))
        } else {
            deadline::run(
                CatchUnwind(Started::new((engine.handler.f)(job, lent.clone()), entered)),
                timeout,
                options.cancel_grace,
                &signal,
            )
            .instrument(span.clone())
            .await
        };
        let handled = match ran {
            Ran::Returned(result) => Handled::Returned(result),
            Ran::Cancelled { reason, left } => {
                // A guard out while the handler is dropped: it may be mid-statement on the
                // row lock transaction, whose connection then must not be used again.
                let mid_statement = left.is_some() && lent.as_ref().is_some_and(|l| l.in_use());
                // Dropped here, before the row is settled or given back: nothing of this
                // delivery runs once the row's next delivery can start.
                drop(left);
                if matches!(reason, crate::CancelReason::TimedOut { .. }) {
                    inner.metrics.add(Counter::TimedOut, 1);
                }
                Handled::Cancelled {
                    reason,
                    mid_statement,
                }
            }
        };
        inner.metrics.handler_ran(started.elapsed().as_secs_f64());
        if let Some(lent) = lent {
            delivery.take_back(lent);
        }
        if matches!(
            handled,
            Handled::Cancelled {
                mid_statement: true,
                ..
            }
        ) {
            delivery.close_transaction_on_drop();
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
        Some((handled, keep))
    };
    let (finished, ()) = tokio::join!(running, renewal);
    let Some((handled, (kept, left_in_shutdown))) = finished else {
        // Stopped while paused: the delivery drops unrun, which gives its row back.
        return false;
    };

    let backoff_due = |attempt| {
        let d = options.backoff(attempt);
        if d.is_zero() || inner.table.due_at().is_none() {
            Outcome::Retry
        } else {
            Outcome::RetryAfter(d)
        }
    };
    // What the row's last_error column keeps, where the table has one.
    let error_text = match &handled {
        Handled::Returned(Ok(Err(e))) => Some(e.to_string()),
        Handled::Returned(Err(panic)) => Some(format!("panic: {}", panic_message(panic))),
        Handled::Returned(Ok(Ok(_))) => None,
        Handled::Cancelled {
            mid_statement: true,
            ..
        } => None,
        // The row is deleted: nothing to keep.
        Handled::Cancelled {
            reason: crate::CancelReason::Cancelled,
            ..
        } => None,
        Handled::Cancelled { reason, .. } => Some(reason.to_string()),
    }
    .filter(|_| inner.table.last_error().is_some());
    // An operator's cancel: the row is deleted below, whatever the handler returned.
    let cancel = matches!(
        handled,
        Handled::Cancelled {
            reason: crate::CancelReason::Cancelled,
            mid_statement: false,
        }
    );
    let outcome = match handled {
        Handled::Cancelled {
            mid_statement: true,
            reason,
        } => {
            // The transaction closes with its connection: the server rolls it back and the row
            // is due again at once, its attempt not counted (as when a process dies). A cancel
            // request stays, and the row's next claim deletes it without running it.
            tracing::warn!(parent: &span, %reason, "handler cancelled while it held its row lock transaction; closing the transaction's connection, which releases the row");
            None
        }
        Handled::Cancelled {
            reason: crate::CancelReason::Cancelled,
            ..
        } => {
            tracing::info!(parent: &span, "cancelled by an operator; deleting the row");
            Some(Outcome::Ack)
        }
        Handled::Cancelled { reason, .. } => {
            tracing::warn!(parent: &span, %reason, "handler timed out; retrying");
            Some(backoff_due(attempt))
        }
        Handled::Returned(Ok(Ok(Outcome::RetryAfter(d))))
            if inner.table.due_at().is_none() && !d.is_zero() =>
        {
            tracing::warn!(parent: &span, "handler asked for a delayed retry, but the table has no due-time column; retrying at once");
            Some(Outcome::Retry)
        }
        Handled::Returned(Ok(Ok(Outcome::Snooze(_)))) if inner.table.due_at().is_none() => {
            tracing::warn!(parent: &span, "handler asked to snooze, but the table has no due-time column; retrying at once (the attempt is spent)");
            Some(Outcome::Retry)
        }
        Handled::Returned(Ok(Ok(outcome))) => Some(outcome),
        Handled::Returned(Ok(Err(e))) if e.is::<Unrecoverable>() => {
            inner.metrics.add(Counter::HandlerErrors, 1);
            tracing::warn!(parent: &span, error = %e, "handler failed and said trying again cannot help; dead-lettering");
            Some(Outcome::DeadLetter)
        }
        // A panic that a handler service turned into an error, for its layers to see: still a
        // panic.
        Handled::Returned(Ok(Err(e))) if e.is::<HandlerPanicked>() => {
            inner.metrics.add(Counter::Panics, 1);
            tracing::error!(parent: &span, panic = %e, "handler panicked; retrying");
            Some(backoff_due(attempt))
        }
        Handled::Returned(Ok(Err(e))) => {
            inner.metrics.add(Counter::HandlerErrors, 1);
            tracing::warn!(parent: &span, error = %e, "handler failed; retrying");
            Some(backoff_due(attempt))
        }
        Handled::Returned(Err(panic)) => {
            inner.metrics.add(Counter::Panics, 1);
            tracing::error!(parent: &span, panic = panic_message(&panic), "handler panicked; retrying");
            Some(backoff_due(attempt))
        }
    };
    // None: give the row back unsettled (see above).
    let (outcome, settle) = match outcome {
        Some(outcome) => (outcome, true),
        None => (Outcome::Retry, false),
    };
    let number = engine.settlements.fetch_add(1, Ordering::Relaxed);
    let timed = InFlight::begin(&engine.health, Waiting::Settlement(number));
    let max_attempts = delivery.max_attempts();
    let settled = if cancel {
        delivery.settle_cancelled().await
    } else if settle {
        delivery.settle(outcome).await
    } else {
        drop(delivery);
        Ok(())
    };
    drop(timed);
    match settled {
        Err(e) => {
            tracing::warn!(parent: &span, error = %e, ?outcome, "settlement failed; the row was released");
        }
        Ok(()) if cancel => {
            // The row is gone: its request too. A failure leaves it to the poll's clean-up.
            engine.gate.cancels.forget(id);
            if let Err(e) = inner
                .broker
                .backend
                .admin()
                .clear_cancel(inner.name(), id)
                .await
            {
                tracing::warn!(parent: &span, error = %e, "deleting the cancel request of a cancelled row failed");
            }
        }
        Ok(()) => {
            if let Some(text) = error_text {
                // After the settlement, in a statement of its own: only failures pay for it.
                let dead = outcome == Outcome::DeadLetter
                    || crate::inner::attempts::retry_or_dead(max_attempts, attempt, None)
                        == crate::driver::Action::DeadLetter;
                let recorded = inner
                    .broker
                    .backend
                    .admin()
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

/// How the handler of a delivery ended.
enum Handled {
    /// It returned (or panicked) before its timeout.
    Returned(Result<HandlerResult, Box<dyn std::any::Any + Send>>),
    /// Its timeout passed (whatever it returned, the delivery is a failed attempt) or an
    /// operator cancelled its row (whatever it returned, the row is deleted): it was
    /// signalled, and dropped unless it returned within the grace. Also a row whose cancel was
    /// requested before its handler started, which never ran.
    Cancelled {
        reason: crate::CancelReason,
        /// It was dropped while it held its row lock transaction (see
        /// [`Delivery::close_transaction_on_drop`]): the row is given back unsettled.
        mid_statement: bool,
    },
}

/// A delivery on its table's [`CancelBoard`](crate::cancel::CancelBoard) until it drops.
struct OnBoard<'a>(&'a crate::cancel::CancelBoard, i64);

impl<'a> OnBoard<'a> {
    /// Puts the delivery of row `id` on `board`; also returns whether a cancel of the row is
    /// requested already.
    fn enter(
        board: &'a crate::cancel::CancelBoard,
        id: i64,
        signal: &crate::CancelSignal,
    ) -> (Self, bool) {
        let requested = board.enter(id, signal);
        (Self(board, id), requested)
    }
}

impl Drop for OnBoard<'_> {
    fn drop(&mut self) {
        self.0.leave(self.1);
    }
}

/// Counts a delivery task in [`Engine::holding`] until it ends, however it ends.
struct Holding<'a>(&'a AtomicUsize);

impl<'a> Holding<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
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
