//! The MySQL / MariaDB backend: connection settings, preparation, publish, row inspection, and
//! the driver-level concerns every strategy shares (error classes, connections that must not be
//! reused after a cut-short statement).

use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::sync::Arc;

use broker_core::driver::{
    ClaimedRow, Prepared, PublishPlan, ScheduleRow, WarmConnections, connect,
};
use broker_core::{
    Backend, Broker, Capabilities, DeadLetter, ModeColumns, NewJob, Published, Result, RowState,
    SqlxBrokerError, TableDescription, Value,
};
use sqlx::mysql::{MySqlArguments, MySqlConnectOptions, MySqlPoolOptions, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::query::Query;
use sqlx::{Executor, MySql, MySqlConnection, MySqlPool, Row};
use tokio::sync::OnceCell;

use crate::advisory::MySqlAdvisory;
use crate::galera;
use crate::lease::MySqlLease;
use crate::row_lock::MySqlRowLock;
use crate::sql::{ident, micros, read_ms};
use crate::version::{self, Flavor};
use crate::{advisory, schema};

/// How many times a keyed insert runs when each conflicting row is gone by the time it is read.
const UNIQUE_TRIES: usize = 5;

/// Whether a publish failed on the unique key index (error 1062 naming it; MySQL 8.0.19+
/// prefixes the table: `for key 't.sqlx_broker_unique'`).
fn is_unique_conflict(e: &SqlxBrokerError) -> bool {
    e.sqlx_source().is_some_and(|source| {
        crate::sql::error_number(source) == Some(1062)
            && source
                .to_string()
                .contains(&format!("{}'", schema::UNIQUE_INDEX))
    })
}

/// A broker on MySQL or MariaDB.
pub type MySqlBroker = Broker<MySqlBackend>;

/// The MySQL 8.0.1+ / MariaDB 10.6+ backend: row lock, lease and advisory (`GET_LOCK`) modes.
#[derive(Debug, Clone)]
pub struct MySqlBackend {
    pool: MySqlPool,
    ids: Arc<OnceCell<IdStrategy>>,
    /// Which server this is, once known (startup reads it; the admin operations read it
    /// themselves when they run first).
    flavor: Arc<OnceCell<Flavor>>,
}

/// How a publish learns the ids of the rows it inserted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdStrategy {
    /// MariaDB 10.5+: `INSERT .. RETURNING`, many rows per statement.
    Returning,
    /// MySQL with `innodb_autoinc_lock_mode` 0 or 1: a multi-row insert of known size (a
    /// "simple insert") takes consecutive ids, `auto_increment_increment` apart, starting at
    /// `LAST_INSERT_ID()`.
    Consecutive {
        /// `@@auto_increment_increment`.
        increment: i64,
    },
    /// MySQL with `innodb_autoinc_lock_mode` 2 (MySQL 8's default): concurrent inserts
    /// interleave their ids, so only one row per statement has a known id.
    PerRow,
}

impl IdStrategy {
    /// The strategy for a server and its auto-increment settings.
    pub(crate) fn choose(flavor: Flavor, autoinc_lock_mode: i64, increment: i64) -> Self {
        match (flavor, autoinc_lock_mode) {
            (Flavor::MariaDb, _) => Self::Returning,
            (Flavor::MySql, 0 | 1) if increment >= 1 => Self::Consecutive { increment },
            (Flavor::MySql, _) => Self::PerRow,
        }
    }
}

impl MySqlBackend {
    /// A backend on an existing pool.
    ///
    /// The pool must name a database (keys are named after it, see [`lock_name`](crate::lock_name)). Its
    /// connections should keep sqlx's default session time zone, UTC (`+00:00`): startup refuses
    /// a table with a `TIMESTAMP` time column on a pool whose sessions are not UTC (see the crate
    /// docs). In row lock and advisory modes every delivery in work holds a connection, and a
    /// subscription's concurrency above three quarters of the pool is lowered to that: give the
    /// pool at least a third more connections than the subscriptions' concurrency.
    pub fn new(pool: MySqlPool) -> Self {
        Self {
            pool,
            ids: Arc::new(OnceCell::new()),
            flavor: Arc::new(OnceCell::new()),
        }
    }

