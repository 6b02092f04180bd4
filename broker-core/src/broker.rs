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
        self.inner.backend.check_names(&table)?;
        let prepared = self.inner.backend.prepare(&table).await?;
        Ok(Queue {
            inner: Arc::new(QueueInner {
                broker: self.inner.clone(),
                table,
                prepared,
                metrics: Metrics::default(),
                candidates: CandidateCache::default(),
                settle_failures: SettleFailures::default(),
            }),
            _row: PhantomData,
        })
    }

    /// Checks the deployment for `table`: every check with pass, warn or fail, what it found,
    /// and what to change. Runs the backend's checks (server version, pooler, settings, clock,
    /// indexes) and these: the database offers the table's mode, the table and every statement
    /// of its mode prepare, and the pool serves `options`' concurrency. Changes nothing.
    ///
    /// ```no_run
    /// # async fn run<B: broker_core::Backend>(broker: broker_core::Broker<B>, table: broker_core::TableDescription) {
    /// use broker_core::{DoctorOptions, Status};
    /// let report = broker.doctor(&table, &DoctorOptions::new().concurrency(8)).await;
    /// print!("{report}");
    /// assert_ne!(report.worst(), Status::Fail);
    /// # }
    /// ```
    pub async fn doctor(
        &self,
        table: &TableDescription,
        options: &crate::DoctorOptions,
    ) -> crate::DoctorReport {
        use crate::doctor::{Check, pool_check};
        let backend = &self.inner.backend;
        let caps = backend.capabilities();
        let mut checks = backend.doctor(table, options).await;
        let mode = table.mode();
        if checks.iter().any(|c| c.status == crate::Status::Fail) {
            // Preparing through a deployment that failed a check (a pooler that breaks named
            // statements, a server too old) proves nothing and may leave statements behind.
            checks.push(Check::warn(
                "table and statements",
                "not checked: fix the failures above first",
                "run the doctor again after the fixes",
            ));
        } else if !caps.offers(mode) {
            checks.push(Check::fail(
                "claim mode",
                format!("{} does not offer {mode} mode", caps.database),
                "add a locked_until column (lease mode) or an advisory_lock template",
            ));
        } else {
            checks.push(match backend.prepare(&Arc::new(table.clone())).await {
                Ok(_) => Check::pass(
                    "table and statements",
                    format!("table \"{}\" has every column {mode} mode needs, and every statement prepares", table.name()),
                ),
                Err(e) => Check::fail("table and statements", e.to_string(), "see the message; the DDL helper (`ddl`) prints what the table needs"),
            });
        }
        let holds =
            matches!(mode, ClaimMode::RowLock | ClaimMode::Advisory) && !caps.process_local_keys;
        checks.push(pool_check(
            self.pool().options().get_max_connections(),
            holds,
            caps.cross_process_wakeups,
            options,
        ));
        crate::DoctorReport { checks }
    }

    /// The DDL for a description (see [`Backend::ddl`]).
    pub fn ddl(&self, table: &TableDescription) -> Vec<String> {
        self.inner.backend.ddl(table)
    }

    /// Creates the table of a description (and its index and dead-letter table) if missing.
    pub async fn create_tables(&self, table: &TableDescription) -> Result<()> {
        self.inner.backend.check_names(table)?;
        let ddl = self.inner.backend.ddl(table);
        self.inner
            .backend
            .execute_ddl(&ddl)
            .await
            .map_err(|e| e.for_table(table.name()))
    }

    /// Drops the tables [`create_tables`](Self::create_tables) creates.
    pub async fn drop_tables(&self, table: &TableDescription) -> Result<()> {
        let ddl = self.inner.backend.drop_ddl(table);
        self.inner
            .backend
            .execute_ddl(&ddl)
            .await
            .map_err(|e| e.for_table(table.name()))
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
    /// Rows whose settlement failed, so their next delivery backs off or dead-letters them.
    pub(crate) settle_failures: SettleFailures,
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
/// lock conflict (it will likely work next time). Only the first kind counts toward
/// [`SETTLE_FAILURE_LIMIT`], so killed connections and deadlocks never dead-letter a row.
pub(crate) fn fails_again(error: &SqlxBrokerError) -> bool {
    let Some(sqlx::Error::Database(db)) = error.sqlx_source() else {
        return false;
    };
    let code = db.code().unwrap_or_default();
    // SQLSTATE classes 08 connection, 40 rollback (deadlock, serialization), 53 resources,
    // 57 operator intervention (a terminated backend); 55P03 lock not available (PostgreSQL);
    // HY000 (MySQL's lock wait timeout, among others) and 70100 (MySQL / MariaDB `KILL`).
    // SQLite reports its result codes: 5 busy and 6 locked, with their extended codes.
    const TRANSIENT_CLASSES: [&str; 4] = ["08", "40", "53", "57"];
    const TRANSIENT_CODES: [&str; 3] = ["55P03", "HY000", "70100"];
    if TRANSIENT_CLASSES
        .iter()
        .any(|c| code.len() == 5 && code.starts_with(c))
        || TRANSIENT_CODES.contains(&code.as_ref())
    {
        return false;
    }
    // SQLSTATEs have five characters; SQLite's result codes are shorter numbers.
    if code.len() < 5
        && let Ok(n) = code.parse::<i64>()
        && matches!(n % 256, 5 | 6)
    {
        return false;
    }
    true
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

    /// Publishes rows on a pool connection and wakes this process's subscriptions. All or
    /// nothing: a batch the backend writes in several statements runs in one transaction, so
    /// a row that fails (a constraint, a value too long) leaves none of the batch behind and a
    /// retry of the whole batch duplicates nothing.
    pub async fn publish_batch<P>(&self, jobs: &[NewJob<P>]) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        let table = &self.inner.table;
        let backend = &self.inner.broker.backend;
        let err = |e| SqlxBrokerError::statement(table.name(), "publish", e);
        let ids = if jobs.len() <= 1 {
            // One statement is atomic on its own; no transaction round trips for it.
            let mut conn = backend.pool().acquire().await.map_err(err)?;
            backend.publish(&mut conn, table, jobs).await?
        } else {
            let mut tx = backend.pool().begin().await.map_err(err)?;
            // On error the transaction rolls back as it drops.
            let ids = backend.publish(&mut tx, table, jobs).await?;
            tx.commit().await.map_err(err)?;
            ids
        };
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
    ///
    /// # Errors
    /// [`SqlxBrokerError::InvalidOption`] for an option value the engine cannot run with (a
    /// concurrency, batch size or claim limit of 0, a poll interval under
    /// [`MIN_POLL_INTERVAL`](crate::MIN_POLL_INTERVAL)), naming the option and what is accepted.
    pub fn subscribe<F>(&self, options: SubscribeOptions, handler: F) -> Result<Subscription>
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

    /// Counts a failed settlement of row `id`: every statement failure in `settle_failed`, and
    /// those that will fail again (see [`fails_again`]) against the row.
    pub(crate) fn settle_failed(&self, id: i64, error: &SqlxBrokerError) {
        if !matches!(error, SqlxBrokerError::Statement { .. }) {
            return;
        }
        Metrics::add(&self.metrics.settle_failed, 1);
        if fails_again(error) {
            let n = self.settle_failures.record(id, error);
            tracing::warn!(table = self.name(), id, failures = n, error = %error, "settlement failed; the row was released and its next delivery backs off");
        }
    }

    /// Settles one row by its hold. Returns what was done.
    pub(crate) async fn settle_hold(&self, hold: Hold<B>, settle: Settle) -> Result<()> {
        match (hold, &self.prepared) {
            (Hold::Tx(tx, writes_began), Prepared::RowLock(s)) => {
                s.settle(tx, settle, writes_began).await
            }
            (Hold::Lease(cell), Prepared::Lease(s)) => match s.settle(cell.token(), settle).await {
                Ok(true) => Ok(()),
                Ok(false) => Err(self.lost(settle.id).await),
                Err(e) => {
                    // The row still holds this lease: give it back now, as a dropped delivery's
                    // is, instead of leaving it until the lease runs out (its next delivery
                    // backs off). A release that fails too leaves the lease to run out.
                    if let Err(r) = s.settle(cell.token(), cell.release(settle.id)).await {
                        tracing::warn!(table = self.name(), id = settle.id, error = %r, "release after a failed settlement failed; the lease runs out instead");
                    }
                    Err(e)
                }
            },
            (Hold::Key(mut hold), Prepared::Advisory(s)) => {
                let lock = hold.lock_mut();
                match s.settle(lock, settle).await {
                    Err(SqlxBrokerError::ClaimLost { .. }) if self.is_gone(settle.id).await => {
                        Err(self.gone(settle.id))
                    }
                    Err(e) => Err(e),
                    Ok(()) => hold.unlock().await,
                }
            }
            _ => unreachable!("a hold always comes from the queue's own mode"),
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
        Metrics::add(&self.metrics.lease_lost, 1);
        SqlxBrokerError::LeaseLost {
            table: self.name().to_owned(),
            id,
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
