//! Deliveries and their settlement, and what a subscription's handler receives: a [`Job`] and,
//! in row lock mode, a [`JobTransaction`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::{Database, FromRow};

use crate::cancel::{CancelReason, CancelSignal};
use crate::claim_mode::ClaimMode;
use crate::driver::clock;
use crate::driver::{Action, AdminDriver, Backend, ClaimedRow, Position, RowTransaction, Settle};
use crate::error::{Result, SqlxBrokerError};
use crate::inner::{SETTLE_FAILURE_LIMIT, Shared, attempts};
use crate::metrics::Counter;
use crate::mode::lease::Renewer;
use crate::mode::row_lock::TxHold;
use crate::mode::{Hold, QueueInner};
use crate::table::TableDescription;

/// What a handler decided about its delivery.
///
/// Not `#[non_exhaustive]`: a handler builds one, and code that settles deliveries by hand
/// matches every outcome on purpose; a new outcome would be a new major version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Done: delete the row, or set `processed_at`.
    Ack,
    /// Put the row back, due at once. Dead-letters instead when the attempts are spent.
    Retry,
    /// Put the row back, due after the delay (the table needs a due-time column). Dead-letters
    /// instead when the attempts are spent. The due time is at most 9999-12-31, so
    /// `Duration::MAX` parks the row.
    RetryAfter(Duration),
    /// Dead-letter the row now.
    DeadLetter,
    /// Put the row back, due after the delay, without spending an attempt: afterwards the
    /// row's attempt is what it was before this delivery's claim, whatever the claim mode, so
    /// the next delivery reports the same attempt as this one. The table needs a due-time
    /// column. Counted in the table's snooze counter column where it has one; a subscription
    /// with [`max_snoozes`](crate::SubscribeOptions::max_snoozes) dead-letters the row instead
    /// once it has been snoozed that many times. See docs/handlers.md, "Snooze".
    Snooze(Duration),
}

/// One job a subscription hands its handler: the row as the queue's row type, its id, its
/// attempt and its advisory key. The handler owns it.
///
/// ```
/// use broker_core::{Job, Outcome, Payload};
///
/// async fn send_email(job: Job<Payload<String>>) -> Result<Outcome, std::io::Error> {
///     println!("to {} (attempt {})", job.payload().0, job.attempt());
///     Ok(Outcome::Ack)
/// }
/// # let _ = send_email;
/// ```
#[derive(Debug)]
pub struct Job<T> {
    id: i64,
    attempt: i64,
    key: Option<String>,
    payload: T,
    table: Arc<TableDescription>,
    lease_expires_ms: Option<i64>,
    cancel: CancelSignal,
    snoozes: Option<i64>,
}

impl<T> Job<T> {
    /// The row id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The attempt as it stood before this delivery's claim: the first delivery reads 1.
    pub fn attempt(&self) -> i64 {
        self.attempt
    }

    /// The advisory key, in advisory mode.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// How many times the row was snoozed before this delivery, where the table has a snooze
    /// counter column ([`TableBuilder::snoozes`](crate::TableBuilder::snoozes)).
    pub fn snoozes(&self) -> Option<i64> {
        self.snoozes
    }

    /// The row, as the queue's row type.
    pub fn payload(&self) -> &T {
        &self.payload
    }

    /// The row, taken out of the job.
    pub fn into_payload(self) -> T {
        self.payload
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        self.table.name()
    }

    /// In lease mode, the lease expiry (unix milliseconds) the job's claim wrote; the
    /// subscription renews it every half lease while the handler runs.
    pub fn lease_expires_ms(&self) -> Option<i64> {
        self.lease_expires_ms
    }

