//! Deliveries and their settlement.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{Database, FromRow, Transaction};

use crate::broker::{QueueInner, SETTLE_FAILURE_LIMIT};
use crate::clock;
use crate::error::{Result, SqlxBrokerError};
use crate::metrics::Metrics;
use crate::strategy::{
    Action, AdvisoryStrategy, Backend, ClaimedRow, LeaseStrategy, LeaseToken, Prepared,
    RowLockStrategy, Settle,
};
use crate::table::ClaimMode;

/// What a handler decided about its delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Done: delete the row, or set `processed_at`.
    Ack,
    /// Put the row back, due at once. Dead-letters instead when the attempts are spent.
    Retry,
    /// Put the row back, due after the delay (the table needs a due-time column). Dead-letters
    /// instead when the attempts are spent. The due time is at most 9999-12-31
    /// ([`clock::MAX_DUE_MS`](crate::clock::MAX_DUE_MS)), so `Duration::MAX` parks the row.
    RetryAfter(Duration),
    /// Dead-letter the row now.
    DeadLetter,
}

/// What holds a delivery's row.
pub(crate) enum Hold<B: Backend> {
    /// Row lock: the claim's open transaction, and whether the handler's writes began in it
    /// (see [`RowLockStrategy::begin_writes`]).
    Tx(Transaction<'static, B::Db>, bool),
    /// Lease: the token, which renewal moves forward.
    Lease(Arc<LeaseCell>),
    /// Advisory: the key lock.
    Key(KeyHold<B>),
}

/// A lease token that renewal can move while the handler runs.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    token: Mutex<LeaseToken>,
    lost: AtomicBool,
}