    /// Connection settings for a queue database from a URL (`mysql://user:pass@host/db`), with
    /// the session time zone set to UTC (sqlx's default, made explicit).
    /// The URL must be a `mysql://` or `mariadb://` one.
    pub fn connect_options(url: &str) -> Result<MySqlConnectOptions> {
        connect::check_scheme(url, DATABASE, false)?;
        let options = MySqlConnectOptions::from_str(url).map_err(connect_error)?;
        Ok(options.timezone(Some("+00:00".to_owned())))
    }

    /// Opens a pool of 16 connections on `url` with [`connect_options`](Self::connect_options)
    /// and returns a broker on it. One connection is opened first, so a wrong port, host or
    /// password fails within seconds with its cause ([`SqlxBrokerError::Connect`]) instead of
    /// after the pool's 30 s acquire timeout.
    pub async fn connect(url: &str) -> Result<MySqlBroker> {
        let options = Self::connect_options(url)?;
        connect::first_connection(&options, DATABASE).await?;
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .connect_with(options)
            .await
            .map_err(connect_error)?;
        Ok(Broker::owning_pool(Self::new(pool)))
    }

    /// The name `key` is locked under in advisory mode: the pool's database name and the key
    /// (see [`lock_name`](crate::lock_name)). `None` when the pool names no database.
    pub fn lock_name(&self, key: &str) -> Option<String> {
        self.pool
            .connect_options()
            .get_database()
            .map(|db| advisory::lock_name(db, key))
    }

    /// Whether any session holds the advisory key `key` now (`IS_USED_LOCK`), on any broker or
    /// process on this database.
    pub async fn is_key_held(&self, key: &str) -> Result<bool> {
        let Some(name) = self.lock_name(key) else {
            return Ok(false);
        };
        let holder: Option<i64> = sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS SIGNED)")
            .bind(name)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| SqlxBrokerError::statement("", "key probe", e))?;
        Ok(holder.is_some())
    }

    /// Test hook: publish as MySQL would, on a MariaDB server.
    #[doc(hidden)]
    pub fn publish_like_mysql(self, autoinc_lock_mode: i64) -> Self {
        let ids = OnceCell::new();
        let _ = ids.set(IdStrategy::choose(Flavor::MySql, autoinc_lock_mode, 1));
        Self {
            pool: self.pool,
            ids: Arc::new(ids),
            flavor: self.flavor,
        }
    }

    async fn id_strategy(&self, conn: &mut MySqlConnection, table: &str) -> Result<IdStrategy> {
        self.ids
            .get_or_try_init(|| async {
                let (found, mode, increment): (String, i64, i64) = sqlx::query_as(
                    "SELECT VERSION(), CAST(@@innodb_autoinc_lock_mode AS SIGNED), \
                     CAST(@@auto_increment_increment AS SIGNED)",
                )
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| SqlxBrokerError::statement(table, "publish", e))?;
                let flavor = version::parse(&found).map_or(Flavor::MySql, |s| s.flavor);
                Ok(IdStrategy::choose(flavor, mode, increment))
            })
            .await
            .copied()
    }
}

/// The database this backend's connect errors name.
const DATABASE: &str = "MySQL/MariaDB";

fn connect_error(source: sqlx::Error) -> SqlxBrokerError {
    SqlxBrokerError::connect(DATABASE, source)
}

/// A pool connection that is closed, not returned to the pool, if the statements on it are cut
/// short (their future dropped): sqlx-mysql could otherwise hand the connection's next user a
/// reply meant for the dropped statement. [`finish`](Self::finish) marks the work done.
pub(crate) struct Conn {
    conn: Option<PoolConnection<MySql>>,
    armed: bool,
}