    /// Completes, with the reason, once the delivery is cancelled: its timeout passed (see
    /// [`SubscribeOptions::timeout`](crate::SubscribeOptions::timeout)). The handler then has
    /// the subscription's [`cancel_grace`](crate::SubscribeOptions::cancel_grace) to return
    /// before its future is dropped. Never completes for a delivery that is not cancelled; use
    /// it in a `select!` beside the work (see [`CancelSignal`]).
    ///
    /// The future holds a handle on the signal, not a borrow of the job, so it is `Send`
    /// whatever the row type, and the handler may move the job while it waits.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn cancelled(&self) -> impl std::future::Future<Output = CancelReason> + Send + 'static {
        let signal = self.cancel.clone();
        async move { signal.cancelled().await }
    }

    /// Whether the delivery has been cancelled (see [`cancelled`](Self::cancelled)).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Why the delivery was cancelled, once it has been.
    pub fn cancel_reason(&self) -> Option<CancelReason> {
        self.cancel.reason()
    }

    /// The row, to change in place (the engine's limits read keeps a kind's decoded arguments).
    pub(crate) fn payload_mut(&mut self) -> &mut T {
        &mut self.payload
    }
    /// The same job with its row turned into another type (a kind's arguments): id, attempt,
    /// key and cancel signal stay.
    pub(crate) fn map_payload<U>(self, f: impl FnOnce(T) -> U) -> Job<U> {
        Job {
            id: self.id,
            attempt: self.attempt,
            key: self.key,
            payload: f(self.payload),
            table: self.table,
            lease_expires_ms: self.lease_expires_ms,
            cancel: self.cancel,
            snoozes: self.snoozes,
        }
    }
    /// The delivery's cancel signal, to hand to a task the handler spawns or to keep after
    /// [`into_payload`](Self::into_payload).
    pub fn cancel_signal(&self) -> CancelSignal {
        self.cancel.clone()
    }
}

/// The transaction a row lock delivery's claim opened, lent to a handler subscribed with
/// [`Queue::subscribe_with_transaction`](crate::Queue::subscribe_with_transaction): what the
/// handler writes through it commits with the ack in one commit, and rolls back with a retry or
/// dead letter while the row stays locked.
///
/// Use it only inside the handler: once the handler returns, the subscription takes the
/// transaction back to settle the row.
pub struct JobTransaction<B: Backend> {
    slot: Arc<tokio::sync::Mutex<Option<TxHold<B>>>>,
    table: Arc<TableDescription>,
}

impl<B: Backend> Clone for JobTransaction<B> {
    fn clone(&self) -> Self {
        Self {
            slot: self.slot.clone(),
            table: self.table.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for JobTransaction<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobTransaction").finish_non_exhaustive()
    }
}

/// The delivery's transaction, borrowed from a [`JobTransaction`]; it dereferences to the
/// [`RowTransaction`], which dereferences to the connection (`&mut **tx` is an executor).
pub struct TxGuard<'a, B: Backend> {
    guard: tokio::sync::MutexGuard<'a, Option<TxHold<B>>>,
}

impl<B: Backend> std::ops::Deref for TxGuard<'_, B> {
    type Target = RowTransaction<B::Db>;
    fn deref(&self) -> &Self::Target {
        self.guard
            .as_ref()
            .expect("a guard is only made over a lent transaction")
            .tx()
    }
}

impl<B: Backend> std::ops::DerefMut for TxGuard<'_, B> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.guard
            .as_mut()
            .expect("a guard is only made over a lent transaction")
            .tx_mut()
    }
}

impl<B: Backend> JobTransaction<B> {
    /// Whether a [`TxGuard`] of it is out now (the handler may be mid-statement on it).
    pub(crate) fn in_use(&self) -> bool {
        self.slot.try_lock().is_err()
    }