impl LeaseCell {
    pub(crate) fn new(token: LeaseToken) -> Self {
        Self {
            token: Mutex::new(token),
            lost: AtomicBool::new(false),
        }
    }
    pub(crate) fn token(&self) -> LeaseToken {
        *self.token.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub(crate) fn set(&self, token: LeaseToken) {
        *self.token.lock().unwrap_or_else(|p| p.into_inner()) = token;
    }
    /// The settlement that gives the row back, due at once, while it still holds this lease.
    pub(crate) fn release(&self, id: i64) -> Settle {
        Settle {
            id,
            action: Action::Retry { due_ms: None },
            now_ms: clock::now_ms(),
            attempt: self.token().attempt,
        }
    }

    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// A held advisory key; unlocks (in a clean-up task) when dropped unsettled.
pub(crate) struct KeyHold<B: Backend> {
    queue: Arc<QueueInner<B>>,
    key: String,
    lock: Option<<B::Advisory as AdvisoryStrategy>::KeyLock>,
}

impl<B: Backend> KeyHold<B> {
    pub(crate) fn new(
        queue: Arc<QueueInner<B>>,
        key: String,
        lock: <B::Advisory as AdvisoryStrategy>::KeyLock,
    ) -> Self {
        Self {
            queue,
            key,
            lock: Some(lock),
        }
    }

    pub(crate) fn lock_mut(&mut self) -> &mut <B::Advisory as AdvisoryStrategy>::KeyLock {
        self.lock
            .as_mut()
            .expect("a key hold keeps its lock until unlocked")
    }

    pub(crate) async fn unlock(mut self) -> Result<()> {
        let lock = self
            .lock
            .take()
            .expect("a key hold keeps its lock until unlocked");
        let result = match &self.queue.prepared {
            Prepared::Advisory(s) => s.unlock(lock).await,
            _ => unreachable!("a key hold comes from an advisory queue"),
        };
        self.queue.broker.forget_key(&self.key);
        result
    }
}

impl<B: Backend> Drop for KeyHold<B> {
    fn drop(&mut self) {
        let Some(lock) = self.lock.take() else { return };
        let queue = self.queue.clone();
        let key = std::mem::take(&mut self.key);
        let broker = queue.broker.clone();
        // Unlocking needs a statement; run it in a tracked clean-up task. Without a runtime the
        // lock's own drop frees the key (its connection closes).
        broker.spawn_cleanup(async move {
            if let Prepared::Advisory(s) = &queue.prepared
                && let Err(e) = s.unlock(lock).await
            {
                tracing::warn!(table = queue.name(), key, error = %e, "unlock of a dropped delivery failed");
            }
            queue.broker.forget_key(&key);
        });
    }
}

/// One claimed row in work: its columns, its attempt, and what holds it.
///
/// Settle it with [`ack`](Self::ack), [`retry`](Self::retry),
/// [`retry_after`](Self::retry_after), [`dead_letter`](Self::dead_letter) or
/// [`settle`](Self::settle); each consumes the delivery, so it cannot be settled twice.
///
/// # Dropped without settlement
/// - row lock: the transaction rolls back (with any writes made through it); the row is due again
///   at once and the attempt is not counted.
/// - lease: the lease is released in a clean-up task (the row is due again at once); the attempt
///   counted at the claim stays counted. Without a runtime the lease simply runs out.
/// - advisory lock: the key is unlocked in a clean-up task; the attempt counted at the take
///   stays counted.
pub struct Delivery<B: Backend, T> {
    queue: Arc<QueueInner<B>>,
    id: i64,
    attempt: i64,
    key: Option<String>,
    row: T,
    hold: Option<Hold<B>>,
    /// Settlements of this row that failed in a row before this delivery.
    settle_failures: u32,
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

impl<B: Backend, T> Delivery<B, T>
where
    T: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    /// Builds a delivery from a claimed row, or settles the row at once when its attempts are
    /// spent (dead letter) or it does not decode (retry, attempt counted).
    pub(crate) async fn from_claim(
        queue: Arc<QueueInner<B>>,
        claimed: ClaimedRow<B::Db>,
        hold: Hold<B>,
    ) -> Option<Self> {
        let id = claimed.id;
        let attempt = claimed.attempt;
        let now_ms = clock::now_ms();
        let spent = queue
            .table
            .max_attempts()
            .is_some_and(|max| attempt > i64::from(max));
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
            Some(T::from_row(&claimed.row))
        };
        match decoded {
            Some(Ok(row)) => Some(Self {
                queue,
                id,
                attempt,
                key: claimed.key,
                row,
                hold: Some(hold),
                settle_failures: failures,
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
                    attempt: queue.held_attempt(attempt),
                };
                match queue.settle_hold(hold, settle).await {
                    Ok(()) => {
                        queue.settle_failures.clear(id);
                        Metrics::add(&queue.metrics.dead_lettered, 1);
                    }
                    Err(e) => {
                        queue.settle_failed(id, &e);
                        tracing::warn!(table = queue.name(), id, error = %e, "dead-lettering the row failed; it was released")
                    }
                }
                None
            }
            Some(Err(source)) => {
                Metrics::add(&queue.metrics.decode_errors, 1);
                let error = SqlxBrokerError::Decode {
                    table: queue.name().to_owned(),
                    id,
                    source,
                };
                tracing::error!(table = queue.name(), id, attempt, error = %error, "claimed row does not decode");
                let action = queue.retry_or_dead(attempt, None);
                let settle = Settle {
                    id,
                    action,
                    now_ms,
                    attempt: queue.held_attempt(attempt),
                };
                match queue.settle_hold(hold, settle).await {
                    Ok(()) if action == Action::DeadLetter => {
                        Metrics::add(&queue.metrics.dead_lettered, 1);
                    }
                    Ok(()) => Metrics::add(&queue.metrics.retried, 1),
                    Err(e) => {
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

    /// The row as the handler's type.
    pub fn payload(&self) -> &T {
        &self.row
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
    /// handler that never asks for the transaction costs none.
    ///
    /// # Errors
    /// The statement that sets the mark failed (e.g. the connection was lost); the delivery
    /// then still holds its row, and settling or dropping it behaves as documented.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled first call may leave the connection mid-statement; settle
    /// or drop the delivery afterwards (its transaction then rolls back).
    pub async fn transaction(&mut self) -> Result<Option<&mut Transaction<'static, B::Db>>> {
        let Some(Hold::Tx(tx, writes_began)) = &mut self.hold else {
            return Ok(None);
        };
        if !*writes_began {
            let Prepared::RowLock(s) = &self.queue.prepared else {
                unreachable!("a transaction hold comes from a row lock queue")
            };
            s.begin_writes(tx).await?;
            *writes_began = true;
        }
        Ok(Some(tx))
    }

    /// The lease expiry this delivery holds (unix milliseconds), in lease mode.
    pub fn lease_expires_ms(&self) -> Option<i64> {
        match &self.hold {
            Some(Hold::Lease(cell)) => Some(cell.token().expires_ms),
            _ => None,
        }
    }

    /// How many settlements of this row failed in a row before this delivery (the engine backs
    /// off that much before running it).
    pub(crate) fn settle_failures(&self) -> u32 {
        self.settle_failures
    }

    pub(crate) fn lease_cell(&self) -> Option<Arc<LeaseCell>> {
        match &self.hold {
            Some(Hold::Lease(cell)) => Some(cell.clone()),
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
        let Some(Hold::Lease(cell)) = &self.hold else {
            return Ok(());
        };
        renew_lease(&self.queue, self.id, cell).await
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
    pub async fn settle(mut self, outcome: Outcome) -> Result<()> {
        let queue = self.queue.clone();
        let table = &queue.table;
        let hold = self
            .hold
            .take()
            .expect("an unsettled delivery has its hold");
        if queue.broker.closed.load(Ordering::SeqCst) {
            drop(hold);
            return Err(SqlxBrokerError::Closed {
                table: table.name().to_owned(),
                what: format!("the settlement of row {}", self.id),
            });
        }
        let now_ms = clock::now_ms();
        let action = match outcome {
            Outcome::Ack => Action::Ack,
            Outcome::DeadLetter => Action::DeadLetter,
            Outcome::Retry => queue.retry_or_dead(self.attempt, None),
            Outcome::RetryAfter(delay) if delay.is_zero() => {
                queue.retry_or_dead(self.attempt, None)
            }
            Outcome::RetryAfter(delay) => {
                if table.due_at().is_none() {
                    drop(hold);
                    return Err(SqlxBrokerError::Unsupported {
                        table: table.name().to_owned(),
                        message: format!(
                            "row {} asks for a delayed retry, but the table has no due-time column; add .due_at(\"..\") or retry without a delay",
                            self.id
                        ),
                    });
                }
                queue.retry_or_dead(self.attempt, Some(clock::due_ms(now_ms, delay)))
            }
        };
        if action == Action::DeadLetter && table.dead_letter().is_none() {
            drop(hold);
            return Err(SqlxBrokerError::Unsupported {
                table: table.name().to_owned(),
                message: format!(
                    "row {} is to be dead-lettered, but the table has no dead-letter target; add .dead_letter(..)",
                    self.id
                ),
            });
        }
        let settle = Settle {
            id: self.id,
            action,
            now_ms,
            attempt: queue.held_attempt(self.attempt),
        };
        if let Err(e) = queue.settle_hold(hold, settle).await {
            queue.settle_failed(self.id, &e);
            return Err(e);
        }
        queue.settle_failures.clear(self.id);
        let m = &queue.metrics;
        Metrics::add(
            match action {
                Action::Ack => &m.acked,
                Action::Retry { .. } => &m.retried,
                Action::DeadLetter => &m.dead_lettered,
            },
            1,
        );
        tracing::debug!(
            table = table.name(),
            id = self.id,
            attempt = self.attempt,
            ?action,
            "settled"
        );
        Ok(())
    }
}

/// Moves a lease forward from the token the cell holds; marks the cell lost when the row no longer
/// holds it.
pub(crate) async fn renew_lease<B: Backend>(
    queue: &QueueInner<B>,
    id: i64,
    cell: &LeaseCell,
) -> Result<()> {
    let Prepared::Lease(s) = &queue.prepared else {
        return Ok(());
    };
    if cell.is_lost() {
        return Err(SqlxBrokerError::LeaseLost {
            table: queue.name().to_owned(),
            id,
        });
    }
    let token = cell.token();
    let expires_ms = clock::lease_expiry_ms(clock::now_ms(), queue.table.lease_seconds());
    if expires_ms == token.expires_ms {
        return Ok(());
    }
    if s.renew(id, token, expires_ms).await? {
        cell.set(LeaseToken {
            expires_ms,
            attempt: token.attempt,
        });
        Ok(())
    } else {
        cell.mark_lost();
        Err(queue.lost(id).await)
    }
}

impl<B: Backend, T> Drop for Delivery<B, T> {
    fn drop(&mut self) {
        let Some(hold) = self.hold.take() else { return };
        match hold {
            // The transaction rolls back as it drops.
            Hold::Tx(tx, _) => drop(tx),
            // The key unlocks through KeyHold's drop.
            Hold::Key(k) => drop(k),
            Hold::Lease(cell) => {
                let queue = self.queue.clone();
                let id = self.id;
                let broker = queue.broker.clone();
                broker.spawn_cleanup(async move {
                    if let Prepared::Lease(s) = &queue.prepared
                        && let Err(e) = s.settle(cell.token(), cell.release(id)).await
                    {
                        tracing::warn!(table = queue.name(), id, error = %e, "release of a dropped lease failed; it runs out instead");
                    }
                });
            }
        }
    }
}
