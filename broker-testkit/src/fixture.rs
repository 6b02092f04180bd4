//! What every case stands on: the backend's test database, a table of the case's own, and
//! bounded waits.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker_core::driver::alias;
use broker_core::{
    Backend, Broker, ClaimMode, ColumnType, Delivery, NewJob, Outcome, Queue, SqlxBrokerError,
    SubscribeOptions, TableBuilder, TableDescription,
};
use sqlx::{ColumnIndex, Database, Decode, Encode, FromRow, Row, Type};

/// A payload that [`Job`] refuses to decode, standing in for any row that does not decode.
pub const UNDECODABLE: &str = "undecodable payload";

/// The rows cases work with: the payload column as text. Backends set [`TestDb::Job`] to it.
/// A NULL payload or [`UNDECODABLE`] does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job(pub String);

impl<'r, R> FromRow<'r, R> for Job
where
    R: Row,
    String: Decode<'r, R::Database> + Type<R::Database>,
    &'static str: ColumnIndex<R>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        match row.try_get::<Option<String>, _>(alias::PAYLOAD)? {
            Some(text) if text != UNDECODABLE => Ok(Job(text)),
            other => Err(sqlx::Error::Decode(
                format!("the test payload {other:?} does not decode").into(),
            )),
        }
    }
}

/// The database of a test backend.
pub type DbOf<D> = <<D as TestDb>::B as Backend>::Db;

/// What cases read of a row: its text payload.
pub trait JobText {
    /// The payload.
    fn text(&self) -> &str;
}

impl JobText for Job {
    fn text(&self) -> &str {
        &self.0
    }
}

/// A backend's test database, as its `tests/` provides it.
///
/// The associated types carry the bounds the generic cases need (as associated-type bounds they
/// hold wherever `D: TestDb` does); every backend sets them to [`Job`] and `String`.
pub trait TestDb: Send + Sync + 'static {
    /// The backend under test.
    type B: Backend;
    /// The row type: [`Job`].
    type Job: for<'r> FromRow<'r, <DbOf<Self> as Database>::Row> + JobText + Send + 'static;
    /// Text to publish: `String`.
    type Text: for<'q> Encode<'q, DbOf<Self>>
        + Type<DbOf<Self>>
        + From<String>
        + Send
        + Sync
        + 'static;

    /// The database URL for one test: a fresh database where that is cheap (a SQLite file),
    /// else the shared test database (cases use tables of their own).
    fn database() -> impl Future<Output = String> + Send;

    /// A new broker (with a pool of its own) on `url`.
    fn connect(url: &str) -> impl Future<Output = Broker<Self::B>> + Send;

    /// Whether any session (any broker, any process where the backend can tell) holds the
    /// advisory key `key` now.
    fn key_is_held(broker: &Broker<Self::B>, key: &str) -> impl Future<Output = bool> + Send;

    /// Terminates every database connection of `broker`'s pool from another session
    /// (PostgreSQL `pg_terminate_backend`, MariaDB `KILL`); returns how many, or `None` where the
    /// database has no server connections to kill (SQLite).
    fn kill_connections(broker: &Broker<Self::B>) -> impl Future<Output = Option<usize>> + Send;

    /// What `broker` leaves behind that it should not: advisory keys held, transactions open,
    /// connections of its pool in use. Empty when nothing leaks.
    fn leaks(broker: &Broker<Self::B>) -> impl Future<Output = Vec<String>> + Send;

    /// Makes every `DELETE` on `table` take about 20 ms on the server (a trigger that sleeps), so
    /// a fault case finds settlements in flight when it strikes; `false` where the backend
    /// cannot.
    fn slow_down_deletes(
        broker: &Broker<Self::B>,
        table: &str,
    ) -> impl Future<Output = bool> + Send {
        let _ = (broker, table);
        async { false }
    }

    /// The id of the server session behind `conn` (PostgreSQL's backend pid, MySQL's
    /// connection id), so a case can tell whether two deliveries ran on one connection; `None`
    /// where a session says nothing about the client's connection (behind a transaction-mode
    /// pooler, a session is lent per transaction) or the database has none (SQLite).
    fn session_id(
        conn: &mut <DbOf<Self> as Database>::Connection,
    ) -> impl Future<Output = Option<i64>> + Send {
        let _ = conn;
        async { None }
    }

    /// Runs `sql` (a locking read, `SELECT .. FOR UPDATE`) in a transaction of its own on
    /// `broker`'s pool and keeps the transaction open until the returned value drops, as a
    /// user's transaction holding a row lock would; `None` where the database has no row locks
    /// (SQLite).
    fn hold_row_lock(
        broker: &Broker<Self::B>,
        sql: &str,
    ) -> impl Future<Output = Option<Box<dyn std::any::Any + Send>>> + Send {
        let _ = (broker, sql);
        async { None }
    }

    /// Whether the backend acks lease rows that finish close together in one statement
    /// (`LeaseStrategy::ack_many`), so a case can check that a batch ran.
    const BATCHED_ACKS: bool = false;

    /// Runs one statement of the backend's dialect on `broker`'s pool (cases use it to change a
    /// row behind the broker's back); returns the rows it changed.
    fn execute(broker: &Broker<Self::B>, sql: &str) -> impl Future<Output = u64> + Send;

    /// `name` quoted as an identifier in the backend's dialect, for the SQL a case writes
    /// itself: in double quotes unless the backend says otherwise.
    fn quote(name: &str) -> String {
        format!("\"{}\"", name.replace('"', "\"\""))
    }

    /// The statements that replace the DDL helper's claim index of `table` with one on the id
    /// alone under the same name, as the helper made it before the claim led with the due
    /// time. The default is PostgreSQL's and SQLite's (`{table}_claim`, DROP then CREATE).
    fn outdated_claim_index(table: &str) -> Vec<String> {
        let index = Self::quote(&format!("{table}_claim"));
        vec![
            format!("DROP INDEX {index}"),
            format!("CREATE INDEX {index} ON {} (\"id\")", Self::quote(table)),
        ]
    }

    /// Statements that drop the key index the DDL helper makes on an advisory table (as a
    /// table made by an earlier helper, or by hand, lacks it).
    fn drop_key_index(table: &str) -> Vec<String> {
        vec![format!(
            "DROP INDEX {}",
            Self::quote(&format!("{table}_key"))
        )]
    }

    /// Statements that drop the unique key index the DDL helper makes (`{table}_unique` on
    /// PostgreSQL and SQLite), as a table made by hand may lack it.
    fn drop_unique_index(table: &str) -> Vec<String> {
        vec![format!(
            "DROP INDEX {}",
            Self::quote(&format!("{table}_unique"))
        )]
    }

    /// Whether the backend offers `mode` (asked of a broker of its own).
    fn offers(mode: ClaimMode) -> impl Future<Output = bool> + Send {
        async move {
            let url = Self::database().await;
            let broker = Self::connect(&url).await;
            let offered = broker.backend().capabilities().offers(mode);
            broker.close().await;
            Self::drop_database(&url).await;
            offered
        }
    }

    /// Removes what [`database`](Self::database) made, if anything.
    fn drop_database(url: &str) -> impl Future<Output = ()> + Send {
        let _ = url;
        async {}
    }
}