    /// The transaction. The first call marks where the handler's writes begin (a savepoint, one
    /// statement); a handler that never calls it costs none.
    ///
    /// # Errors
    /// [`SqlxBrokerError::Unsupported`] when the handler already returned (the subscription
    /// took the transaction back), or the statement that sets the mark failed (e.g. the
    /// connection was lost); the row is then settled or released as usual.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled first call may leave the connection mid-statement; the
    /// settlement then fails and the transaction rolls back.
    pub async fn get(&self) -> Result<TxGuard<'_, B>> {
        let mut guard = self.slot.lock().await;
        let Some(hold) = guard.as_mut() else {
            return Err(SqlxBrokerError::Unsupported {
                table: self.table.name().to_owned(),
                message: "the delivery's transaction was used after its handler returned; use it only inside the handler".into(),
            });
        };
        hold.transaction().await?;
        Ok(TxGuard { guard })
    }
}

/// One claimed row in work: its columns, its attempt, and what holds it. [`Queue::claim`]
/// hands these out for settling by hand; subscriptions hand their handlers a [`Job`] instead.
///
/// Settle it with [`ack`](Self::ack), [`retry`](Self::retry),
/// [`retry_after`](Self::retry_after), [`dead_letter`](Self::dead_letter) or
/// [`settle`](Self::settle); each consumes the delivery, so it cannot be settled twice.
///
/// [`Queue::claim`]: crate::Queue::claim
///
/// # Dropped without settlement
/// - row lock: the transaction rolls back (with any writes made through it); the row is due again
///   at once and the attempt is not counted.
/// - lease: the lease is released in a clean-up task (the row is due again at once); the attempt
///   counted at the claim stays counted. Without a runtime the lease simply runs out.
/// - advisory lock: the key is unlocked in a clean-up task; the attempt counted at the take
///   stays counted.
pub struct Delivery<B: Backend, T> {
    queue: Arc<Shared<B>>,
    id: i64,
    /// Where the row stood in the claim order when it was claimed: where it is when given
    /// back unsettled.
    position: Position,
    attempt: i64,
    key: Option<String>,
    /// The row; a subscription moves it into the handler's [`Job`].
    row: Option<T>,
    hold: Option<Hold<B>>,
    /// Settlements of this row that failed in a row before this delivery.
    settle_failures: u32,
    /// The hold is lent to the handler as its transaction and not taken back yet: the row is
    /// still this delivery's to account for.
    lent: bool,
    /// The row's snoozes before this delivery, where the table counts them.
    snoozes: Option<i64>,
    /// The subscription's [`max_snoozes`](crate::SubscribeOptions::max_snoozes); `None` for
    /// deliveries claimed by hand.
    max_snoozes: Option<u32>,
    /// The deliveries after which a failing row is dead-lettered: the table's, or its job
    /// kind's (see [`JobKind`](crate::JobKind)).
    max_attempts: Option<u32>,
    /// The job's own timeout, from its row's job timeout column.
    timeout: Option<std::time::Duration>,
}

/// Where a settled row stands in the claim order once `action` put it back: a retry moves it
/// to its new due time (none: first of all); an ack or dead letter takes it out.
fn given_back(table: &TableDescription, id: i64, action: Action) -> Option<Position> {
    match action {
        Action::Retry { due_ms } => Some(Position {
            due_ms: due_ms.filter(|_| table.due_at().is_some()),
            id,
        }),
        Action::Snooze { due_ms } => Some(Position {
            due_ms: Some(due_ms),
            id,
        }),
        Action::Ack | Action::DeadLetter | Action::Cancel => None,
    }
}

/// A delivery dropped while it still holds its row gives the row back (each mode's hold
/// releases it as it drops) and counts it in `released`.
impl<B: Backend, T> Drop for Delivery<B, T> {
    fn drop(&mut self) {
        if self.hold.is_some() || self.lent {
            self.queue.metrics.add(Counter::Released, 1);
            self.queue.head.gave_back(self.position);
        }
    }
}

impl<B: Backend, T> std::fmt::Debug for Delivery<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("table", &self.queue.name())
            .field("id", &self.id)
            .field("attempt", &self.attempt)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// Claims up to `limit` rows as deliveries, for the subscription named `subscription` (`None`:
