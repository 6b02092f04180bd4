//! What a broker and its queues share, below the claim modes: the broker's shutdown, wakers,
//! held keys and clean-ups, and a queue's table, counters and failure bookkeeping. The mode
//! modules, deliveries and the engine build on it; it imports none of them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::claim_mode::ClaimMode;
use crate::driver::{Action, Backend, Candidate, ErrorClass, Gate};
use crate::error::SqlxBrokerError;
use crate::head::Head;
use crate::metrics::{Counter, Metrics};
use crate::table::TableDescription;

#[derive(Debug)]
pub(crate) struct BrokerInner<B: Backend> {
    pub(crate) backend: B,
    /// Whether the broker opened its pool (and so closes it at `close`).
    pub(crate) owns_pool: bool,
    pub(crate) closed: AtomicBool,
    pub(crate) shutdown: tokio::sync::watch::Sender<bool>,
    /// Subscription engines of this broker still running: `close` waits until none is, so the
    /// handlers in work settle before settlements are refused.
    pub(crate) engines: tokio::sync::watch::Sender<usize>,
    wakers: Mutex<HashMap<String, Vec<Weak<Notify>>>>,
    /// Keys this broker holds now, so a claim skips them before spending a connection.
    pub(crate) held_keys: Mutex<HashSet<String>>,
    /// Clean-up tasks of deliveries dropped without settlement (lease release, key unlock);
    /// shutdown waits for them.
    pub(crate) cleanups: Mutex<JoinSet<()>>,
    /// Counts the pauses and resumes made through this broker, so its subscriptions read the
    /// pause state again at once instead of at their next poll.
    pub(crate) pause_epoch: std::sync::atomic::AtomicU64,
    /// Each table's gate (see [`Gate`]), shared by the broker's subscriptions of the table.
    gates: Mutex<HashMap<String, Arc<Gate>>>,
}

/// A running subscription engine, counted in [`BrokerInner::engines`] until dropped.
pub(crate) struct EngineRunning<B: Backend> {
    broker: Arc<BrokerInner<B>>,
}

impl<B: Backend> Drop for EngineRunning<B> {
    fn drop(&mut self) {
        self.broker.engines.send_modify(|n| *n -= 1);
    }
}

impl<B: Backend> BrokerInner<B> {
    pub(crate) fn new(backend: B, owns_pool: bool) -> Self {
        Self {
            backend,
            owns_pool,
            closed: AtomicBool::new(false),
            shutdown: tokio::sync::watch::Sender::new(false),
            engines: tokio::sync::watch::Sender::new(0),
            wakers: Mutex::new(HashMap::new()),
            held_keys: Mutex::new(HashSet::new()),
            cleanups: Mutex::new(JoinSet::new()),
            pause_epoch: std::sync::atomic::AtomicU64::new(0),
            gates: Mutex::new(HashMap::new()),
        }
    }

    /// Counts a subscription engine as running until the returned guard drops (when its task
    /// ends, panicking or not).
    pub(crate) fn engine_started(self: &Arc<Self>) -> EngineRunning<B> {
        self.engines.send_modify(|n| *n += 1);
        EngineRunning {
            broker: self.clone(),
        }
    }

    /// The gate of `table`'s handlers in this broker.
    pub(crate) fn gate(&self, table: &str) -> Arc<Gate> {
        self.gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(table.to_owned())
            .or_default()
            .clone()
    }

    /// A queue of this broker was paused (`true`) or resumed: its gate shuts or opens now (a
    /// pause returns once no handler of the table can start in this broker), and its
    /// subscriptions read the state again and look.
    pub(crate) async fn pause_changed(&self, table: &str, paused: bool) {
        let gate = self.gate(table);
        if paused {
            gate.shut().await;
        } else {
            gate.set(false);
        }
        self.pause_epoch.fetch_add(1, Ordering::SeqCst);
        self.wake(table);
    }