/// [`TestDb::hold_row_lock`] for a server database: runs `sql` in a transaction of its own on
/// `pool` and returns the open transaction.
pub async fn hold_row_lock_on<DB: Database>(
    pool: &sqlx::Pool<DB>,
    sql: &str,
) -> Box<dyn std::any::Any + Send>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    Box::new(tx)
}

/// Appends a line to the fault report (`$SQLX_BROKER_REPORT_DIR/faults.txt`, by default in the
/// temp folder), so a run's figures survive cargo's capture of passing tests' output; `.ci/run`
/// prints the report at the end.
pub fn report(line: &str) {
    use std::io::Write as _;
    let dir = std::env::var_os("SQLX_BROKER_REPORT_DIR").map_or_else(
        || std::env::temp_dir().join("sqlx-broker-reports"),
        Into::into,
    );
    if std::fs::create_dir_all(&dir).is_ok()
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("faults.txt"))
    {
        let _ = writeln!(f, "{line}");
    }
    // On stderr, which libtest captures as it does stdout: a program that runs the cases
    // (`sqlx-broker check --json`) keeps stdout for its own output.
    eprintln!("{line}");
}

/// Says that a test, or a part of one, was not run and why, where it is seen though the test
/// passes: on the process's stderr past cargo's capture of test output, and in the fault report
/// (see [`report`]).
pub fn report_not_run(why: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "NOT RUN: {why}");
    report(&format!("NOT RUN: {why}"));
}

/// A name no other test uses, for tables (lowercase letters, digits, underscores).
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("sb_{prefix}_{}_{n}_{nanos:x}", std::process::id())
}

