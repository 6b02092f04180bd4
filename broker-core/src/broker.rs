//! The broker (one per pool) and its queues (one per prepared table).

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use sqlx::{Database, FromRow};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::clock;
use crate::delivery::{Delivery, Hold, KeyHold, LeaseCell};
use crate::error::{Result, SqlxBrokerError};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::publish::NewJob;
use crate::strategy::{
    Action, AdvisoryStrategy, Backend, Candidate, ClaimedRow, LeaseStrategy, LeaseToken, Prepared,
    RowLockStrategy, RowState, Settle,
};
use crate::subscription::{Handler, SubscribeOptions, Subscription};
use crate::table::{ClaimMode, TableDescription};

/// A broker on one database pool: it prepares queues, and every queue it prepared shares its
/// shutdown.
///
/// Backend crates name it: `SqliteBroker`, `PgBroker`, `MySqlBroker`.
#[derive(Debug)]
pub struct Broker<B: Backend> {
    pub(crate) inner: Arc<BrokerInner<B>>,
}

impl<B: Backend> Clone for Broker<B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct BrokerInner<B: Backend> {
    pub(crate) backend: B,
    pub(crate) closed: AtomicBool,
    pub(crate) shutdown: tokio::sync::watch::Sender<bool>,
    wakers: Mutex<HashMap<String, Vec<Weak<Notify>>>>,
    /// Keys this broker holds now, so a claim skips them before spending a connection.
    pub(crate) held_keys: Mutex<HashSet<String>>,
    /// Clean-up tasks of deliveries dropped without settlement (lease release, key unlock);
    /// shutdown waits for them.
    pub(crate) cleanups: Mutex<JoinSet<()>>,
}

impl<B: Backend> Broker<B> {
    /// A broker on `backend`.
    pub fn new(backend: B) -> Self {
        Self {
            inner: Arc::new(BrokerInner {
                backend,
                closed: AtomicBool::new(false),
                shutdown: tokio::sync::watch::Sender::new(false),
                wakers: Mutex::new(HashMap::new()),
                held_keys: Mutex::new(HashSet::new()),
                cleanups: Mutex::new(JoinSet::new()),
            }),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.inner.backend
    }

    /// The pool.
    pub fn pool(&self) -> &sqlx::Pool<B::Db> {
        self.inner.backend.pool()
    }

    /// Prepares a table: checks the server version, the table and its columns, and prepares
    /// every statement of its mode. Handlers read rows as `T` (use [`Payload`](crate::Payload)
    /// to read just the payload column).
    pub async fn queue<T>(&self, table: TableDescription) -> Result<Queue<B, T>> {
        let table = Arc::new(table);
        let caps = self.inner.backend.capabilities();
        if !caps.offers(table.mode()) {
            return Err(SqlxBrokerError::ModeNotOffered {
                table: table.name().to_owned(),
                mode: table.mode(),
                database: caps.database,
                hint: "add a locked_until column (lease mode) or an advisory_lock template",
            });
        }
        let prepared = self.inner.backend.prepare(&table).await?;
        Ok(Queue {
            inner: Arc::new(QueueInner {
                broker: self.inner.clone(),
                table,
                prepared,
                metrics: Metrics::default(),
                candidates: CandidateCache::default(),
            }),
            _row: PhantomData,
        })
    }

    /// The DDL for a description (see [`Backend::ddl`]).
    pub fn ddl(&self, table: &TableDescription) -> Vec<String> {
        self.inner.backend.ddl(table)
    }

    /// Creates the table of a description (and its index and dead-letter table) if missing.
    pub async fn create_tables(&self, table: &TableDescription) -> Result<()> {
        let ddl = self.inner.backend.ddl(table);
        self.inner.backend.execute_ddl(&ddl).await
    }

    /// Drops the tables [`create_tables`](Self::create_tables) creates.
    pub async fn drop_tables(&self, table: &TableDescription) -> Result<()> {
        let ddl = self.inner.backend.drop_ddl(table);
        self.inner.backend.execute_ddl(&ddl).await
    }

    /// Whether [`close`](Self::close) has run.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }

    /// Shuts the broker down: subscriptions stop (as [`Subscription::shutdown`] does, in the
    /// background), clean-ups of dropped deliveries finish, and the pool closes. Settlements
    /// after this return [`SqlxBrokerError::Closed`].
    pub async fn close(&self) {
        self.inner.shutdown.send_replace(true);
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.drain_cleanups().await;
        self.inner.backend.pool().close().await;
    }

    /// Waits for the clean-ups of deliveries dropped without settlement (lease releases, key
    /// unlocks) that have started so far.
    pub async fn flush_cleanups(&self) {
        self.inner.drain_cleanups().await;
    }
}

impl<B: Backend> BrokerInner<B> {
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

/// A prepared table: publish rows to it, claim them by hand, or subscribe a handler.
///
/// `T` is what a handler reads of a row (`sqlx::FromRow`).
pub struct Queue<B: Backend, T> {
    pub(crate) inner: Arc<QueueInner<B>>,
    _row: PhantomData<fn() -> T>,
}

impl<B: Backend, T> Clone for Queue<B, T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            _row: PhantomData,
        }
    }
}