    pub(crate) fn register_waker(&self, table: &str, wake: &Arc<Notify>) {
        let mut wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        let list = wakers.entry(table.to_owned()).or_default();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(wake));
    }

    pub(crate) fn wake(&self, table: &str) {
        let wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = wakers.get(table) {
            for w in list.iter().filter_map(Weak::upgrade) {
                w.notify_one();
            }
        }
    }

    pub(crate) fn spawn_cleanup(&self, task: impl Future<Output = ()> + Send + 'static) {
        if tokio::runtime::Handle::try_current().is_ok() {
            self.cleanups
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .spawn(task);
        }
    }

    pub(crate) async fn drain_cleanups(&self) {
        loop {
            let mut set =
                std::mem::take(&mut *self.cleanups.lock().unwrap_or_else(|p| p.into_inner()));
            if set.is_empty() {
                return;
            }
            while set.join_next().await.is_some() {}
        }
    }

    pub(crate) fn key_is_held(&self, key: &str) -> bool {
        self.held_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(key)
    }

    pub(crate) fn hold_key(&self, key: &str) -> bool {
        self.held_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_owned())
    }

    pub(crate) fn forget_key(&self, key: &str) {
        self.held_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

/// One prepared table's state that every claim mode, delivery and subscription on it reads.
pub(crate) struct Shared<B: Backend> {
    pub(crate) broker: Arc<BrokerInner<B>>,
    pub(crate) table: Arc<TableDescription>,
    pub(crate) metrics: Metrics,
    /// Advisory mode: candidates a recent read returned that no claim has tried yet.
    pub(crate) candidates: CandidateCache,
    /// Advisory mode: the key columns of the last key a key walk visited, where the next walk
    /// starts after (`None`: from the first key).
    pub(crate) key_cursor: Mutex<Option<Vec<String>>>,
    /// Rows whose settlement failed, so their next delivery backs off or dead-letters them.
    pub(crate) settle_failures: SettleFailures,
    /// Where claims start reading (see [`Head`]).
    pub(crate) head: Head,
    /// What the backend warned about when it prepared the table (a missing claim index).
    pub(crate) warnings: Vec<String>,
    /// Claimed rows that did not decode into the row type.
    pub(crate) decode: Arc<Mutex<crate::warnings::DecodeHealth>>,
}

impl<B: Backend> Shared<B> {
    pub(crate) fn new(
        broker: Arc<BrokerInner<B>>,
        table: Arc<TableDescription>,
        warnings: Vec<String>,
    ) -> Self {
        Self {
            warnings,
            decode: Arc::default(),
            broker,
            head: Head::new(&table),
            metrics: Metrics::new(table.name()),
            table,
            candidates: CandidateCache::default(),
            key_cursor: Mutex::new(None),
            settle_failures: SettleFailures::default(),
        }
    }

    pub(crate) fn name(&self) -> &str {
        self.table.name()
    }

    /// Counts a failed settlement of row `id` in exactly one counter: a lost hold in
    /// `lease_lost`, a deleted row in `gone`, anything else in `settle_failed`; statement
    /// failures that will fail again (see [`fails_again`]) also count against the row.
    pub(crate) fn settle_failed(&self, id: i64, error: &SqlxBrokerError) {
        let m = &self.metrics;
        match error {
            SqlxBrokerError::LeaseLost { .. } | SqlxBrokerError::ClaimLost { .. } => {
                return m.add(Counter::LeaseLost, 1);
            }
            SqlxBrokerError::RowGone { .. } => return m.add(Counter::Gone, 1),
            _ => m.add(Counter::SettleFailed, 1),
        }
        if !matches!(error, SqlxBrokerError::Statement { .. }) {
            return;
        }
        if fails_again(&self.broker.backend, error) {
            let n = self.settle_failures.record(id, error);
            tracing::warn!(table = self.name(), id, failures = n, error = %error, "settlement failed; the row was released and its next delivery backs off");
        }
    }

    /// Whether row `id` is no longer in the table (nor among its dead letters): deleted by
    /// something other than the broker. A failed look counts as not gone.
    pub(crate) async fn is_gone(&self, id: i64) -> bool {
        matches!(
            self.broker.backend.row_state(&self.table, id).await,
            Ok(None)
        )
    }

    pub(crate) fn gone(&self, id: i64) -> SqlxBrokerError {
        self.settle_failures.clear(id);
        SqlxBrokerError::RowGone {
            table: self.name().to_owned(),
            id,
        }
    }

    /// The error for a lease token the row no longer holds: the row is gone, or the lease ran
    /// out and another claim holds it.
    pub(crate) async fn lost(&self, id: i64) -> SqlxBrokerError {
        if self.is_gone(id).await {
            return self.gone(id);
        }
        SqlxBrokerError::LeaseLost {
            table: self.name().to_owned(),
            id,
        }
    }
}

/// The attempt arithmetic of every mode, in one place. A delivery reports the attempt as it
/// stood before its claim (the first reads 1); the column it holds differs by mode.
pub(crate) mod attempts {
    use super::*;

    /// The attempt column's value a delivery holds, from the attempt it reports: row lock
    /// counts at settlement, the other modes counted it at the claim.
    pub(crate) fn held(mode: ClaimMode, reported: i64) -> i64 {
        match mode {
            ClaimMode::RowLock => reported,
            ClaimMode::Lease | ClaimMode::Advisory => reported + 1,
        }
    }

    /// Whether a claimed row's attempts were spent before this claim (crashes used them), from
    /// the attempt it reports.
    pub(crate) fn spent(table: &TableDescription, reported: i64) -> bool {
        table
            .max_attempts()
            .is_some_and(|max| reported > i64::from(max))
    }

    /// The action for a failed delivery: a retry, or a dead letter when its attempts are spent
    /// (`max`: the table's max attempts, or the delivery's kind's).
    pub(crate) fn retry_or_dead(max: Option<u32>, reported: i64, due_ms: Option<i64>) -> Action {
        match max {
            Some(max) if reported >= i64::from(max) => Action::DeadLetter,
            _ => Action::Retry { due_ms },
        }
    }
}

/// How many settlements of a row may fail in a row (for a reason that will not go away) before
/// the row is dead-lettered at its next claim instead of run again; see the crate docs,
/// "Settlements that fail".
pub const SETTLE_FAILURE_LIMIT: u32 = 3;

/// Rows of one queue whose last settlements failed, by id: how many in a row, and the last
/// error. Kept in the process: a settlement that fails rolls back (row lock) or leaves the row
/// as it was, so the database cannot count it, and a row lock attempt never moves there.
#[derive(Debug, Default)]
pub(crate) struct SettleFailures {
    /// Entries in `rows`, read without the lock on the hot path (almost always 0).
    len: std::sync::atomic::AtomicUsize,
    rows: Mutex<HashMap<i64, (u32, String)>>,
}

impl SettleFailures {
    /// Counts a failed settlement of row `id`; returns the failures in a row.
    pub(crate) fn record(&self, id: i64, error: &SqlxBrokerError) -> u32 {
        let mut rows = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        let entry = rows.entry(id).or_insert((0, String::new()));
        entry.0 = entry.0.saturating_add(1);
        entry.1 = error.to_string();
        let n = entry.0;
        self.len.store(rows.len(), Ordering::SeqCst);
        n
    }

    /// Forgets row `id` (its settlement worked, or it is gone).
    pub(crate) fn clear(&self, id: i64) {
        if self.len.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut rows = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        rows.remove(&id);
        self.len.store(rows.len(), Ordering::SeqCst);
    }

    /// The failures in a row of row `id`, and the last error.
    pub(crate) fn get(&self, id: i64) -> Option<(u32, String)> {
        if self.len.load(Ordering::SeqCst) == 0 {
            return None;
        }
        self.rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }
}

/// Whether a settlement error says something about the row or its statement (a constraint, a
/// trigger, a value out of range: it will fail again) rather than about the connection or a
/// lock conflict (it will likely work next time), as the backend classifies it. Only the first
/// kind counts toward [`SETTLE_FAILURE_LIMIT`], so killed connections and deadlocks never
/// dead-letter a row.
pub(crate) fn fails_again<B: Backend>(backend: &B, error: &SqlxBrokerError) -> bool {
    error.sqlx_source().is_some_and(|e| {
        matches!(e, sqlx::Error::Database(_)) && backend.classify(e) == ErrorClass::Permanent
    })
}

/// Advisory candidates kept between claims, so a claim for fewer rows than a read returns does
/// not read again for the next. They expire quickly: a newer row of higher priority waits at
/// most that long behind them.
#[derive(Debug, Default)]
pub(crate) struct CandidateCache {
    inner: Mutex<Option<(std::time::Instant, std::collections::VecDeque<Candidate>)>>,
}

impl CandidateCache {
    /// How long candidates are kept.
    const TTL: std::time::Duration = std::time::Duration::from_millis(200);

    pub(crate) fn pop(&self) -> Option<Candidate> {
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (read_at, list) = guard.as_mut()?;
        if read_at.elapsed() > Self::TTL {
            *guard = None;
            return None;
        }
        list.pop_front()
    }

    pub(crate) fn refill(&self, fresh: Vec<Candidate>) {
        *self.inner.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((std::time::Instant::now(), fresh.into()));
    }
}