const HELD: &str = "a guarded connection is held until it is finished or taken";

impl Conn {
    pub(crate) async fn acquire(pool: &MySqlPool, table: &str) -> Result<Self> {
        // Inside a fenced settlement, waited for only until its deadline.
        let conn = broker_core::driver::retry::acquire(pool)
            .await
            .map_err(|e| SqlxBrokerError::statement(table, "acquire", e))?;
        Ok(Self::guard(conn))
    }

    /// A connection `warm` kept from the last statement, else one from `pool`.
    pub(crate) async fn from_warm(
        warm: &WarmConnections<PoolConnection<MySql>>,
        pool: &MySqlPool,
        table: &str,
    ) -> Result<Self> {
        let conn = warm
            .acquire(pool)
            .await
            .map_err(|e| SqlxBrokerError::statement(table, "acquire", e))?;
        Ok(Self::guard(conn))
    }

    /// After statements that went well (`ok`), keeps the connection in `warm` for the next;
    /// otherwise gives it and every kept one back to the pool (the server may have dropped
    /// them all).
    pub(crate) fn done_into(self, warm: &WarmConnections<PoolConnection<MySql>>, ok: bool) {
        warm.keep_if(self.into_inner(), ok);
    }

    /// Guards a connection taken elsewhere.
    pub(crate) fn guard(conn: PoolConnection<MySql>) -> Self {
        Self {
            conn: Some(conn),
            armed: true,
        }
    }

    /// The statements finished (with or without an error): the connection may go back.
    pub(crate) fn finish(mut self) {
        self.armed = false;
    }

    /// The connection, for keeping (a key lock); its new owner guards it.
    pub(crate) fn into_inner(mut self) -> PoolConnection<MySql> {
        self.armed = false;
        self.conn.take().expect(HELD)
    }
}

impl Deref for Conn {
    type Target = MySqlConnection;
    fn deref(&self) -> &MySqlConnection {
        self.conn.as_ref().expect(HELD)
    }
}

impl DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        self.conn.as_mut().expect(HELD)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.armed
            && let Some(conn) = &mut self.conn
        {
            conn.close_on_drop();
        }
    }
}

/// Reads the broker's columns of a claimed row.
pub(crate) fn claimed(
    table: &TableDescription,
    row: MySqlRow,
    key: Option<String>,
) -> Result<ClaimedRow<MySql>> {
    ClaimedRow::read(row, key).map_err(|e| SqlxBrokerError::statement(table.name(), "claim", e))
}

/// attempt, locked_until, due_at, processed, dead.
type StateRow = (i64, Option<i64>, Option<i64>, i64, i64);

/// Binds one publish value.
fn bind_value<'q>(
    q: Query<'q, MySql, MySqlArguments>,
    value: Value,
    is_due: bool,
) -> Query<'q, MySql, MySqlArguments> {
    match value {
        Value::Null => q.bind(None::<i64>),
        Value::Text(s) => q.bind(s),
        Value::BigInt(i) if is_due => q.bind(micros(i)),
        Value::BigInt(i) => q.bind(i),
    }
}

impl Backend for MySqlBackend {
    type Db = MySql;

    type Admin<'a> = crate::admin::MySqlAdmin<'a>;