impl<B: Backend, T> std::fmt::Debug for Queue<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("table", &self.inner.table.name())
            .field("mode", &self.inner.table.mode())
            .finish()
    }
}

pub(crate) struct QueueInner<B: Backend> {
    pub(crate) broker: Arc<BrokerInner<B>>,
    pub(crate) table: Arc<TableDescription>,
    pub(crate) prepared: Prepared<B>,
    pub(crate) metrics: Metrics,
    /// Advisory mode: candidates a recent read returned that no claim has tried yet.
    pub(crate) candidates: CandidateCache,
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

    fn pop(&self) -> Option<Candidate> {
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (read_at, list) = guard.as_mut()?;
        if read_at.elapsed() > Self::TTL {
            *guard = None;
            return None;
        }
        list.pop_front()
    }

    fn refill(&self, fresh: Vec<Candidate>) {
        *self.inner.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((std::time::Instant::now(), fresh.into()));
    }
}

impl<B: Backend, T> Queue<B, T> {
    /// The table description.
    pub fn table(&self) -> &TableDescription {
        &self.inner.table
    }

    /// The claim mode.
    pub fn mode(&self) -> ClaimMode {
        self.inner.table.mode()
    }

    /// The counters of this queue.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.metrics.snapshot()
    }

    /// The row `id` now, or `None` when it is gone.
    pub async fn row_state(&self, id: i64) -> Result<Option<RowState>> {
        self.inner
            .broker
            .backend
            .row_state(&self.inner.table, id)
            .await
    }

    /// Wakes this process's subscriptions of the table, e.g. after committing a transaction
    /// that published through [`publish_in`](Self::publish_in).
    pub fn wake(&self) {
        self.inner.broker.wake(self.inner.table.name());
    }

    /// Publishes one row on a pool connection and wakes this process's subscriptions.
    pub async fn publish<P>(&self, job: NewJob<P>) -> Result<i64>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        let ids = self.publish_batch(std::slice::from_ref(&job)).await?;
        Ok(ids.first().copied().unwrap_or_default())
    }

    /// Publishes rows on a pool connection (one statement per backend batch) and wakes this
    /// process's subscriptions.
    pub async fn publish_batch<P>(&self, jobs: &[NewJob<P>]) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        let table = &self.inner.table;
        let mut conn = self
            .inner
            .broker
            .backend
            .pool()
            .acquire()
            .await
            .map_err(|e| SqlxBrokerError::statement(table.name(), "publish", e))?;
        let ids = self
            .inner
            .broker
            .backend
            .publish(&mut conn, table, jobs)
            .await?;
        self.wake();
        Ok(ids)
    }

    /// Publishes rows inside the caller's transaction (pass `&mut *tx`): they commit with the
    /// caller's data or not at all. This process's subscriptions see them once the transaction
    /// commits; call [`wake`](Self::wake) then for an immediate pick-up (otherwise the next poll,
    /// or a cross-process wake-up where the backend has one, finds them).
    pub async fn publish_in<P>(
        &self,
        conn: &mut <B::Db as Database>::Connection,
        jobs: &[NewJob<P>],
    ) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        self.inner
            .broker
            .backend
            .publish(conn, &self.inner.table, jobs)
            .await
    }
}