/// The description cases start from: a text payload, a due-time column, and what `mode` needs
/// (lease: `locked_until` with a 30 s lease; advisory: a text column `k` and the template
/// `"key-{k}"`).
pub fn describe(name: &str, mode: ClaimMode) -> TableBuilder {
    let b = TableDescription::builder(name)
        .payload("payload", ColumnType::Text)
        .due_at("due_at");
    match mode {
        ClaimMode::RowLock => b,
        ClaimMode::Lease => b.locked_until("locked_until"),
        ClaimMode::Advisory => b.column("k", ColumnType::Text).advisory_lock("key-{k}"),
        other => panic!("the suite has no case for claim mode {other:?}"),
    }
}

/// How many 20 ms polls a bounded wait of `limit` makes. Waits count polls instead of reading a
/// clock, so no case compares an elapsed time; a slow machine only waits longer.
fn polls(limit: Duration) -> u128 {
    (limit.as_millis() / POLL.as_millis()).max(1)
}

const POLL: Duration = Duration::from_millis(20);

/// Waits until `check` holds, polling every 20 ms; panics naming `what` after about `limit`
/// (counted in polls).
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..polls(limit) {
        if check().await {
            return;
        }
        tokio::time::sleep(POLL).await;
    }
    assert!(check().await, "gave up after {limit:?} waiting for {what}");
}

/// Claims one delivery from `queue`, polling every 20 ms until one comes; panics naming `what`
/// after about `limit` (counted in polls).
pub async fn claim_within<B, T>(queue: &Queue<B, T>, limit: Duration, what: &str) -> Delivery<B, T>
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    for _ in 0..polls(limit) {
        if let Some(d) = queue.claim(1).await.expect("claim").pop() {
            return d;
        }
        tokio::time::sleep(POLL).await;
    }
    panic!("gave up after {limit:?} waiting for {what}");
}

/// Claims one delivery, waiting up to 10 s until one is due.
pub async fn claim_one<B, T>(queue: &Queue<B, T>) -> Delivery<B, T>
where
    B: Backend,
    T: for<'r> FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    claim_within(queue, Duration::from_secs(10), "a claimable row").await
}

/// Checks that a backend that does not offer `mode` refuses a queue of that mode with
/// [`SqlxBrokerError::ModeNotOffered`], saying what to add.
pub(crate) async fn assert_refused<D: TestDb>(mode: ClaimMode) {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let table = describe(&unique_name("refused"), mode)
        .build()
        .expect("the case's description is valid");
    // create_tables refuses what queue() refuses, with the same error, and creates nothing.
    let created = broker.create_tables(&table).await.unwrap_err();
    let err = broker.queue::<D::Job>(table.clone()).await.unwrap_err();
    assert_eq!(created.to_string(), err.to_string());
    assert!(
        matches!(err, SqlxBrokerError::ModeNotOffered { .. }),
        "an unoffered mode must be refused as such, got: {err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("locked_until") && msg.contains("advisory_lock"),
        "{msg}"
    );
    let _ = broker.drop_tables(&table).await;
    broker.close().await;
    D::drop_database(&url).await;
}

/// One case's database, broker and table.
pub struct Fixture<D: TestDb> {
    /// The database URL.
    pub url: String,
    /// The case's first broker.
    pub broker: Broker<D::B>,
    /// The case's table.
    pub table: TableDescription,
    others: Vec<Broker<D::B>>,
}

impl<D: TestDb> Fixture<D> {
    /// Creates the table `describe`d for `mode` (after `tweak`) and returns the fixture.
    ///
    /// # Panics
    /// When the backend does not offer `mode`: [`conformance_suite!`](crate::conformance_suite)
    /// stamps a mode's cases only for backends that offer it.
    pub async fn new(mode: ClaimMode, tweak: impl FnOnce(TableBuilder) -> TableBuilder) -> Self {
        Self::build(mode, |name| tweak(describe(name, mode))).await
    }

    /// Creates the table `describe` builds for a fresh name and returns the fixture; for cases
    /// that need a description [`describe`] does not start from (e.g. no due-time column).
    ///
    /// # Panics
    /// When the backend does not offer `mode`, or the description is not of `mode`.
    pub async fn build(mode: ClaimMode, describe: impl FnOnce(&str) -> TableBuilder) -> Self {
        let url = D::database().await;
        let broker = D::connect(&url).await;
        let caps = broker.backend().capabilities();
        assert!(
            caps.offers(mode),
            "{} does not offer {mode}: the suite must not stamp this case for it",
            caps.database
        );
        let name = unique_name(match mode {
            ClaimMode::RowLock => "rl",
            ClaimMode::Lease => "ls",
            ClaimMode::Advisory => "ad",
            other => panic!("the suite has no case for claim mode {other:?}"),
        });
        let table = describe(&name)
            .build()
            .expect("the case's description is valid");
        assert_eq!(table.mode(), mode, "the case describes a table of its mode");
        broker
            .create_tables(&table)
            .await
            .expect("create the case's table");
        Self {
            url,
            broker,
            table,
            others: Vec::new(),
        }
    }

