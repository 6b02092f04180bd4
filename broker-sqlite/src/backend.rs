//! The SQLite backend: connection settings, preparation, publish, and row inspection.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use broker_core::driver::{
    ClaimedRow, NotOffered, Prepared, ScheduleRow, WarmConnections, connect,
};
use broker_core::{
    Backend, Broker, Capabilities, ClaimMode, DeadLetter, ModeColumns, NewJob, Published, Result,
    RowState, SqlxBrokerError, TableDescription, Value,
};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow};
use sqlx::{Executor, Sqlite, SqliteConnection, SqlitePool};

use crate::advisory::SqliteAdvisory;
use crate::keys::{KeyTable, WriteTurn};
use crate::lease::SqliteLease;
use crate::sql::ident;
use crate::{schema, version};

/// The database this backend's connect errors name.
const DATABASE: &str = "SQLite";

/// A connect error that says what to check about the file (`file`, and whether the pool would
/// create it): a missing folder, a missing file, or its rights. There is no server to be up.
fn connect_error(file: Option<(&std::path::Path, bool)>, source: sqlx::Error) -> SqlxBrokerError {
    let hint = match file {
        Some((file, _))
            if file
                .to_str()
                .is_some_and(|f| f.contains(":memory:") || f.starts_with("file:")) =>
        {
            "check the URL".to_owned()
        }
        Some((file, create)) => {
            let folder = file
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            if !folder.is_dir() {
                format!(
                    "the folder {} does not exist: create it, or fix the path in the URL",
                    folder.display()
                )
            } else if !create && !file.exists() {
                format!(
                    "the file {} does not exist (nothing was created): fix the path in the URL, or create the queue with SqliteBackend::connect",
                    file.display()
                )
            } else {
                format!(
                    "check that {} is a SQLite database and that this process may read and write it and its folder",
                    file.display()
                )
            }
        }
        None => "fix the URL (sqlite:path/to/file.db or a file path)".to_owned(),
    };
    SqlxBrokerError::Connect {
        database: DATABASE,
        hint,
        source,
    }
}

/// How many times a keyed insert runs when each conflicting row is gone by the time it is read.
const UNIQUE_TRIES: usize = 5;

/// A broker on SQLite.
pub type SqliteBroker = Broker<SqliteBackend>;

/// The SQLite backend: lease and advisory modes (no row locks), keys held in this process.
#[derive(Debug, Clone)]
pub struct SqliteBackend {
    pool: SqlitePool,
    keys: Arc<KeyTable>,
}

impl SqliteBackend {
    /// A backend on an existing pool. Its connections should use WAL and a busy timeout (see
    /// [`SqliteBackend::connect_options`]).
    pub fn new(pool: SqlitePool) -> Self {
        let keys = KeyTable::for_file(pool.connect_options().get_filename());
        Self { pool, keys }
    }

    /// Connection settings for a queue database: created if missing, WAL (readers never block
    /// the writer), and a busy timeout, so concurrent workers wait for the one writer instead of
    /// failing with "database is locked". The URL is a `sqlite:` one or a file path.
    pub fn connect_options(url: &str) -> Result<SqliteConnectOptions> {
        connect::check_scheme(url, DATABASE, true)?;
        let options = SqliteConnectOptions::from_str(url).map_err(|e| connect_error(None, e))?;
        Ok(options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30)))
    }

    /// Opens a pool on `url` (e.g. `sqlite:jobs.db`) with [`connect_options`](Self::connect_options)
    /// and returns a broker on it. The file is created if missing; its folder must exist.
    pub async fn connect(url: &str) -> Result<SqliteBroker> {
        Self::open(Self::connect_options(url)?, true).await
    }

    /// Opens a pool on the database file `url` names only if the file exists, and returns a
    /// broker on it: for tools that inspect a queue (the CLI, the doctor), which must never
    /// leave an empty file behind where a path was mistyped. The journal mode is left as the
    /// file has it.
    pub async fn connect_existing(url: &str) -> Result<SqliteBroker> {
        connect::check_scheme(url, DATABASE, true)?;
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| connect_error(None, e))?
            .create_if_missing(false)
            .busy_timeout(Duration::from_secs(30));
        Self::open(options, false).await
    }

    /// Opens the pool after one connection (`create`: whether the options create the file).
    async fn open(options: SqliteConnectOptions, create: bool) -> Result<SqliteBroker> {
        let file = options.get_filename().to_owned();
        connect::first_connection(&options, DATABASE)
            .await
            .map_err(|e| match e {
                SqlxBrokerError::Connect { source, .. } => {
                    connect_error(Some((&file, create)), source)
                }
                other => other,
            })?;
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .map_err(|e| connect_error(Some((&file, create)), e))?;
        Ok(Broker::owning_pool(Self::new(pool)))
    }

    /// How many advisory keys this process holds in the backend's database file now.
    pub fn held_keys(&self) -> usize {
        self.keys.len()
    }

    /// Whether any subscription of this process holds the advisory key `key` in the backend's
    /// database file now. Keys are held in the process (see the crate docs), so this asks no
    /// statement of the database and never fails; it is async and returns a `Result` to have
    /// the signature of `is_key_held` on the other backends.
    pub async fn is_key_held(&self, key: &str) -> Result<bool> {
        Ok(self.keys.is_held(key))
    }
}