impl<B: Backend, T> Queue<B, T>
where
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    /// Claims up to `limit` due rows as deliveries. Each must be settled (or dropped, with the
    /// effect its mode documents on [`Delivery`]). A row whose attempts are already spent (a
    /// crash used the last one) is dead-lettered here instead of handed out; a row that does not
    /// decode into `T` is put back with its attempt counted.
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped claim may have taken rows that then wait for their lease or
    /// rollback. Let it finish.
    pub async fn claim(&self, limit: usize) -> Result<Vec<Delivery<B, T>>> {
        if self.inner.broker.closed.load(Ordering::SeqCst) {
            return Err(SqlxBrokerError::Closed {
                table: self.inner.table.name().to_owned(),
                what: "a claim".into(),
            });
        }
        let claimed = self.inner.claim_rows(limit.max(1)).await?;
        let mut out = Vec::with_capacity(claimed.len());
        for (row, hold) in claimed {
            if let Some(d) = Delivery::from_claim(self.inner.clone(), row, hold).await {
                out.push(d);
            }
        }
        Ok(out)
    }

    /// Runs `handler` on every due row, with `options.concurrency` deliveries in work at once;
    /// see [`Subscription`].
    ///
    /// The handler gets `&mut Delivery` and returns a boxed future of its [`Outcome`](crate::Outcome):
    /// `|job| Box::pin(async move { .. Ok(Outcome::Ack) })`. A runnable example is in the README
    /// and in `broker-sqlite`'s crate docs.
    pub fn subscribe<F>(&self, options: SubscribeOptions, handler: F) -> Subscription
    where
        F: for<'a> Fn(&'a mut Delivery<B, T>) -> crate::BoxFuture<'a, crate::HandlerResult>
            + Send
            + Sync
            + 'static,
    {
        crate::subscription::start(self.clone(), options, Handler::new(handler))
    }
}

impl<B: Backend> QueueInner<B> {
    pub(crate) fn name(&self) -> &str {
        self.table.name()
    }

    /// Claims up to `limit` rows in the table's mode, with the hold of each.
    pub(crate) async fn claim_rows(
        self: &Arc<Self>,
        limit: usize,
    ) -> Result<Vec<(ClaimedRow<B::Db>, Hold<B>)>> {
        let now = clock::now_ms();
        let claimed = match &self.prepared {
            Prepared::RowLock(s) => {
                let mut out = Vec::new();
                while out.len() < limit {
                    match s.claim(now).await? {
                        Some((tx, row)) => out.push((row, Hold::Tx(tx, false))),
                        None => break,
                    }
                }
                out
            }
            Prepared::Lease(s) => {
                let expires_ms = clock::lease_expiry_ms(now, self.table.lease_seconds());
                s.claim(limit, now, expires_ms)
                    .await?
                    .into_iter()
                    .map(|row| {
                        let token = LeaseToken {
                            expires_ms,
                            attempt: row.attempt + 1,
                        };
                        (row, Hold::Lease(Arc::new(LeaseCell::new(token))))
                    })
                    .collect()
            }
            Prepared::Advisory(s) => self.claim_advisory(s, limit, now).await?,
        };
        Metrics::add(&self.metrics.claimed, claimed.len() as u64);
        Ok(claimed)
    }