/// a claim by hand); rows whose attempts are spent or that do not decode are settled on the spot
/// (see [`Delivery::from_claim`]).
pub(crate) async fn claim<B, T>(
    queue: &QueueInner<B>,
    limit: usize,
    subscription: Option<&str>,
) -> Result<Vec<Delivery<B, T>>>
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    if queue.shared.broker.closed.load(Ordering::SeqCst) {
        return Err(SqlxBrokerError::Closed {
            table: queue.shared.name().to_owned(),
            what: "a claim".into(),
        });
    }
    let began = std::time::Instant::now();
    let claimed = queue.claim(limit.max(1), subscription.is_some()).await?;
    // How long the claim took: a row's hold was taken somewhere in it, so a fault between its
    // start and now may have taken the hold before the handler begins.
    let claim_us = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
    queue
        .shared
        .metrics
        .claim_took(began.elapsed().as_secs_f64());
    let mut out = Vec::with_capacity(claimed.len());
    for (row, hold) in claimed {
        if let Some(d) = Delivery::from_claim(queue.shared.clone(), row, hold).await {
            tracing::debug!(
                table = queue.shared.name(),
                subscription = subscription.unwrap_or(""),
                id = d.id,
                attempt = d.attempt,
                claim_us,
                "claimed"
            );
            crate::events::emit(|| {
                let returned = std::time::SystemTime::now();
                crate::events::EngineEvent::Claimed {
                    table: queue.shared.name(),
                    subscription: subscription.unwrap_or(""),
                    id: d.id,
                    attempt: d.attempt,
                    began: returned
                        .checked_sub(std::time::Duration::from_micros(claim_us))
                        .unwrap_or(returned),
                    returned,
                }
            });
            out.push(d);
        }
    }
    Ok(out)
}