/// attempt, locked_until, due_at, processed, dead.
type StateRow = (i64, Option<i64>, Option<i64>, bool, bool);

/// Reads the broker's columns of a claimed row.
pub(crate) fn claimed(
    table: &TableDescription,
    row: SqliteRow,
    key: Option<String>,
) -> Result<ClaimedRow<Sqlite>> {
    ClaimedRow::read(row, key).map_err(|e| SqlxBrokerError::statement(table.name(), "claim", e))
}

/// Connections a strategy keeps from one statement to the next. On SQLite the pool's round trip
/// is a hop to the connection's worker thread, and every connection keeps a page cache of its
/// own that another connection's write makes it read again: a claim and an ack on two pooled
/// connections read the file's pages again where a loop on one connection does not (five reads
/// of the file per row in the lease bench at one worker, against none).
pub(crate) type Warm = WarmConnections<PoolConnection<Sqlite>>;

/// The connection kept last, or one from the pool.
pub(crate) async fn warm_conn(
    warm: &Warm,
    pool: &SqlitePool,
    table: &str,
) -> Result<PoolConnection<Sqlite>> {
    warm.acquire(pool)
        .await
        .map_err(|e| SqlxBrokerError::statement(table, "acquire", e))
}

/// A connection to write on (the one kept last, or one from the pool), then this process's turn
/// to write to the file (see [`KeyTable::write_turn`]). In that order: a writer that waits for
/// the pool while it holds the turn stops every writer of the file until a connection comes
/// back, and with many subscriptions on one pool the connections out are mostly kept by other
/// subscriptions for their next statement, which go back only when they have waited a quarter
/// second.
pub(crate) async fn write_conn<'f>(
    warm: &Warm,
    pool: &SqlitePool,
    file: &'f KeyTable,
    table: &str,
) -> Result<(PoolConnection<Sqlite>, WriteTurn<'f>)> {
    let conn = warm_conn(warm, pool, table).await?;
    Ok((conn, file.write_turn().await))
}

async fn acquire(pool: &SqlitePool, table: &str) -> Result<sqlx::pool::PoolConnection<Sqlite>> {
    pool.acquire()
        .await
        .map_err(|e| SqlxBrokerError::statement(table, "acquire", e))
}

impl Backend for SqliteBackend {
    type Db = Sqlite;

    type Admin<'a> = crate::admin::SqliteAdmin<'a>;

