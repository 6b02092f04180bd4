//! The broker (one per pool) and its queues (one per prepared table).

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use sqlx::{Database, FromRow};

use std::time::Duration;

use crate::admin::{Cancelled, DeadLetters, JobInfo, JobState, Page, Pause, QueueStats, RowChange};
use crate::claim_mode::ClaimMode;
use crate::delivery::{self, Delivery, Job, JobTransaction};
use crate::driver::{AdminDriver, Backend, RowState};
use crate::error::{Result, SqlxBrokerError};
use crate::inner::{BrokerInner, Shared};
use crate::metrics::MetricsSnapshot;
use crate::mode::QueueInner;
use crate::publish::{NewJob, Published};
use crate::schedule::{Schedule, ScheduleRow, Scheduled};
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
    /// to read just the payload column; `()` for a queue that is only operated on).
    ///
    /// # Errors
    /// Besides the startup checks, [`SqlxBrokerError::Schema`] when `T` is a
    /// [`Payload`](crate::Payload) of a type the payload column's SQL type does not decode into
    /// (`Payload<String>` over a `BIGINT` column, say), naming the column and both types.
    pub async fn queue<T>(&self, table: TableDescription) -> Result<Queue<B, T>>
    where
        T: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    {
        let table = Arc::new(table);
        self.check_offered(&table)?;
        self.inner.backend.check_names(&table)?;
        let (prepared, warnings) =
            crate::warnings::collecting(self.inner.backend.prepare(&table)).await;
        let prepared = prepared?;
        self.check_row_type::<T>(&table).await?;
        Ok(Queue {
            inner: Arc::new(QueueInner {
                shared: Arc::new(Shared::new(self.inner.clone(), table, warnings)),
                mode: prepared.into(),
            }),
            _row: PhantomData,
        })
    }

    /// Decodes the backend's payload probe (a NULL of the payload column's type) as `T`, and
    /// refuses `T` when it is a [`Payload`](crate::Payload) that cannot read that type. Any
    /// other outcome passes: a row type of its own may read other columns, which the probe
    /// lacks, and a probe that cannot run leaves the check to the first claim.
    async fn check_row_type<T>(&self, table: &TableDescription) -> Result<()>
    where
        T: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    {
        let Some(row) = self.inner.backend.payload_probe(table).await else {
            return Ok(());
        };
        match T::from_row(&row) {
            Err(e) if crate::payload::is_type_mismatch(&e) => {
                let column = table.payload().map_or("", |(c, _)| c);
                Err(SqlxBrokerError::Schema {
                    table: table.name().to_owned(),
                    what: format!(
                        "the queue's row type cannot read the payload column \"{column}\""
                    ),
                    statement: "row type check",
                    source: crate::payload::naming_columns(table, e),
                })
            }
            _ => Ok(()),
        }
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
        // The kinds in the table, where the table and its statements passed (the counts read
        // the columns the check found).
        let prepared = checks
            .last()
            .is_some_and(|c| c.name == "table and statements" && c.status == crate::Status::Pass);
        if prepared && table.kind().is_some() {
            let now = crate::driver::clock::now_ms();
            checks.push(match backend.admin().stats(table, now).await {
                Ok(counts) => crate::doctor::kinds_check(&counts.kinds, options.known_kinds()),
                Err(e) => Check::warn(
                    crate::doctor::KINDS_CHECK,
                    format!("cannot count the rows by kind: {e}"),
                    "see the message",
                ),
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

    /// The DDL for a description (see [`Backend::ddl`]): what
    /// [`create_tables`](Self::create_tables) runs.
    ///
    /// # Errors
    /// What `create_tables` refuses before it runs anything, with the same error: a claim mode
    /// the database does not offer, names too long for it.
    pub fn ddl(&self, table: &TableDescription) -> Result<Vec<String>> {
        self.check_offered(table)?;
        self.inner.backend.check_names(table)?;
        Ok(self.inner.backend.ddl(table))
    }

    /// Refuses a table whose claim mode the database does not offer, as [`queue`](Self::queue)
    /// and [`create_tables`](Self::create_tables) do.
    fn check_offered(&self, table: &TableDescription) -> Result<()> {
        let caps = self.inner.backend.capabilities();
        if caps.offers(table.mode()) {
            return Ok(());
        }
        Err(SqlxBrokerError::ModeNotOffered {
            table: table.name().to_owned(),
            mode: table.mode(),
            database: caps.database,
            hint: "add a locked_until column (lease mode) or an advisory_lock template",
        })
    }

    /// Creates the table of a description (and its index and dead-letter table) if missing.
    /// A description that [`queue`](Self::queue) would refuse before it reads the table (a
    /// claim mode the database does not offer, names too long for it) is refused here with the
    /// same error, and nothing is created.
    pub async fn create_tables(&self, table: &TableDescription) -> Result<()> {
        let ddl = self.ddl(table)?;
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

    /// Every periodic schedule registered on the database (any queue, any process), by name;
    /// [`ScheduleRow::next_tick_ms`] gives each one's next tick.
    pub async fn schedules(&self) -> Result<Vec<ScheduleRow>> {
        self.inner.backend.schedules().await
    }

    /// Whether [`close`](Self::close) has run.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }

    /// Shuts the broker down: every subscription of the broker stops as
    /// [`Subscription::shutdown`] stops one (no new claims; the handlers in work finish and are
    /// settled, up to each subscription's shutdown deadline), and `close` waits for that, so
    /// closing before shutting the subscriptions down loses no handler's work. Then clean-ups of
    /// dropped deliveries finish, and a pool the broker opened (`connect`) closes; a pool you
    /// passed in (`new`) stays open for the rest of your program. Settlements after this (of
    /// deliveries claimed by hand) return [`SqlxBrokerError::Closed`]. Shutting the
    /// subscriptions down first still tells you what each finished ([`ShutdownReport`](crate::ShutdownReport)).
    pub async fn close(&self) {
        self.inner.shutdown.send_replace(true);
        // The count only falls once the shutdown is sent: an engine started after it sees the
        // stop at once.
        let mut engines = self.inner.engines.subscribe();
        let _ = engines.wait_for(|n| *n == 0).await;
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

/// Reads a queue's depth and lag into gauges until dropped (see [`Queue::export_depth`]).
#[cfg(feature = "metrics")]
#[derive(Debug)]
pub struct DepthExport {
    task: tokio::task::JoinHandle<()>,
}

#[cfg(feature = "metrics")]
impl Drop for DepthExport {
    fn drop(&mut self) {
        self.task.abort();
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

    /// What preparing the table found that works but should be fixed, one sentence each with
    /// the fix (today: a claim index that is missing or not what the claim reads). Empty when
    /// all is well. The same lines are `tracing` warnings, are in every subscription's
    /// [`Health::warnings`](crate::Health::warnings), and go to standard error once when no
    /// `tracing` subscriber is installed.
    pub fn warnings(&self) -> &[String] {
        &self.inner.shared.warnings
    }

    /// How many connections this queue's claim mode keeps out of the pool for its next
    /// statement now (a busy subscription keeps them between statements; a stop gives them
    /// back). For tests; not a stable interface.
    #[doc(hidden)]
    pub fn kept_connections(&self) -> usize {
        self.inner.kept()
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

    /// Publishes one row on a pool connection and wakes this process's subscriptions. A job
    /// whose [unique key](NewJob::unique_key) an unfinished row has returns that row's id
    /// (see [`publish_unique`](Self::publish_unique) to tell the two apart).
    pub async fn publish<P>(&self, job: NewJob<P>) -> Result<i64>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        Ok(self.publish_unique(job).await?.id)
    }

    /// Publishes rows on a pool connection and wakes this process's subscriptions. All or
    /// nothing: a batch the backend writes in several statements runs in one transaction, so
    /// a row that fails (a constraint, a value too long) leaves none of the batch behind and a
    /// retry of the whole batch duplicates nothing. Each duplicate of a unique key gives the
    /// existing row's id.
    pub async fn publish_batch<P>(&self, jobs: &[NewJob<P>]) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        Ok(ids(self.publish_unique_batch(jobs).await?))
    }

    /// Publishes one row as [`publish`](Self::publish) does, and says whether it was a
    /// duplicate: an unfinished row had the job's [unique key](NewJob::unique_key), nothing was
    /// inserted, and the id is that row's. Not an error: publishing a key twice is how a
    /// caller makes sure a job exists.
    pub async fn publish_unique<P>(&self, job: NewJob<P>) -> Result<Published>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        let done = self
            .publish_unique_batch(std::slice::from_ref(&job))
            .await?;
        Ok(done.first().copied().unwrap_or(Published {
            id: 0,
            duplicate: false,
        }))
    }

    /// Publishes rows as [`publish_batch`](Self::publish_batch) does (all or nothing, in one
    /// transaction), saying of each whether it was a duplicate. Two jobs of one batch with one
    /// key make one row: the second is a duplicate of the first. A try the server undid (a
    /// deadlock, a busy database) runs again, up to
    /// [`PUBLISH_RETRIES`](crate::driver::retry::PUBLISH_RETRIES) times.
    pub async fn publish_unique_batch<P>(&self, jobs: &[NewJob<P>]) -> Result<Vec<Published>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        let table = &self.inner.shared.table;
        let backend = &self.inner.shared.broker.backend;
        let err = |e| SqlxBrokerError::statement(table.name(), "publish", e);
        // The connection and the transaction are the broker's own, so a try the server undid
        // (a deadlock: on MariaDB two inserts of one key that waited on the row an ack was
        // finishing) left nothing behind and runs again, up to `PUBLISH_RETRIES` times. A
        // publish inside the caller's transaction cannot be run again by the broker: the
        // server undid the whole transaction.
        let class = |e: &SqlxBrokerError| {
            e.sqlx_source()
                .map_or(crate::driver::ErrorClass::Permanent, |s| {
                    backend.classify(s)
                })
        };
        let retries = crate::driver::retry::PUBLISH_RETRIES;
        let done = crate::driver::retry::transient_up_to(class, retries, || async {
            if jobs.len() <= 1 {
                // One statement is atomic on its own; no transaction round trips for it.
                let mut conn = backend.pool().acquire().await.map_err(err)?;
                self.publish_on(&mut conn, jobs).await
            } else {
                let mut tx = backend.pool().begin().await.map_err(err)?;
                // On error the transaction rolls back as it drops.
                let done = self.publish_on(&mut tx, jobs).await?;
                tx.commit().await.map_err(err)?;
                Ok(done)
            }
        })
        .await?;
        self.wake();
        Ok(done)
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
        Ok(ids(self.publish_on(conn, jobs).await?))
    }

    /// Publishes rows inside the caller's transaction as [`publish_in`](Self::publish_in) does,
    /// saying of each whether it was a duplicate. A duplicate is found without a failed
    /// statement (PostgreSQL's and SQLite's `ON CONFLICT DO NOTHING`; on MySQL and MariaDB the
    /// duplicate-key error rolls back only its own statement), so the caller's transaction
    /// goes on. A job whose key another open transaction has just published waits for that
    /// transaction to end (the unique index decides), as any insert of a duplicate key does.
    ///
    /// # Errors
    /// A deadlock between publishers of one key (MySQL and MariaDB, beside an ack of that key's
    /// row) undoes the caller's whole transaction; its error is transient (the backend's
    /// `is_transient`): run the transaction again. The pool-connection forms
    /// ([`publish_unique`](Self::publish_unique) and the rest) run such a publish again
    /// themselves.
    pub async fn publish_unique_in<P>(
        &self,
        conn: &mut <B::Db as Database>::Connection,
        jobs: &[NewJob<P>],
    ) -> Result<Vec<Published>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        self.publish_on(conn, jobs).await
    }

    /// Publishes on `conn`: jobs without a unique key in runs through the backend's batch
    /// insert, each keyed job through its conflict-aware insert, in the batch's order.
    async fn publish_on<P>(
        &self,
        conn: &mut <B::Db as Database>::Connection,
        jobs: &[NewJob<P>],
    ) -> Result<Vec<Published>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        let table = &self.inner.shared.table;
        let backend = &self.inner.shared.broker.backend;
        // Refuses bad input (a key too long, a column the table lacks) before any statement.
        crate::publish::PublishPlan::new(table, jobs)?;
        let fresh = |ids: Vec<i64>| {
            ids.into_iter().map(|id| Published {
                id,
                duplicate: false,
            })
        };
        if !jobs.iter().any(|j| j.unique_key_value().is_some()) {
            return Ok(fresh(backend.publish(conn, table, jobs).await?).collect());
        }
        let mut out = Vec::with_capacity(jobs.len());
        let mut rest = jobs;
        while let Some(first) = rest.first() {
            if first.unique_key_value().is_some() {
                out.push(backend.publish_unique(conn, table, first).await?);
                rest = &rest[1..];
            } else {
                let run = rest
                    .iter()
                    .position(|j| j.unique_key_value().is_some())
                    .unwrap_or(rest.len());
                out.extend(fresh(backend.publish(conn, table, &rest[..run]).await?));
                rest = &rest[run..];
            }
        }
        Ok(out)
    }

    /// Runs `schedule` in this process: at each tick it publishes `job(tick time)` to this
    /// queue, in one transaction that records the tick, so that however many processes run the
    /// schedule each tick publishes exactly one row (see [`Schedule`] for expressions, time
    /// zones and missed ticks). On a table with a [unique key column](crate::TableBuilder::unique_key)
    /// a job that sets no key gets `"{name}@{tick ms}"`. Runs until the returned handle drops
    /// or the broker closes. The schedule tables come with [`Broker::create_tables`].
    ///
    /// # Errors
    /// [`SqlxBrokerError::Schedule`] when the name is registered with another expression, time
    /// zone or table; a statement error when the schedule tables are missing.
    pub async fn schedule<P, F>(&self, schedule: Schedule, job: F) -> Result<Scheduled>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync + 'static,
        F: Fn(std::time::SystemTime) -> NewJob<P> + Send + Sync + 'static,
    {
        crate::schedule::start(self.inner.clone(), schedule, job).await
    }
}

fn ids(done: Vec<Published>) -> Vec<i64> {
    done.into_iter().map(|p| p.id).collect()
}

/// Operating the queue: what it holds, and changes to rows outside the claim path (see
/// [`admin`](crate::admin)). Each change is fenced like a settlement: a row a delivery holds is
/// refused with [`SqlxBrokerError::RowInWork`], and nothing changes; only
/// [`cancel`](Queue::cancel) reaches a row in work, through its holder.
impl<B: Backend, T> Queue<B, T> {
    fn refused(&self, what: &'static str, why: impl Into<String>) -> SqlxBrokerError {
        SqlxBrokerError::Refused {
            table: self.inner.shared.name().to_owned(),
            what,
            why: why.into(),
        }
    }

    fn backend(&self) -> &B {
        &self.inner.shared.broker.backend
    }

    /// What the queue holds now, by state, with its lag and whether it is paused (see
    /// [`QueueStats`]): one statement on the table (and its dead-letter table), which reads
    /// through the claim index and takes no lock a claim waits for.
    pub async fn stats(&self) -> Result<QueueStats> {
        let table = &self.inner.shared.table;
        let now = crate::driver::clock::now_ms();
        let counts = self.backend().admin().stats(table, now).await?;
        let paused = match self.backend().admin().pause_state(table.name()).await {
            Ok(p) => p,
            // No control table: nothing can have paused the queue.
            Err(_)
                if !self
                    .backend()
                    .admin()
                    .has_control_table()
                    .await
                    .unwrap_or(true) =>
            {
                None
            }
            Err(e) => return Err(e),
        };
        Ok(QueueStats {
            table: table.name().to_owned(),
            mode: table.mode(),
            due: counts.due,
            scheduled: counts.scheduled,
            in_work: counts.in_work,
            retrying: counts.retrying,
            dead: counts.dead,
            finished: counts.finished,
            oldest_due_ms: counts.oldest_due_ms,
            read_at_ms: now,
            paused,
            schedules: self
                .backend()
                .schedules()
                .await?
                .into_iter()
                .filter(|s| s.queue == table.name())
                .collect(),
            kinds: counts.kinds,
        })
    }

    /// The rows in `state`, by id, a page at a time (pass the last id of a page as the next
    /// page's `after`). Each row's last error is read as a listing shows it: its first
    /// [`LAST_ERROR_PREVIEW_CHARS`](crate::admin::LAST_ERROR_PREVIEW_CHARS) characters, cut by
    /// the database, with [`JobInfo::last_error_cut`] set when there was more; read one row with
    /// [`job`](Self::job) for more of it.
    ///
    /// # Errors
    /// [`SqlxBrokerError::Refused`] for a page of 0 or more than [`Page::MAX`] rows, dead letters
    /// of a table without a dead-letter target, and finished rows of a table whose acks delete.
    pub async fn jobs(&self, state: JobState, page: Page) -> Result<Vec<JobInfo>> {
        self.list(state, page, crate::admin::LAST_ERROR_PREVIEW_CHARS, None)
            .await
    }

    /// The rows of kind `kind` in `state`, as [`jobs`](Self::jobs) lists them, on a table with
    /// a [kind column](crate::TableBuilder::kind).
    ///
    /// # Errors
    /// What [`jobs`](Self::jobs) refuses, and [`SqlxBrokerError::Refused`] for a table without
    /// a kind column.
    pub async fn jobs_of_kind(
        &self,
        state: JobState,
        kind: &str,
        page: Page,
    ) -> Result<Vec<JobInfo>> {
        if self.inner.shared.table.kind().is_none() {
            return Err(self.refused(
                "listing rows of a kind",
                "the table has no kind column (add .kind(\"kind\"))",
            ));
        }
        self.list(
            state,
            page,
            crate::admin::LAST_ERROR_PREVIEW_CHARS,
            Some(kind),
        )
        .await
    }

    /// Row `id` as a listing shows it, with up to
    /// [`LAST_ERROR_READ_CHARS`](crate::admin::LAST_ERROR_READ_CHARS) characters of its last
    /// error (cut by the database; [`JobInfo::last_error_cut`] says whether there was more), or
    /// `None` when there is no such row. It reads the row's state, then the row in that state;
    /// a row that moved between the two reads (claimed, settled) is shown as the first read
    /// saw it, without its payload and error.
    pub async fn job(&self, id: i64) -> Result<Option<JobInfo>> {
        let Some(row) = self.row_state(id).await? else {
            return Ok(None);
        };
        let states: &[JobState] = if row.dead {
            &[JobState::Dead]
        } else if row.processed {
            &[JobState::Finished]
        } else {
            &[JobState::InWork, JobState::Due, JobState::Scheduled]
        };
        let page = Page {
            after: id.checked_sub(1),
            limit: 1,
        };
        for &state in states {
            let found = self
                .list(state, page, crate::admin::LAST_ERROR_READ_CHARS, None)
                .await?;
            if let Some(job) = found.into_iter().next().filter(|j| j.id == id) {
                return Ok(Some(job));
            }
        }
        let state = if row.dead {
            JobState::Dead
        } else if row.processed {
            JobState::Finished
        } else {
            JobState::InWork
        };
        let mut job = JobInfo::new(id, row.attempt, state);
        job.due_ms = row.due_ms;
        job.locked_until_ms = row.locked_until_ms;
        Ok(Some(job))
    }

    /// [`jobs`](Self::jobs) reading `error_chars` characters of each last error.
    async fn list(
        &self,
        state: JobState,
        page: Page,
        error_chars: usize,
        kind: Option<&str>,
    ) -> Result<Vec<JobInfo>> {
        let table = &self.inner.shared.table;
        if page.limit == 0 || page.limit > Page::MAX {
            return Err(self.refused(
                "listing rows",
                format!(
                    "a page of {} rows; ask for 1 to {} rows",
                    page.limit,
                    Page::MAX
                ),
            ));
        }
        if state == JobState::Dead && table.dead_letter().is_none() {
            return Err(self.refused(
                "listing dead letters",
                "the table has no dead-letter target (add .dead_letter(..) and .max_attempts(..))",
            ));
        }
        if state == JobState::Finished && table.processed_at().is_none() {
            return Err(self.refused(
                "listing finished rows",
                "acks delete rows on this table (add .processed_at(..) to keep them)",
            ));
        }
        self.backend()
            .admin()
            .list(
                table,
                state,
                page,
                error_chars,
                kind,
                crate::driver::clock::now_ms(),
            )
            .await
    }

    /// The dead letters, by id, a page at a time, with their attempt and last error.
    pub async fn dead_letters(&self, page: Page) -> Result<Vec<JobInfo>> {
        self.jobs(JobState::Dead, page).await
    }

    /// Checks a selection of dead letters before an operation on them.
    fn check_dead(&self, what: &'static str, which: &DeadLetters) -> Result<()> {
        let table = &self.inner.shared.table;
        if table.dead_letter().is_none() {
            return Err(self.refused(
                what,
                "the table has no dead-letter target, so it has no dead letters (add .dead_letter(..) and .max_attempts(..))",
            ));
        }
        match which {
            DeadLetters::Ids(ids) if ids.is_empty() => Err(self.refused(
                what,
                "the list of ids is empty; name at least one id, or use DeadLetters::All",
            )),
            DeadLetters::ErrorContains(text) if text.is_empty() => Err(self.refused(
                what,
                "the error text to match is empty; give some text, or use DeadLetters::All",
            )),
            DeadLetters::ErrorContains(_) if table.last_error().is_none() => Err(self.refused(
                what,
                "the table has no last_error column to match (add .last_error(..))",
            )),
            _ => Ok(()),
        }
    }

    /// Puts dead letters back in the queue, due now with attempt 1, and wakes this broker's
    /// subscriptions (on PostgreSQL every process's); returns how many. Safe to run twice: a requeued row is no longer a dead
    /// letter. With [`DeadLetters::Ids`], every id must be a dead letter, or nothing changes
    /// ([`SqlxBrokerError::RowNotFound`] names the first that is not).
    pub async fn requeue_dead(&self, which: DeadLetters) -> Result<u64> {
        self.check_dead("requeue", &which)?;
        let n = self
            .backend()
            .admin()
            .requeue_dead(
                &self.inner.shared.table,
                &which,
                crate::driver::clock::now_ms(),
            )
            .await?;
        if n > 0 {
            // Requeued rows may sit before where this process's claims start reading.
            self.inner.shared.head.rescan();
            self.wake();
        }
        Ok(n)
    }

    /// Deletes dead letters for good; returns how many. With [`DeadLetters::Ids`], every id
    /// must be a dead letter, or nothing changes.
    pub async fn discard_dead(&self, which: DeadLetters) -> Result<u64> {
        self.check_dead("discard", &which)?;
        self.backend()
            .admin()
            .discard_dead(&self.inner.shared.table, &which)
            .await
    }

    fn row_change(&self, what: &'static str, id: i64, change: RowChange) -> Result<bool> {
        let table = self.inner.shared.name().to_owned();
        match change {
            RowChange::Done => Ok(true),
            RowChange::Unchanged => Ok(false),
            RowChange::NotFound => Err(SqlxBrokerError::RowNotFound {
                table,
                id,
                where_: " among the unfinished rows",
            }),
            RowChange::InWork(held) => Err(SqlxBrokerError::RowInWork {
                table,
                id,
                held,
                what,
            }),
        }
    }

    /// Takes unfinished row `id` out of the queue by deleting it (a cancelled row is gone; it
    /// is not kept as a dead letter or a finished row), and tells what it did.
    ///
    /// A row no delivery holds is deleted at once ([`Cancelled::Removed`]). A row in work is
    /// cancelled through its holder, in whichever process it runs ([`Cancelled::Signalled`]): the
    /// request is recorded in the cancel table ([`CANCEL_TABLE`](crate::driver::CANCEL_TABLE),
    /// which the DDL helper creates), the holder's handler sees its cancel signal
    /// ([`Job::cancelled`](crate::Job::cancelled), [`CancelReason::Cancelled`](crate::CancelReason::Cancelled))
    /// at once in this process, through `NOTIFY` on PostgreSQL, and within one poll interval
    /// elsewhere; after the subscription's grace the holder drops the handler and deletes the
    /// row, fenced as its own settlement. A handler that returned before the signal reached it
    /// settles as it returned (an ack wins). A holder that dies leaves the request to the row's
    /// next claim, which deletes the row without running its handler. See
    /// docs/timeouts-and-cancelling.md, "Cancelling a running job".
    ///
    /// [`Cancelled::Signalled`] also when the row was gone by the time the request was
    /// recorded: its holder deleted it for this cancel, or finished it just before.
    ///
    /// # Errors
    /// [`SqlxBrokerError::RowNotFound`] when there is no such unfinished row; a statement
    /// error when the row is in work and the cancel table is missing (create it with the DDL
    /// helper).
    pub async fn cancel(&self, id: i64) -> Result<Cancelled> {
        let table = &self.inner.shared.table;
        let admin = self.backend().admin();
        let change = admin
            .cancel(table, id, crate::driver::clock::now_ms())
            .await?;
        let RowChange::InWork(_) = change else {
            self.row_change("cancel", id, change)?;
            return Ok(Cancelled::Removed);
        };
        // Recorded before the row is looked at again: a holder that settles or gives the row
        // back in between leaves either a row the second try deletes, or no row (its handler
        // finished first) and a request nobody needs, which is withdrawn here.
        admin
            .request_cancel(table.name(), id, crate::driver::clock::now_ms())
            .await?;
        let gate = self.inner.shared.broker.gate(table.name());
        gate.cancels.request(id);
        let again = admin
            .cancel(table, id, crate::driver::clock::now_ms())
            .await;
        match again? {
            RowChange::InWork(_) => Ok(Cancelled::Signalled),
            // Gone since: its holder deleted it for this request, or finished it first. The
            // request is spent either way.
            RowChange::NotFound => {
                admin.clear_cancel(table.name(), id).await?;
                gate.cancels.forget(id);
                Ok(Cancelled::Signalled)
            }
            other => {
                admin.clear_cancel(table.name(), id).await?;
                gate.cancels.forget(id);
                self.row_change("cancel", id, other)?;
                Ok(Cancelled::Removed)
            }
        }
    }

    /// Makes unfinished row `id` (scheduled, or waiting for a delayed retry) due now and wakes
    /// this broker's subscriptions (on PostgreSQL every process's, through a `NOTIFY` sent in
    /// the change's transaction); a row that is due already stays as it is. The row takes its
    /// place among the due rows by its new due time (now), behind rows that were due before it,
    /// as the claim order says; see docs/operating.md.
    ///
    /// # Errors
    /// [`SqlxBrokerError::RowInWork`] when a delivery holds the row (nothing changed),
    /// [`SqlxBrokerError::RowNotFound`] when there is no such unfinished row.
    pub async fn run_now(&self, id: i64) -> Result<()> {
        let change = self
            .backend()
            .admin()
            .run_now(&self.inner.shared.table, id, crate::driver::clock::now_ms())
            .await?;
        if self.row_change("run now", id, change)? {
            self.wake();
        }
        Ok(())
    }

    /// Deletes acked rows (kept with `processed_at`) acked more than `older_than` ago; returns
    /// how many.
    ///
    /// # Errors
    /// [`SqlxBrokerError::Refused`] for a table whose acks delete rows.
    pub async fn purge_finished(&self, older_than: Duration) -> Result<u64> {
        let table = &self.inner.shared.table;
        if table.processed_at().is_none() {
            return Err(self.refused(
                "purge",
                "acks delete rows on this table, so there are no finished rows to purge",
            ));
        }
        let now = crate::driver::clock::now_ms();
        let older = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        self.backend()
            .admin()
            .purge_finished(table, now.saturating_sub(older))
            .await
    }

    /// Pauses the queue in every process: when this returns, no handler of the queue starts
    /// any more through this broker (rows claimed but not started wait, holding their claim,
    /// for a resume); other brokers hear it at once on PostgreSQL (a `NOTIFY` sent in the
    /// pause's transaction) and within their poll interval on the other databases. Rows in work
    /// finish, and publishes are still accepted. `by` says who paused it (shown by `stats()` and the CLI). The state
    /// lives in the control table ([`CONTROL_TABLE`](crate::driver::CONTROL_TABLE)) that
    /// [`Broker::create_tables`] creates.
    ///
    /// # Errors
    /// [`SqlxBrokerError::Refused`] when the queue is paused already, or the control table is
    /// missing.
    pub async fn pause(&self, by: &str) -> Result<()> {
        self.require_control("pause").await?;
        let pause = Pause {
            since_ms: crate::driver::clock::now_ms(),
            by: by.to_owned(),
        };
        let name = self.inner.shared.name();
        if !self.backend().admin().set_pause(name, Some(&pause)).await? {
            let since = match self.backend().admin().pause_state(name).await? {
                Some(p) => format!(" (since {} ms, by \"{}\")", p.since_ms, p.by),
                None => String::new(),
            };
            return Err(self.refused(
                "pause",
                format!("the queue is paused already{since}; resume it first"),
            ));
        }
        self.inner.shared.broker.pause_changed(name, true).await;
        Ok(())
    }

    /// Resumes a paused queue in every process (at once through this broker, and on PostgreSQL
    /// in every process; within their poll interval in others).
    ///
    /// # Errors
    /// [`SqlxBrokerError::Refused`] when the queue is not paused, or the control table is
    /// missing.
    pub async fn resume(&self) -> Result<()> {
        self.require_control("resume").await?;
        let name = self.inner.shared.name();
        if !self.backend().admin().set_pause(name, None).await? {
            return Err(self.refused("resume", "the queue is not paused"));
        }
        self.inner.shared.broker.pause_changed(name, false).await;
        Ok(())
    }

    /// Exports the queue's depth (its unfinished rows: due, scheduled and in work) and lag as
    /// the gauges `sqlx_broker_depth` and `sqlx_broker_lag_seconds` (label `table`), read with
    /// [`stats`](Self::stats) every `every` in a task of its own, until the returned guard
    /// drops. Off unless you start it: each reading is one statement on the table.
    #[cfg(feature = "metrics")]
    pub fn export_depth(&self, every: Duration) -> DepthExport
    where
        T: 'static,
    {
        let queue = self.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match queue.stats().await {
                    Ok(s) => queue.inner.shared.metrics.sampled(
                        s.due.rows + s.scheduled.rows + s.in_work.rows,
                        s.lag().map(|d| d.as_secs_f64()),
                    ),
                    Err(e) => {
                        tracing::warn!(table = queue.table().name(), error = %e, "reading the queue's depth failed");
                    }
                }
            }
        });
        DepthExport { task }
    }

    /// Whether the queue is paused, since when and by whom.
    pub async fn paused(&self) -> Result<Option<Pause>> {
        self.require_control("reading the pause").await?;
        self.backend()
            .admin()
            .pause_state(self.inner.shared.name())
            .await
    }

    async fn require_control(&self, what: &'static str) -> Result<()> {
        if self.backend().admin().has_control_table().await? {
            return Ok(());
        }
        Err(self.refused(
            what,
            format!(
                "the control table {} is missing; create it with Broker::create_tables (or the DDL it prints)",
                crate::driver::CONTROL_TABLE
            ),
        ))
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

    /// Like [`subscribe`](Self::subscribe), with the handler given as a tower
    /// [`Service`](tower_service::Service) of jobs: how middleware wraps every handler of a
    /// subscription in one place (tracing context, metrics, an authorisation context, a
    /// limit). Build it from a handler function with [`handler_service`](crate::handler_service)
    /// and wrap it in any [`Layer`](tower_layer::Layer)s, tower's `ServiceBuilder` included; or
    /// use [`subscribe_layered`](Self::subscribe_layered).
    ///
    /// Each delivery clones the service, waits until the clone is ready, then calls it with the
    /// [`Job`]; the response is the row's [`Outcome`](crate::Outcome), and an error (from
    /// `poll_ready` too) is a failed attempt, retried with the subscription's backoff, as a
    /// handler's error is. A service that waits in `poll_ready` waits holding its claimed row.
    ///
    /// ```
    /// # use broker_core::{BoxError, Backend, Job, Outcome, Payload, Queue, Result, SubscribeOptions, Subscription};
    /// use broker_core::{BoxFuture, HandlerService, handler_service};
    /// use tower_layer::Layer;
    /// use tower_service::Service;
    /// use std::task::{Context, Poll};
    ///
    /// /// Logs every job's end, with its outcome or error.
    /// #[derive(Clone)]
    /// struct LogEnd<S>(S);
    ///
    /// impl<S, T> Service<Job<T>> for LogEnd<S>
    /// where
    ///     S: Service<Job<T>, Response = Outcome, Error = BoxError>,
    ///     S::Future: Send + 'static,
    /// {
    ///     type Response = Outcome;
    ///     type Error = BoxError;
    ///     type Future = BoxFuture<'static, std::result::Result<Outcome, BoxError>>;
    ///
    ///     fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), BoxError>> {
    ///         self.0.poll_ready(cx)
    ///     }
    ///
    ///     fn call(&mut self, job: Job<T>) -> Self::Future {
    ///         let id = job.id();
    ///         let end = self.0.call(job);
    ///         Box::pin(async move {
    ///             let result = end.await;
    ///             println!("job {id}: {result:?}");
    ///             result
    ///         })
    ///     }
    /// }
    ///
    /// struct LogEndLayer;
    /// impl<S> Layer<S> for LogEndLayer {
    ///     type Service = LogEnd<S>;
    ///     fn layer(&self, inner: S) -> LogEnd<S> {
    ///         LogEnd(inner)
    ///     }
    /// }
    ///
    /// async fn handle(job: Job<Payload<String>>) -> std::result::Result<Outcome, BoxError> {
    ///     Ok(Outcome::Ack)
    /// }
    ///
    /// fn start<B: Backend>(queue: &Queue<B, Payload<String>>) -> Result<Subscription>
    /// where
    ///     Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
    /// {
    ///     queue.subscribe_service(SubscribeOptions::default(), LogEndLayer.layer(handler_service(handle)))
    /// }
    /// ```
    ///
    /// # Errors
    /// As [`subscribe`](Self::subscribe).
    pub fn subscribe_service<S>(
        &self,
        options: SubscribeOptions,
        service: S,
    ) -> Result<Subscription>
    where
        S: tower_service::Service<Job<T>, Response = crate::Outcome> + Clone + Send + 'static,
        S::Error: Into<crate::BoxError>,
        S::Future: Send + 'static,
    {
        crate::subscription::start(self.inner.clone(), options, Handler::service(service))
    }

    /// [`subscribe_service`](Self::subscribe_service) of a handler function wrapped in
    /// `layer`: `queue.subscribe_layered(options, layer, handle)` is
    /// `queue.subscribe_service(options, layer.layer(handler_service(handle)))`. Stack several
    /// layers with tower's `ServiceBuilder` (its `into_inner()` is a layer) or a tuple of them.
    ///
    /// # Errors
    /// As [`subscribe`](Self::subscribe).
    pub fn subscribe_layered<L, F, Fut>(
        &self,
        options: SubscribeOptions,
        layer: L,
        handler: F,
    ) -> Result<Subscription>
    where
        F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
        L: tower_layer::Layer<crate::HandlerService<F>>,
        L::Service:
            tower_service::Service<Job<T>, Response = crate::Outcome> + Clone + Send + 'static,
        <L::Service as tower_service::Service<Job<T>>>::Error: Into<crate::BoxError>,
        <L::Service as tower_service::Service<Job<T>>>::Future: Send + 'static,
    {
        self.subscribe_service(options, layer.layer(crate::handler_service(handler)))
    }

    /// Like [`subscribe_with_transaction`](Self::subscribe_with_transaction), with the handler
    /// given as a tower service of the job and its transaction, `(Job<T>, JobTransaction<B>)`
    /// (see [`subscribe_service`](Self::subscribe_service)); build it with
    /// [`handler_service`](crate::handler_service) from a function of both.
    ///
    /// # Errors
    /// As [`subscribe_with_transaction`](Self::subscribe_with_transaction).
    pub fn subscribe_service_with_transaction<S>(
        &self,
        options: SubscribeOptions,
        service: S,
    ) -> Result<Subscription>
    where
        S: tower_service::Service<(Job<T>, JobTransaction<B>), Response = crate::Outcome>
            + Clone
            + Send
            + 'static,
        S::Error: Into<crate::BoxError>,
        S::Future: Send + 'static,
    {
        crate::subscription::start(
            self.inner.clone(),
            options,
            Handler::service_with_transaction(service),
        )
    }
}