impl<B: Backend, T> Delivery<B, T>
where
    T: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    /// Builds a delivery from a claimed row, or settles the row at once when its attempts are
    /// spent (dead letter) or it does not decode (retry, attempt counted).
    pub(crate) async fn from_claim(
        queue: Arc<Shared<B>>,
        claimed: ClaimedRow<B::Db>,
        hold: Hold<B>,
    ) -> Option<Self> {
        let id = claimed.id;
        let attempt = claimed.attempt;
        let position = claimed.position();
        let now_ms = clock::now_ms();
        let spent = attempts::spent(&queue.table, attempt);
        let failed = queue.settle_failures.get(id);
        let failures = failed.as_ref().map_or(0, |(n, _)| *n);
        // A row whose settlement failed again and again would fail again: it goes to the dead
        // letters with the reason instead of running once more. Without a dead-letter target it
        // keeps running, each time after a longer backoff (see the engine).
        let settle_keeps_failing =
            failures >= SETTLE_FAILURE_LIMIT && queue.table.dead_letter().is_some();
        let decoded = if spent || settle_keeps_failing {
            None
        } else {
            Some(
                T::from_row(&claimed.row)
                    .map_err(|e| crate::payload::naming_columns(&queue.table, e)),
            )
        };
        match &decoded {
            Some(Ok(_)) => queue
                .decode
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .decoded(),
            Some(Err(source)) => {
                let text = crate::error::driver_message(source);
                crate::warnings::print_once(
                    queue.name(),
                    &format!(
                        "claimed rows do not decode into the handler's row type ({text}); each is retried, then dead-lettered: make the row type match the table's columns (see Subscription::health)"
                    ),
                );
                queue
                    .decode
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .failed(format!("row {id}: {text}"));
            }
            None => {}
        }
        match decoded {
            Some(Ok(row)) => Some(Self {
                id,
                position,
                attempt,
                key: claimed.key,
                row: Some(row),
                hold: Some(hold),
                settle_failures: failures,
                lent: false,
                snoozes: claimed.snoozes,
                max_snoozes: None,
                max_attempts: queue.table.max_attempts(),
                timeout: claimed
                    .timeout_ms
                    .and_then(|ms| u64::try_from(ms).ok())
                    .map(std::time::Duration::from_millis),
                queue,
            }),
            None => {
                if let Some((n, last)) = failed.filter(|_| settle_keeps_failing) {
                    tracing::error!(
                        table = queue.name(),
                        id,
                        attempt,
                        failures = n,
                        last_error = last,
                        "the settlement of this row failed {n} times in a row; dead-lettering it without running the handler again"
                    );
                } else {
                    tracing::warn!(
                        table = queue.name(),
                        id,
                        attempt,
                        "attempts spent before this delivery (a crash used them); dead-lettering"
                    );
                }
                let settle = Settle {
                    id,
                    action: Action::DeadLetter,
                    now_ms,
                    attempt: attempts::held(queue.table.mode(), attempt),
                };
                match hold.settle(settle, &queue).await {
                    Ok(()) => {
                        queue.settle_failures.clear(id);
                        queue.metrics.add(Counter::DeadLettered, 1);
                    }
                    Err(e) => {
                        queue.head.gave_back(position);
                        tracing::warn!(table = queue.name(), id, error = %e, "dead-lettering the row failed; it was released")
                    }
                }
                None
            }
            Some(Err(source)) => {
                queue.metrics.add(Counter::DecodeErrors, 1);
                let error = SqlxBrokerError::Decode {
                    table: queue.name().to_owned(),
                    id,
                    source,
                };
                tracing::error!(table = queue.name(), id, attempt, error = %error, "claimed row does not decode");
                let action = attempts::retry_or_dead(queue.table.max_attempts(), attempt, None);
                let settle = Settle {
                    id,
                    action,
                    now_ms,
                    attempt: attempts::held(queue.table.mode(), attempt),
                };
                match hold.settle(settle, &queue).await {
                    Ok(()) if action == Action::DeadLetter => {
                        queue.metrics.add(Counter::DeadLettered, 1);
                    }
                    Ok(()) => {
                        queue.metrics.add(Counter::Retried, 1);
                        if let Some(p) = given_back(&queue.table, id, action) {
                            queue.head.gave_back(p);
                        }
                    }
                    Err(e) => {
                        queue.head.gave_back(position);
                        tracing::warn!(table = queue.name(), id, error = %e, "putting back a row that does not decode failed")
                    }
                }
                None
            }
        }
    }
}

impl<B: Backend, T> Delivery<B, T> {
    /// The row id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The attempt as it stood before this delivery's claim: the first delivery reads 1.
    pub fn attempt(&self) -> i64 {
        self.attempt
    }

    /// The advisory key, in advisory mode.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// How many times the row was snoozed before this delivery, where the table has a snooze
    /// counter column ([`TableBuilder::snoozes`](crate::TableBuilder::snoozes)).
    pub fn snoozes(&self) -> Option<i64> {
        self.snoozes
    }

    /// The row as the queue's row type.
    pub fn payload(&self) -> &T {
        self.row
            .as_ref()
            .expect("a delivery settled by hand keeps its row")
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        self.queue.name()
    }

    /// The claim mode holding this row.
    pub fn mode(&self) -> ClaimMode {
        self.queue.table.mode()
    }

    /// The delivery's transaction, in row lock mode: writes made through it commit with the ack
    /// (and roll back with a retry or dead letter, while the row stays locked). `None` in the
    /// other modes.
    ///
    /// The first call marks where the handler's writes begin (a savepoint, one statement); a
    /// delivery that never asks for the transaction costs none.
    ///
    /// # Errors
    /// The statement that sets the mark failed (e.g. the connection was lost); the delivery
    /// then still holds its row, and settling or dropping it behaves as documented.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled first call may leave the connection mid-statement; settle
    /// or drop the delivery afterwards (its transaction then rolls back).
    pub async fn transaction(&mut self) -> Result<Option<&mut RowTransaction<B::Db>>> {
        match &mut self.hold {
            Some(Hold::RowLock(h)) => Ok(Some(h.transaction().await?)),
            _ => Ok(None),
        }
    }