    fn admin(&self) -> Self::Admin<'_> {
        crate::admin::MySqlAdmin {
            pool: &self.pool,
            flavor: &self.flavor,
        }
    }

    type RowLock = MySqlRowLock;
    type Lease = MySqlLease;
    type Advisory = MySqlAdvisory;

    fn classify(&self, error: &sqlx::Error) -> broker_core::driver::ErrorClass {
        crate::sql::classify(error)
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::default_for("MySQL/MariaDB");
        caps.row_lock = true;
        caps.process_local_keys = false;
        caps.cross_process_wakeups = false;
        caps
    }

    fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    fn check_names(&self, table: &TableDescription) -> Result<()> {
        // MySQL and MariaDB refuse table and column names over 64 characters; refusing them here
        // names the description instead of failing inside a statement.
        table.check_name_lengths("MySQL / MariaDB", 64, "characters", |n| n.chars().count())
    }

    async fn payload_probe(&self, table: &TableDescription) -> Option<MySqlRow> {
        let (payload, _) = table.payload()?;
        let sql = broker_core::driver::payload_probe_sql(&ident(table.name()), &ident(payload));
        let mut conn = Conn::acquire(&self.pool, table.name()).await.ok()?;
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_optional(&mut *conn)
            .await;
        conn.finish();
        row.ok().flatten()
    }

    async fn prepare(&self, table: &Arc<TableDescription>) -> Result<Prepared<Self>> {
        let mut conn = Conn::acquire(&self.pool, table.name()).await?;
        let out = self.prepare_on(&mut conn, table).await;
        conn.finish();
        out
    }

    async fn publish<'c, P>(
        &self,
        conn: &'c mut MySqlConnection,
        table: &TableDescription,
        jobs: &[NewJob<P>],
    ) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, MySql> + sqlx::Type<MySql> + Send + Sync,
    {
        let plan = PublishPlan::new(table, jobs)?;
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let strategy = self.id_strategy(conn, table.name()).await?;
        let err = |e| SqlxBrokerError::statement(table.name(), "publish", e);
        let due = table.due_at();
        let placeholders: Vec<&str> = plan
            .columns()
            .iter()
            .map(|c| {
                if Some(c.as_str()) == due {
                    "TIMESTAMPADD(MICROSECOND, ?, CAST('1970-01-01 00:00:00' AS DATETIME(6)))"
                } else {
                    "?"
                }
            })
            .collect();
        let row = format!("({})", placeholders.join(", "));
        let head = format!(
            "INSERT INTO {} ({}) VALUES ",
            ident(table.name()),
            plan.columns()
                .iter()
                .map(|c| ident(c))
                .collect::<Vec<_>>()
                .join(", "),
        );
        // Stay well under the 65,535 placeholders of one prepared statement.
        let per_statement = match strategy {
            IdStrategy::PerRow => 1,
            _ => (60_000 / plan.width()).clamp(1, 500),
        };
        let mut ids = Vec::with_capacity(jobs.len());
        for chunk in jobs.chunks(per_statement) {
            let mut sql = format!("{head}{}", vec![row.as_str(); chunk.len()].join(", "));
            if strategy == IdStrategy::Returning {
                // -- needs INSERT .. RETURNING: MariaDB 10.5
                sql.push_str(&format!(" RETURNING CAST({} AS SIGNED)", ident(table.id())));
            }
            let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
            for job in chunk {
                q = q.bind(job.payload());
                let columns = &plan.columns()[1..];
                for (value, column) in plan.values(job).into_iter().zip(columns) {
                    q = bind_value(q, value, Some(column.as_str()) == due);
                }
            }
            match strategy {
                IdStrategy::Returning => {
                    let rows = q.fetch_all(&mut *conn).await.map_err(err)?;
                    let mut got = rows
                        .iter()
                        .map(|r| r.try_get::<i64, _>(0))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(err)?;
                    // Ids grow with the rows of one statement; RETURNING's order is not promised.
                    got.sort_unstable();
                    ids.extend(got);
                }
                IdStrategy::Consecutive { .. } | IdStrategy::PerRow => {
                    let increment = match strategy {
                        IdStrategy::Consecutive { increment } => increment,
                        _ => 1,
                    };
                    let done = q.execute(&mut *conn).await.map_err(err)?;
                    let first = i64::try_from(done.last_insert_id()).unwrap_or(0);
                    if first == 0 || done.rows_affected() != chunk.len() as u64 {
                        return Err(SqlxBrokerError::Unsupported {
                            table: table.name().to_owned(),
                            message: format!(
                                "the insert did not report its ids (LAST_INSERT_ID() = {first}, {} rows); make the id column \"{}\" AUTO_INCREMENT",
                                done.rows_affected(),
                                table.id()
                            ),
                        });
                    }
                    let mut next = first;
                    for _ in chunk {
                        ids.push(next);
                        next = next.saturating_add(increment);
                    }
                }
            }
        }
        Ok(ids)
    }

    async fn publish_unique<'c, P>(
        &self,
        conn: &'c mut MySqlConnection,
        table: &TableDescription,
        job: &NewJob<P>,
    ) -> Result<Published>
    where
        P: for<'q> sqlx::Encode<'q, MySql> + sqlx::Type<MySql> + Send + Sync,
    {
        let one = std::slice::from_ref(job);
        PublishPlan::new(table, one)?;
        let (Some(column), Some(key)) = (table.unique_key(), job.unique_key_value()) else {
            let ids = self.publish(conn, table, one).await?;
            let id = ids.first().copied().unwrap_or_default();
            return Ok(Published {
                id,
                duplicate: false,
            });
        };
        // Read through the unique index: the generated column where rows finish in place.
        let indexed = if table.unfinished_columns().is_empty() {
            column
        } else {
            schema::UNIQUE_LIVE_COLUMN
        };
        let existing = format!(
            "SELECT CAST({} AS SIGNED) FROM {} WHERE {} = ? LIMIT 1",
            ident(table.id()),
            ident(table.name()),
            ident(indexed),
        );
        // The conflicting row may finish between the two statements; then the insert runs again.
        for _ in 0..UNIQUE_TRIES {
            // A plain insert: a duplicate fails with 1062 on the unique index, and InnoDB rolls
            // back that statement alone, so the caller's transaction goes on. (INSERT IGNORE
            // would also turn a value too long for its column into a warning and a cut value.)
            match self.publish(conn, table, one).await {
                Ok(ids) => {
                    let id = ids.first().copied().unwrap_or_default();
                    return Ok(Published {
                        id,
                        duplicate: false,
                    });
                }
                Err(e) if is_unique_conflict(&e) => {}
                Err(e) => return Err(e),
            }
            let found: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(existing.clone()))
                .bind(key)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| SqlxBrokerError::statement(table.name(), "publish unique", e))?;
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
                "the key \"{key}\" conflicted {UNIQUE_TRIES} times with a row that was gone when read; at REPEATABLE READ a transaction does not see rows committed after its first read, so publish unique jobs from a READ COMMITTED one"
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
        conn: &mut MySqlConnection,
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
        let t = ident(table.name());
        let time = |c: Option<&str>| c.map_or("NULL".to_owned(), |c| read_ms(&ident(c)));
        let is_set = |c: Option<&str>| {
            c.map_or("0".to_owned(), |c| {
                format!("CAST({} IS NOT NULL AS SIGNED)", ident(c))
            })
        };
        let dead_col = match table.dead_letter() {
            Some(DeadLetter::Column(c)) => Some(c.as_str()),
            _ => None,
        };
        let sql = format!(
            "SELECT CAST({} AS SIGNED), {}, {}, {}, {} FROM {t} WHERE {} = ?",
            ident(table.attempt()),
            time(table.locked_until()),
            time(table.due_at()),
            is_set(table.processed_at()),
            is_set(dead_col),
            ident(table.id()),
        );
        let err = |e| SqlxBrokerError::statement(table.name(), "row state", e);
        let row: Option<StateRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        if let Some((attempt, lu, due, processed, dead)) = row {
            return Ok(Some(RowState::new(
                attempt,
                lu,
                due,
                processed != 0,
                dead != 0,
            )));
        }
        if let Some(DeadLetter::Table(d)) = table.dead_letter() {
            let sql = format!(
                "SELECT CAST({} AS SIGNED) FROM {} WHERE {} = ?",
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
        let mut conn = Conn::acquire(&self.pool, "").await?;
        for sql in statements {
            match conn.execute(sqlx::AssertSqlSafe(sql.clone())).await {
                Ok(_) => {}
                // No control table (the queue's tables were made by hand): no pause to delete.
                Err(e)
                    if broker_core::driver::is_unpause_ddl(sql)
                        && crate::sql::error_number(&e) == Some(1146) => {}
                Err(e) => {
                    conn.finish();
                    return Err(SqlxBrokerError::ddl(sql, e));
                }
            }
        }
        conn.finish();
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
        // MySQL has no LISTEN/NOTIFY: other processes' rows are found by the poll.
        Ok(None)
    }
}