    fn admin(&self) -> Self::Admin<'_> {
        crate::admin::SqliteAdmin {
            pool: &self.pool,
            file: &self.keys,
        }
    }

    type RowLock = NotOffered<Sqlite>;
    type Lease = SqliteLease;
    type Advisory = SqliteAdvisory;

    fn classify(&self, error: &sqlx::Error) -> broker_core::driver::ErrorClass {
        crate::sql::classify(error)
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::default_for("SQLite");
        caps.row_lock = false;
        caps.process_local_keys = true;
        caps.cross_process_wakeups = false;
        caps
    }

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn payload_probe(&self, table: &TableDescription) -> Option<SqliteRow> {
        let (payload, _) = table.payload()?;
        let sql = broker_core::driver::payload_probe_sql(&ident(table.name()), &ident(payload));
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await
            .ok()
            .flatten()
    }

    async fn prepare(&self, table: &Arc<TableDescription>) -> Result<Prepared<Self>> {
        let mut conn = acquire(&self.pool, table.name()).await?;
        let found: String = sqlx::query_scalar("SELECT sqlite_version()")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| SqlxBrokerError::statement(table.name(), "version", e))?;
        version::check(&found)?;
        let strategy = match table.mode_columns() {
            ModeColumns::Lease { locked_until } => {
                let s = SqliteLease::new(
                    self.pool.clone(),
                    table.clone(),
                    locked_until,
                    self.keys.clone(),
                );
                schema::check(&mut conn, table, &s.statements()).await?;
                Prepared::Lease(s)
            }
            ModeColumns::Advisory { key } => {
                let s =
                    SqliteAdvisory::new(self.pool.clone(), table.clone(), key, self.keys.clone());
                schema::check(&mut conn, table, &s.statements()).await?;
                Prepared::Advisory(s)
            }
            ModeColumns::RowLock => {
                return Err(SqlxBrokerError::ModeNotOffered {
                    table: table.name().to_owned(),
                    mode: ClaimMode::RowLock,
                    database: "SQLite",
                    hint: "SQLite has no row locks; add a locked_until column (lease mode) or an advisory_lock template",
                });
            }
            other => {
                return Err(SqlxBrokerError::mode_not_offered(
                    table.name(),
                    other.mode(),
                    self.capabilities().database,
                ));
            }
        };
        broker_core::driver::indexes::warn(
            table.name(),
            schema::index_advice(&mut conn, table).await,
        );
        Ok(strategy)
    }

    async fn publish<'c, P>(
        &self,
        conn: &'c mut SqliteConnection,
        table: &TableDescription,
        jobs: &[NewJob<P>],
    ) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, Sqlite> + sqlx::Type<Sqlite> + Send + Sync,
    {
        let plan = broker_core::driver::PublishPlan::new(table, jobs)?;
        let mut ids = Vec::with_capacity(jobs.len());
        // Stay well under SQLite's bound-parameter limit.
        let per_statement = (30_000 / plan.width()).clamp(1, 500);
        for chunk in jobs.chunks(per_statement) {
            let row = format!("({})", vec!["?"; plan.width()].join(", "));
            let sql = format!(
                "INSERT INTO {} ({}) VALUES {} RETURNING {}",
                ident(table.name()),
                plan.columns()
                    .iter()
                    .map(|c| ident(c))
                    .collect::<Vec<_>>()
                    .join(", "),
                vec![row; chunk.len()].join(", "),
                ident(table.id()),
            );
            let mut q = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql));
            for job in chunk {
                q = q.bind(job.payload());
                for value in plan.values(job) {
                    q = match value {
                        Value::Null => q.bind(None::<i64>),
                        Value::Text(s) => q.bind(s),
                        Value::BigInt(i) => q.bind(i),
                    };
                }
            }
            ids.extend(
                q.fetch_all(&mut *conn)
                    .await
                    .map_err(|e| SqlxBrokerError::statement(table.name(), "publish", e))?,
            );
        }
        // RETURNING hands rows back in no promised order; ids grow with insertion order.
        ids.sort_unstable();
        Ok(ids)
    }

    async fn publish_unique<'c, P>(
        &self,
        conn: &'c mut SqliteConnection,
        table: &TableDescription,
        job: &NewJob<P>,
    ) -> Result<Published>
    where
        P: for<'q> sqlx::Encode<'q, Sqlite> + sqlx::Type<Sqlite> + Send + Sync,
    {
        let plan = broker_core::driver::PublishPlan::new(table, std::slice::from_ref(job))?;
        let (Some(column), Some(key)) = (table.unique_key(), job.unique_key_value()) else {
            let ids = self.publish(conn, table, std::slice::from_ref(job)).await?;
            let id = ids.first().copied().unwrap_or_default();
            return Ok(Published {
                id,
                duplicate: false,
            });
        };
        let err = |e| SqlxBrokerError::statement(table.name(), "publish unique", e);
        // No conflict target: DO NOTHING covers the partial unique index over unfinished rows.
        let insert = format!(
            "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT DO NOTHING RETURNING {}",
            ident(table.name()),
            plan.columns()
                .iter()
                .map(|c| ident(c))
                .collect::<Vec<_>>()
                .join(", "),
            vec!["?"; plan.width()].join(", "),
            ident(table.id()),
        );
        let unfinished: String = table
            .unfinished_columns()
            .into_iter()
            .map(|c| format!(" AND {} IS NULL", ident(c)))
            .collect();
        let existing = format!(
            "SELECT {} FROM {} WHERE {} = ?1{unfinished}",
            ident(table.id()),
            ident(table.name()),
            ident(column),
        );
        // The conflicting row may finish between the two statements; then the insert runs again.
        for _ in 0..UNIQUE_TRIES {
            let mut q = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(insert.clone()))
                .bind(job.payload());
            for value in plan.values(job) {
                q = match value {
                    Value::Null => q.bind(None::<i64>),
                    Value::Text(s) => q.bind(s),
                    Value::BigInt(i) => q.bind(i),
                };
            }
            if let Some(id) = q.fetch_optional(&mut *conn).await.map_err(err)? {
                return Ok(Published {
                    id,
                    duplicate: false,
                });
            }
            let found: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(existing.clone()))
                .bind(key)
                .fetch_optional(&mut *conn)
                .await
                .map_err(err)?;
            if let Some(id) = found {
                return Ok(Published {
                    id,
                    duplicate: true,
                });
            }
        }
        Err(SqlxBrokerError::Invariant {
            table: table.name().to_owned(),
            statement: "publish unique",
            what: format!(
                "the key \"{key}\" conflicted {UNIQUE_TRIES} times with a row that was gone when read; check for another unique index on the table"
            ),
        })
    }

    async fn register_schedule(&self, row: &ScheduleRow) -> Result<ScheduleRow> {
        crate::schedule::STATEMENTS
            .register(&self.pool, true, row)
            .await
    }

    async fn record_tick(
        &self,
        conn: &mut SqliteConnection,
        name: &str,
        tick_ms: i64,
        prune_before_ms: i64,
    ) -> Result<bool> {
        crate::schedule::STATEMENTS
            .record_tick(conn, true, name, tick_ms, prune_before_ms)
            .await
    }

    async fn schedules(&self) -> Result<Vec<ScheduleRow>> {
        crate::schedule::STATEMENTS.list(&self.pool, true).await
    }

    async fn row_state(&self, table: &TableDescription, id: i64) -> Result<Option<RowState>> {
        let time = |c: Option<&str>| c.map_or("NULL".to_owned(), ident);
        let is_set =
            |c: Option<&str>| c.map_or("0".to_owned(), |c| format!("{} IS NOT NULL", ident(c)));
        let dead_col = match table.dead_letter() {
            Some(DeadLetter::Column(c)) => Some(c.as_str()),
            _ => None,
        };
        let sql = format!(
            "SELECT {}, {}, {}, {}, {} FROM {} WHERE {} = ?1",
            ident(table.attempt()),
            time(table.locked_until()),
            time(table.due_at()),
            is_set(table.processed_at()),
            is_set(dead_col),
            ident(table.name()),
            ident(table.id()),
        );
        let err = |e| SqlxBrokerError::statement(table.name(), "row state", e);
        let row: Option<StateRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        if let Some((attempt, lu, due, processed, dead)) = row {
            return Ok(Some(RowState::new(attempt, lu, due, processed, dead)));
        }
        if let Some(DeadLetter::Table(d)) = table.dead_letter() {
            let sql = format!(
                "SELECT {} FROM {} WHERE {} = ?1",
                ident(table.attempt()),
                ident(d),
                ident(table.id())
            );
            let attempt: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(err)?;
            return Ok(attempt.map(|a| RowState::new(a, None, None, false, true)));
        }
        Ok(None)
    }

    fn ddl(&self, table: &TableDescription) -> Vec<String> {
        schema::ddl(table)
    }

    fn drop_ddl(&self, table: &TableDescription) -> Vec<String> {
        schema::drop_ddl(table)
    }

    async fn execute_ddl(&self, statements: &[String]) -> Result<()> {
        let mut conn = acquire(&self.pool, "").await?;
        for sql in statements {
            match conn.execute(sqlx::AssertSqlSafe(sql.clone())).await {
                Ok(_) => {}
                // No control table (the queue's tables were made by hand): no pause to delete.
                Err(sqlx::Error::Database(e))
                    if broker_core::driver::is_unpause_ddl(sql)
                        && e.message().contains("no such table") => {}
                Err(e) => return Err(SqlxBrokerError::ddl(sql, e)),
            }
        }
        Ok(())
    }

    async fn doctor(
        &self,
        table: &TableDescription,
        options: &broker_core::DoctorOptions,
    ) -> Vec<broker_core::Check> {
        crate::doctor::checks(&self.pool, table, options).await
    }

    async fn listen(
        &self,
        _table: &Arc<TableDescription>,
        _wakeup: Arc<broker_core::driver::Wakeup>,
    ) -> Result<Option<broker_core::driver::Listening>> {
        // One process per file is the design; wake-ups within it come from publish.
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::sqlite::SqlitePoolOptions;

    use super::Warm;

    /// Waits, a bounded while, for the pool to hold `idle` idle connections (a connection
    /// dropped out of the pool goes back on a task of its own).
    async fn idle(pool: &sqlx::SqlitePool, idle: usize) {
        for _ in 0..500 {
            if pool.num_idle() == idle {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "the pool holds {} idle connections, not {idle}",
            pool.num_idle()
        );
    }

    #[tokio::test]
    async fn a_connection_is_kept_only_while_the_pool_has_one_to_spare() {
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let warm = Warm::for_pool(&pool);
        let a = pool.acquire().await.unwrap();
        let b = pool.acquire().await.unwrap();
        // Both connections out: another statement would wait for one, so `a` goes back.
        warm.keep(a);
        assert_eq!(
            warm.len(),
            0,
            "kept a connection the pool had none to spare for"
        );
        idle(&pool, 1).await;
        // One idle in the pool: `b` is kept for the next statement.
        warm.keep(b);
        assert_eq!(warm.len(), 1);
        assert_eq!(pool.num_idle(), 1);
    }
}