    /// The lease expiry this delivery holds (unix milliseconds), in lease mode.
    pub fn lease_expires_ms(&self) -> Option<i64> {
        match &self.hold {
            Some(Hold::Lease(h)) => Some(h.cell().token().expires_ms),
            _ => None,
        }
    }

    /// Renews the lease for another lease length from now (lease mode; the other modes hold
    /// their rows without an expiry, so this does nothing there). Subscriptions renew on their
    /// own every half lease.
    ///
    /// # Cancel safety
    /// Cancel safe in the sense that a cancelled renewal leaves either the old or the new expiry
    /// in the row; the delivery keeps the old token, so a settlement after a cancelled renewal
    /// that did land returns [`SqlxBrokerError::LeaseLost`]. Prefer letting it finish.
    pub async fn renew(&mut self) -> Result<()> {
        match &self.hold {
            Some(Hold::Lease(h)) => h.renewer().renew().await,
            _ => Ok(()),
        }
    }

    /// The row's due time (unix ms) as the claim read it, where the table has one.
    pub(crate) fn due_ms(&self) -> Option<i64> {
        self.position.due_ms
    }

    /// How many settlements of this row failed in a row before this delivery (the engine backs
    /// off that much before running it).
    pub(crate) fn settle_failures(&self) -> u32 {
        self.settle_failures
    }

    /// What the engine's renewal loop needs, in lease mode.
    pub(crate) fn renewer(&self) -> Option<Renewer<B>> {
        match &self.hold {
            Some(Hold::Lease(h)) => Some(h.renewer()),
            _ => None,
        }
    }

    /// Moves the row into the [`Job`] a handler owns.
    pub(crate) fn take_job(&mut self) -> Job<T> {
        Job {
            id: self.id,
            attempt: self.attempt,
            key: self.key.clone(),
            payload: self
                .row
                .take()
                .expect("a delivery hands its row to one handler"),
            table: self.queue.table.clone(),
            lease_expires_ms: self.lease_expires_ms(),
            cancel: CancelSignal::new(),
            snoozes: self.snoozes,
        }
    }

    /// Applies a subscription's cap on snoozes to this delivery (see
    /// [`SubscribeOptions::max_snoozes`](crate::SubscribeOptions::max_snoozes)).
    pub(crate) fn cap_snoozes(&mut self, max: Option<u32>) {
        self.max_snoozes = max;
    }

    /// Sets the deliveries after which this row, failing, is dead-lettered (a job kind's
    /// [`max_attempts`](crate::KindDefaults::max_attempts), in place of the table's).
    pub(crate) fn set_max_attempts(&mut self, max: u32) {
        self.max_attempts = Some(max);
    }

    /// The deliveries after which this row, failing, is dead-lettered.
    pub(crate) fn max_attempts(&self) -> Option<u32> {
        self.max_attempts
    }

    /// The job's own timeout, where its row has one.
    pub(crate) fn timeout(&self) -> Option<std::time::Duration> {
        self.timeout
    }

    /// Lends the row lock transaction to the handler; `None` in the other modes.
    pub(crate) fn lend_transaction(&mut self) -> Option<JobTransaction<B>> {
        match self.hold.take() {
            Some(Hold::RowLock(h)) => {
                self.lent = true;
                Some(JobTransaction {
                    slot: Arc::new(tokio::sync::Mutex::new(Some(h))),
                    table: self.queue.table.clone(),
                })
            }
            other => {
                self.hold = other;
                None
            }
        }
    }

    /// Closes the connection of the transaction this delivery holds when it drops, instead of
    /// giving it back to the pool (row lock mode; nothing otherwise): a handler dropped while it
    /// held the transaction may have left a statement half sent or half read, and the next
    /// user of the connection must not read its reply. The server then rolls the transaction
    /// back.
    pub(crate) fn close_transaction_on_drop(&mut self) {
        if let Some(Hold::RowLock(h)) = &mut self.hold {
            h.tx_mut().close_on_drop();
        }
    }