    /// The case's queue on its first broker.
    pub async fn queue(&self) -> Queue<D::B, D::Job> {
        self.broker
            .queue::<D::Job>(self.table.clone())
            .await
            .expect("prepare the case's queue")
    }

    /// Another broker (its own pool) on the same database, and its queue of the case's table.
    pub async fn other_queue(&mut self) -> Queue<D::B, D::Job> {
        let broker = D::connect(&self.url).await;
        let queue = broker
            .queue::<D::Job>(self.table.clone())
            .await
            .expect("prepare the case's queue on another broker");
        self.others.push(broker);
        queue
    }

    /// The job a case publishes as number `i`: payload `"job-{i}"`, and in advisory mode its own
    /// key `k = "k{i}"`.
    pub fn job(&self, i: usize) -> NewJob<D::Text> {
        let job = NewJob::new(D::Text::from(format!("job-{i}")));
        if self.table.mode() == ClaimMode::Advisory {
            job.column("k", format!("k{i}"))
        } else {
            job
        }
    }

    /// Publishes `n` jobs ([`job`](Self::job) 0..n) in one batch; returns their ids in order.
    pub async fn publish(&self, queue: &Queue<D::B, D::Job>, n: usize) -> Vec<i64> {
        let jobs: Vec<_> = (0..n).map(|i| self.job(i)).collect();
        queue.publish_batch(&jobs).await.expect("publish")
    }

    /// Drops the case's tables, closes its brokers and removes its database if it made one.
    pub async fn cleanup(self) {
        for b in &self.others {
            b.close().await;
        }
        let _ = self.broker.drop_tables(&self.table).await;
        self.broker.close().await;
        D::drop_database(&self.url).await;
    }
}

/// How many times each row's handler ran, as [`subscribe_counting`] records it.
pub type Runs = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<i64, usize>>>;

/// Subscribes eight workers (poll 100 ms) whose handler counts its row's run, works for
/// `work`, and acks. For fault cases that check no handler ran twice.
pub fn subscribe_counting<D: TestDb>(
    q: &Queue<D::B, D::Job>,
    work: Duration,
) -> (broker_core::Subscription, Runs) {
    let runs = Runs::default();
    let seen = runs.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(8)
                .poll_interval(Duration::from_millis(100)),
            move |job| {
                *seen.lock().unwrap().entry(job.id()).or_default() += 1;
                async move {
                    tokio::time::sleep(work).await;
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe");
    (sub, runs)
}

/// Waits (bounded by `limit`) until none of `ids` is in the queue's table. A failed read counts
/// as still there, so the wait rides out a database that is coming back.
pub async fn wait_until_rows_gone<D: TestDb>(
    q: &Queue<D::B, D::Job>,
    ids: &[i64],
    limit: Duration,
) {
    wait_until("every row gone from the table", limit, || {
        let (q, ids) = (q.clone(), ids.to_vec());
        async move {
            for id in ids {
                if q.row_state(id).await.ok().flatten().is_some() {
                    return false;
                }
            }
            true
        }
    })
    .await;
}

/// Asserts that every row `q` claimed left work through exactly one counter (see
/// [`MetricsSnapshot`](broker_core::MetricsSnapshot)). Only at rest: after every subscription
/// on the queue has shut down and no manual delivery is held.
pub fn assert_counters_add_up<B: Backend, T>(q: &Queue<B, T>) {
    let m = q.metrics();
    let out = m.acked
        + m.retried
        + m.cancelled
        + m.snoozed
        + m.dead_lettered
        + m.lease_lost
        + m.gone
        + m.settle_failed
        + m.released;
    assert_eq!(
        m.claimed, out,
        "claimed must equal acked + retried + cancelled + snoozed + dead_lettered + lease_lost + gone + settle_failed + released at rest: {m:?}"
    );
    assert_eq!(m.in_work, 0, "nothing in work at rest: {m:?}");
    assert_eq!(m.held, 0, "nothing held at rest: {m:?}");
}