    async fn claim_advisory(
        self: &Arc<Self>,
        s: &B::Advisory,
        limit: usize,
        now: i64,
    ) -> Result<Vec<(ClaimedRow<B::Db>, Hold<B>)>> {
        let mut out = Vec::new();
        let mut read = false;
        while out.len() < limit {
            // Candidates left over by a recent read come first; the lock and the take check
            // each one again, so a stale one costs a statement, never a wrong claim.
            let c = match self.candidates.pop() {
                Some(c) => c,
                None if read => break,
                None => {
                    read = true;
                    // Ask for more candidates than slots: some keys will be held elsewhere,
                    // and the rest serve the next claims.
                    let fresh = s.candidates(limit.saturating_mul(4).max(16), now).await?;
                    self.candidates.refill(fresh);
                    continue;
                }
            };
            // A key this broker holds already is skipped without spending a connection; the
            // insert also reserves the key against this broker's other claims.
            if self.broker.key_is_held(&c.key) || !self.broker.hold_key(&c.key) {
                continue;
            }
            let mut lock = match s.try_lock(&c.key).await {
                Ok(Some(lock)) => lock,
                Ok(None) => {
                    self.broker.forget_key(&c.key);
                    continue;
                }
                Err(e) => {
                    self.broker.forget_key(&c.key);
                    return finish_advisory_claim(out, Err(e));
                }
            };
            match s.take(&mut lock, c.id, now).await {
                Ok(Some(row)) => {
                    let hold = KeyHold::new(self.clone(), c.key, lock);
                    out.push((row, Hold::Key(hold)));
                }
                Ok(None) => {
                    let _ = s.unlock(lock).await;
                    self.broker.forget_key(&c.key);
                }
                Err(e) => {
                    let _ = s.unlock(lock).await;
                    self.broker.forget_key(&c.key);
                    return finish_advisory_claim(out, Err(e));
                }
            }
        }
        Ok(out)
    }

    /// Settles one row by its hold. Returns what was done.
    pub(crate) async fn settle_hold(&self, hold: Hold<B>, settle: Settle) -> Result<()> {
        match (hold, &self.prepared) {
            (Hold::Tx(tx, writes_began), Prepared::RowLock(s)) => {
                s.settle(tx, settle, writes_began).await
            }
            (Hold::Lease(cell), Prepared::Lease(s)) => {
                if s.settle(cell.token(), settle).await? {
                    Ok(())
                } else {
                    Metrics::add(&self.metrics.lease_lost, 1);
                    Err(SqlxBrokerError::LeaseLost {
                        table: self.name().to_owned(),
                        id: settle.id,
                    })
                }
            }
            (Hold::Key(mut hold), Prepared::Advisory(s)) => {
                let lock = hold.lock_mut();
                s.settle(lock, settle).await?;
                hold.unlock().await
            }
            _ => unreachable!("a hold always comes from the queue's own mode"),
        }
    }

    /// The attempt column's value a delivery holds, from the attempt it reports (as before its
    /// claim): row lock counts at settlement, the other modes counted it at the claim.
    pub(crate) fn held_attempt(&self, reported: i64) -> i64 {
        match self.table.mode() {
            ClaimMode::RowLock => reported,
            ClaimMode::Lease | ClaimMode::Advisory => reported + 1,
        }
    }

    /// The action for a failed delivery: a retry, or a dead letter when its attempts are spent.
    pub(crate) fn retry_or_dead(&self, attempt: i64, due_ms: Option<i64>) -> Action {
        match self.table.max_attempts() {
            Some(max) if attempt >= i64::from(max) => Action::DeadLetter,
            _ => Action::Retry { due_ms },
        }
    }
}

/// An advisory claim that failed part way keeps what it took: those rows are claimed and must be
/// delivered, so the error only surfaces when nothing was taken.
fn finish_advisory_claim<T>(out: Vec<T>, err: Result<()>) -> Result<Vec<T>> {
    match err {
        Err(e) if out.is_empty() => Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "advisory claim stopped early");
            Ok(out)
        }
        Ok(()) => Ok(out),
    }
}