    /// Takes a lent transaction back. A handler that still holds it (in a task it spawned)
    /// keeps it; the delivery then cannot settle, and the transaction rolls back when the
    /// last handle drops.
    pub(crate) fn take_back(&mut self, lent: JobTransaction<B>) {
        let taken = match lent.slot.try_lock() {
            Ok(mut guard) => guard.take(),
            Err(_) => None,
        };
        if let Some(h) = taken {
            self.hold = Some(Hold::RowLock(h));
            self.lent = false;
        }
    }

    /// Acks: deletes the row, or sets `processed_at`.
    pub async fn ack(self) -> Result<()> {
        self.settle(Outcome::Ack).await
    }

    /// Puts the row back, due at once (or dead-letters it when its attempts are spent).
    pub async fn retry(self) -> Result<()> {
        self.settle(Outcome::Retry).await
    }

    /// Puts the row back, due after `delay` (or dead-letters it when its attempts are spent).
    pub async fn retry_after(self, delay: Duration) -> Result<()> {
        self.settle(Outcome::RetryAfter(delay)).await
    }

    /// Puts the row back, due after `delay`, without spending an attempt (see
    /// [`Outcome::Snooze`]). A delivery claimed by hand has no cap on snoozes.
    pub async fn snooze(self, delay: Duration) -> Result<()> {
        self.settle(Outcome::Snooze(delay)).await
    }

    /// Dead-letters the row.
    pub async fn dead_letter(self) -> Result<()> {
        self.settle(Outcome::DeadLetter).await
    }

    /// Settles the delivery with `outcome`.
    ///
    /// On error the row is released as if the delivery were dropped (see [`Delivery`]); nothing
    /// is lost. A lease that ran out gives [`SqlxBrokerError::LeaseLost`] and changes nothing; a
    /// broker that has shut down gives [`SqlxBrokerError::Closed`].
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled settlement may or may not have landed, and its connection is
    /// dropped mid-statement. The engine never cancels it.
    pub async fn settle(self, outcome: Outcome) -> Result<()> {
        let queue = self.queue.clone();
        let table = &queue.table;
        // Every refusal below returns with the hold still in `self` (or lent and kept by the
        // handler): the delivery's drop releases the row and counts it in `released`.
        if self.hold.is_none() {
            return Err(SqlxBrokerError::Unsupported {
                table: table.name().to_owned(),
                message: format!(
                    "row {} cannot be settled: its handler kept the delivery's transaction beyond its return (the transaction rolls back when that handle drops); use the transaction only inside the handler",
                    self.id
                ),
            });
        }
        if queue.broker.closed.load(Ordering::SeqCst) {
            return Err(SqlxBrokerError::Closed {
                table: table.name().to_owned(),
                what: format!("the settlement of row {}", self.id),
            });
        }
        let now_ms = clock::now_ms();
        // Why a snooze became a dead letter: the row reached the subscription's cap.
        let mut over_cap = None;
        let action = match outcome {
            Outcome::Ack => Action::Ack,
            Outcome::DeadLetter => Action::DeadLetter,
            Outcome::Retry => attempts::retry_or_dead(self.max_attempts, self.attempt, None),
            Outcome::RetryAfter(delay) if delay.is_zero() => {
                attempts::retry_or_dead(self.max_attempts, self.attempt, None)
            }
            Outcome::RetryAfter(delay) => {
                if table.due_at().is_none() {
                    return Err(SqlxBrokerError::Unsupported {
                        table: table.name().to_owned(),
                        message: format!(
                            "row {} asks for a delayed retry, but the table has no due-time column; add .due_at(\"..\") or retry without a delay",
                            self.id
                        ),
                    });
                }
                attempts::retry_or_dead(
                    self.max_attempts,
                    self.attempt,
                    Some(clock::due_ms(now_ms, delay)),
                )
            }
            Outcome::Snooze(delay) => {
                if table.due_at().is_none() {
                    return Err(SqlxBrokerError::Unsupported {
                        table: table.name().to_owned(),
                        message: format!(
                            "row {} asks to be snoozed, but the table has no due-time column; add .due_at(\"..\") or retry instead",
                            self.id
                        ),
                    });
                }
                match (self.max_snoozes, self.snoozes) {
                    (Some(max), Some(done)) if done >= i64::from(max) => {
                        over_cap = Some(format!("snoozed {done} times (max_snoozes {max})"));
                        Action::DeadLetter
                    }
                    _ => Action::Snooze {
                        due_ms: clock::due_ms(now_ms, delay),
                    },
                }
            }
        };
        if action == Action::DeadLetter && table.dead_letter().is_none() {
            return Err(SqlxBrokerError::Unsupported {
                table: table.name().to_owned(),
                message: format!(
                    "row {} is to be dead-lettered, but the table has no dead-letter target; add .dead_letter(..)",
                    self.id
                ),
            });
        }
        self.settle_action(action, over_cap).await
    }

