//! The broker (one per pool) and its queues (one per prepared table).

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use sqlx::{Database, FromRow};

use crate::claim_mode::ClaimMode;
use crate::delivery::{self, Delivery, Job, JobTransaction};
use crate::driver::{Backend, RowState};
use crate::error::{Result, SqlxBrokerError};
use crate::inner::{BrokerInner, Shared};
use crate::metrics::MetricsSnapshot;
use crate::mode::QueueInner;
use crate::publish::NewJob;
use crate::subscription::{Handler, IntoOutcome, SubscribeOptions, Subscription};
use crate::table::TableDescription;

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

impl<B: Backend> Broker<B> {
    /// A broker on `backend`, whose pool the caller keeps: [`close`](Self::close) stops the
    /// broker's work and leaves the pool open.
    pub fn new(backend: B) -> Self {
        Self {
            inner: Arc::new(BrokerInner::new(backend, false)),
        }
    }

    /// A broker on a backend whose pool it opened itself (the backends' `connect` use it):
    /// [`close`](Self::close) closes that pool too.
    pub fn owning_pool(backend: B) -> Self {
        Self {
            inner: Arc::new(BrokerInner::new(backend, true)),
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
                shared: Arc::new(Shared::new(self.inner.clone(), table)),
                mode: prepared.into(),
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
    /// background), and clean-ups of dropped deliveries finish. A pool the broker opened
    /// (`connect`) closes; a pool you passed in (`new`) stays open for the rest of your
    /// program. Settlements after this return [`SqlxBrokerError::Closed`].
    pub async fn close(&self) {
        self.inner.shutdown.send_replace(true);
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.drain_cleanups().await;
        if self.inner.owns_pool {
            self.inner.backend.pool().close().await;
        }
    }

    /// Waits for the clean-ups of deliveries dropped without settlement (lease releases, key
    /// unlocks) that have started so far.
    pub async fn flush_cleanups(&self) {
        self.inner.drain_cleanups().await;
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
            .field("table", &self.inner.shared.table.name())
            .field("mode", &self.inner.shared.table.mode())
            .finish()
    }
}

impl<B: Backend, T> Queue<B, T> {
    /// The table description.
    pub fn table(&self) -> &TableDescription {
        &self.inner.shared.table
    }

    /// The claim mode.
    pub fn mode(&self) -> ClaimMode {
        self.inner.shared.table.mode()
    }

    /// The counters of this queue.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.shared.metrics.snapshot()
    }

    /// The row `id` now, or `None` when it is gone.
    pub async fn row_state(&self, id: i64) -> Result<Option<RowState>> {
        self.inner
            .shared
            .broker
            .backend
            .row_state(&self.inner.shared.table, id)
            .await
    }

    /// Wakes this process's subscriptions of the table, e.g. after committing a transaction
    /// that published through [`publish_in`](Self::publish_in).
    pub fn wake(&self) {
        self.inner
            .shared
            .broker
            .wake(self.inner.shared.table.name());
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
        let table = &self.inner.shared.table;
        let backend = &self.inner.shared.broker.backend;
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
            .shared
            .broker
            .backend
            .publish(conn, &self.inner.shared.table, jobs)
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
        delivery::claim(&self.inner, limit, None).await
    }

    /// Runs `handler` on every due row, with `options.concurrency` jobs in work at once; see
    /// [`Subscription`].
    ///
    /// The handler is any function of a [`Job`] returning a future of an
    /// [`Outcome`](crate::Outcome), or of a `Result` of one whose error converts into
    /// [`BoxError`](crate::BoxError) (an error or a panic becomes a retry): a plain
    /// `async fn handle(job: Job<T>) -> Result<Outcome, MyError>`, or a closure
    /// `|job| async move { .. }`. A runnable example is in the README and in the backend crates'
    /// docs.
    ///
    /// # Errors
    /// [`SqlxBrokerError::InvalidOption`] for an option value the engine cannot run with (a
    /// concurrency, batch size or claim limit of 0, a poll interval under
    /// [`MIN_POLL_INTERVAL`](crate::MIN_POLL_INTERVAL)), naming the option and what is accepted.
    pub fn subscribe<F, Fut>(&self, options: SubscribeOptions, handler: F) -> Result<Subscription>
    where
        F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
    {
        crate::subscription::start(self.inner.clone(), options, Handler::plain(handler))
    }

    /// Like [`subscribe`](Self::subscribe), for row lock tables whose handlers write through
    /// the delivery's transaction: the handler also gets a [`JobTransaction`], and what it
    /// writes through it commits with the ack in one commit, or rolls back with a retry or dead
    /// letter while the row stays locked.
    ///
    /// # Errors
    /// As [`subscribe`](Self::subscribe); and [`SqlxBrokerError::Unsupported`] for a table in
    /// lease or advisory mode, which hold no transaction.
    pub fn subscribe_with_transaction<F, Fut>(
        &self,
        options: SubscribeOptions,
        handler: F,
    ) -> Result<Subscription>
    where
        F: Fn(Job<T>, JobTransaction<B>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
    {
        crate::subscription::start(
            self.inner.clone(),
            options,
            Handler::with_transaction(handler),
        )
    }
}