impl MySqlBackend {
    async fn prepare_on(
        &self,
        conn: &mut MySqlConnection,
        table: &Arc<TableDescription>,
    ) -> Result<Prepared<Self>> {
        let name = table.name();
        let (found, database, utc): (String, Option<String>, i64) = sqlx::query_as(
            // The session converts DATETIME to TIMESTAMP as UTC iff both a winter and a summer
            // date map to their UTC epoch seconds.
            "SELECT VERSION(), DATABASE(), \
             CAST(UNIX_TIMESTAMP('2000-01-01 00:00:00') = 946684800 \
              AND UNIX_TIMESTAMP('2000-07-01 00:00:00') = 962409600 AS SIGNED)",
        )
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| SqlxBrokerError::statement(name, "version", e))?;
        let server = version::check(&found)?;
        let _ = self.flavor.set(server.flavor);
        let Some(database) = database else {
            return Err(SqlxBrokerError::Setup {
                table: name.to_owned(),
                what:
                    "the connection has no default database; name it in the URL (mysql://host/db)"
                        .into(),
            });
        };
        if let Some(node) = galera::node(conn)
            .await
            .map_err(|e| SqlxBrokerError::statement(name, "galera", e))?
        {
            galera::check_mode(table, &node)?;
        }
        schema::check_table(conn, table, utc != 0).await?;
        let group_index = schema::group_index(conn, table).await?;
        broker_core::driver::indexes::warn(table.name(), schema::index_advice(conn, table).await);
        let group_index = group_index.as_deref();
        let prepared = match table.mode_columns() {
            ModeColumns::RowLock => {
                let s = MySqlRowLock::new(self.pool.clone(), table.clone(), group_index);
                schema::check_statements(conn, table, &s.statements()).await?;
                Prepared::RowLock(s)
            }
            ModeColumns::Lease { locked_until } => {
                let mariadb = server.flavor == Flavor::MariaDb;
                let s = MySqlLease::new(
                    self.pool.clone(),
                    table.clone(),
                    locked_until,
                    group_index,
                    mariadb,
                );
                schema::check_statements(conn, table, &s.statements()).await?;
                Prepared::Lease(s)
            }
            ModeColumns::Advisory { key } => {
                let s = MySqlAdvisory::new(
                    self.pool.clone(),
                    table.clone(),
                    key,
                    database,
                    group_index,
                );
                schema::check_statements(conn, table, &s.statements()).await?;
                Prepared::Advisory(s)
            }
            other => {
                return Err(SqlxBrokerError::mode_not_offered(
                    table.name(),
                    other.mode(),
                    self.capabilities().database,
                ));
            }
        };
        Ok(prepared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_back_by_returning_on_mariadb_and_safely_on_mysql() {
        assert_eq!(
            IdStrategy::choose(Flavor::MariaDb, 2, 1),
            IdStrategy::Returning
        );
        assert_eq!(
            IdStrategy::choose(Flavor::MySql, 1, 2),
            IdStrategy::Consecutive { increment: 2 }
        );
        assert_eq!(
            IdStrategy::choose(Flavor::MySql, 0, 1),
            IdStrategy::Consecutive { increment: 1 }
        );
        // MySQL 8's default interleaves ids across concurrent inserts.
        assert_eq!(IdStrategy::choose(Flavor::MySql, 2, 1), IdStrategy::PerRow);
    }
}