    /// Deletes the row for an operator's cancel ([`Action::Cancel`]), fenced as any
    /// settlement of this delivery is; counted in `cancelled`.
    pub(crate) async fn settle_cancelled(self) -> Result<()> {
        let queue = self.queue.clone();
        if self.hold.is_none() || queue.broker.closed.load(Ordering::SeqCst) {
            // As `settle` refuses these: the drop gives the row back (the request stays).
            return Err(SqlxBrokerError::Closed {
                table: queue.table.name().to_owned(),
                what: format!("the cancel of row {}", self.id),
            });
        }
        self.settle_action(Action::Cancel, None).await
    }

    /// Runs the settlement `action`; `over_cap` tells why a snooze became a dead letter.
    async fn settle_action(mut self, action: Action, over_cap: Option<String>) -> Result<()> {
        let queue = self.queue.clone();
        let table = &queue.table;
        let now_ms = clock::now_ms();
        let hold = self.hold.take().expect("checked by the caller");
        let settle = Settle {
            id: self.id,
            action,
            now_ms,
            attempt: attempts::held(table.mode(), self.attempt),
        };
        // A failure is counted by the hold (before it gives the row back).
        if let Err(e) = hold.settle(settle, &queue).await {
            queue.head.gave_back(self.position);
            return Err(e);
        }
        queue.settle_failures.clear(self.id);
        if let Some(p) = given_back(table, self.id, action) {
            queue.head.gave_back(p);
        }
        queue.metrics.add(
            match action {
                Action::Ack => Counter::Acked,
                Action::Retry { .. } => Counter::Retried,
                Action::DeadLetter => Counter::DeadLettered,
                Action::Snooze { .. } => Counter::Snoozed,
                Action::Cancel => Counter::Cancelled,
            },
            1,
        );
        if let Some(reason) = over_cap {
            tracing::warn!(
                table = table.name(),
                id = self.id,
                reason,
                "snoozed too often; dead-lettered"
            );
            if table.last_error().is_some() {
                // After the settlement, in a statement of its own, as a handler's error is.
                let recorded = queue
                    .broker
                    .backend
                    .admin()
                    .record_error(table, self.id, &reason, true)
                    .await;
                if let Err(e) = recorded {
                    tracing::warn!(table = table.name(), id = self.id, error = %e, "writing the snooze cap into the row failed");
                }
            }
        }
        tracing::debug!(
            table = table.name(),
            id = self.id,
            attempt = self.attempt,
            ?action,
            "settled"
        );
        crate::events::emit(|| crate::events::EngineEvent::Settled {
            table: table.name(),
            id: self.id,
            attempt: self.attempt,
            at: std::time::SystemTime::now(),
        });
        Ok(())
    }
}
