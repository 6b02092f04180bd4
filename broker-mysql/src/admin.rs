//! Operating a MySQL / MariaDB queue: counts by state, listings, and changes to rows outside the
//! claim path, each fenced as a settlement is (see `broker_core::admin`).
//!
//! What "in work" means on MySQL and MariaDB, and how exact it is:
//! - lease: a `locked_until` after now (exact, on the host's clock);
//! - advisory: a row whose key's lock name is in use (`IS_USED_LOCK`, on the name the claim
//!   locks: `"<database>:<key>"`, or its SHA-256 past 64 characters, see
//!   [`lock_name`](crate::lock_name)), counted once per held key (one delivery per key); rows
//!   waiting behind a held key count as due. Each key is asked once per statement (a key freed
//!   while the statement runs must not count its rows twice). A key held by a session that is
//!   no delivery (another table with the same key, an operator's `GET_LOCK`) counts too;
//! - row lock: neither server lists the row locks other transactions hold in a way every
//!   supported version shares (MariaDB has no `performance_schema.data_locks`; its
//!   `INNODB_LOCKS` shows only locks someone waits for). So a row is in work when a shared
//!   locking read with `SKIP LOCKED` through the primary key passes over it (`LOCK IN SHARE MODE
//!   SKIP LOCKED` on MariaDB 10.6+, `FOR SHARE SKIP LOCKED` on MySQL 8.0.1+): a delivery's
//!   transaction holds it `FOR UPDATE`. The read runs at READ COMMITTED and waits for no lock;
//!   while the statement runs it holds a shared lock on each free row it read, which a claim's
//!   `FOR UPDATE SKIP LOCKED` passes over (it never waits; a claim at that moment may find
//!   fewer rows), and which no settlement needs (a delivery's row is never one of them). Exact
//!   for deliveries; a row that another open transaction locked or changed counts too, and a
//!   row being claimed right then (locked, not yet handed out) counts as in work.
//!
//! Every count is over one snapshot: the rows the statement's consistent read sees, each put in
//! exactly one state; the locking read only tells, for those rows, which are held.
//!
//! These statements are not on the hot path: they are built per call.

use broker_core::driver::{AdminDriver, CANCEL_TABLE, CONTROL_TABLE, StatsCounts};
use broker_core::{
    ClaimMode, ColumnType, Count, DeadLetter, DeadLetters, JobInfo, JobState, KeyPart, KeyTemplate,
    ModeColumns, Page, Pause, Result, SqlxBrokerError, TableDescription,
    admin::{RowChange, last_error_text},
};
use sqlx::mysql::{MySqlArguments, MySqlRow};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Connection, MySql, MySqlConnection, MySqlPool, Row};
use tokio::sync::OnceCell;

use crate::advisory::{MAX_LOCK_NAME_CHARS, lock_name};
use crate::backend::Conn;
use crate::sql::{EPOCH6, error_number, ident, micros, read_ms};
use crate::version::{self, Flavor};

/// How admin transactions open: READ COMMITTED, so a locking read locks only the rows it
/// returns, never the gaps between them (which would hold up publishes).
const BEGIN_RC: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// Ids per statement when an operation works through a list of them.
const IDS_PER_STATEMENT: usize = 1000;

/// A text as a MySQL string expression, written in hex so that no character (a quote, a
/// backslash under any `sql_mode`) can end it. For the broker's own texts (key template pieces,
/// table names), never for values from outside.
fn literal(text: &str) -> String {
    if text.is_empty() {
        return "''".into();
    }
    let hex: String = text.bytes().map(|b| format!("{b:02x}")).collect();
    // An explicit collation, so that mixing it with the connection's never meets "illegal mix
    // of collations".
    format!("CONVERT(X'{hex}' USING utf8mb4) COLLATE utf8mb4_bin")
}

/// Runs `work` in a READ COMMITTED transaction on `conn` ([`BEGIN_RC`]): committed when it
/// succeeds, rolled back at once when it fails. (A rollback left to the transaction's drop is
/// only sent with the connection's next statement, so a connection back in the pool would keep
/// the transaction's locks until then, and a `SKIP LOCKED` read of the next operation would
/// pass over rows nobody works on.)
async fn in_rc_tx<T>(
    conn: &mut MySqlConnection,
    err: impl Fn(sqlx::Error) -> SqlxBrokerError,
    work: impl AsyncFnOnce(&mut MySqlConnection) -> Result<T>,
) -> Result<T> {
    let mut tx = conn
        .begin_with(AssertSqlSafe(BEGIN_RC))
        .await
        .map_err(&err)?;
    match work(&mut tx).await {
        Ok(out) => {
            tx.commit().await.map_err(&err)?;
            Ok(out)
        }
        Err(e) => {
            tx.rollback().await.map_err(&err)?;
            Err(e)
        }
    }
}

/// A value bound to a `?`.
#[derive(Debug, Clone)]
enum Arg {
    Int(i64),
    Text(String),
}

/// SQL text with the values of its `?`s in order, built up from fragments.
#[derive(Debug, Clone, Default)]
struct Q {
    sql: String,
    args: Vec<Arg>,
}

impl Q {
    fn new(sql: impl Into<String>) -> Self {
        Self {
            sql: sql.into(),
            args: Vec::new(),
        }
    }

    fn push(mut self, sql: &str) -> Self {
        self.sql.push_str(sql);
        self
    }

    fn int(mut self, value: i64) -> Self {
        self.sql.push('?');
        self.args.push(Arg::Int(value));
        self
    }

    fn text(mut self, value: impl Into<String>) -> Self {
        self.sql.push('?');
        self.args.push(Arg::Text(value.into()));
        self
    }

    /// A time given in unix milliseconds, as DATETIME(6).
    fn time(self, ms: i64) -> Self {
        self.push("TIMESTAMPADD(MICROSECOND, ")
            .int(micros(ms))
            .push(&format!(", {EPOCH6})"))
    }

    fn and(mut self, other: &Q) -> Self {
        self.sql.push_str(&other.sql);
        self.args.extend(other.args.iter().cloned());
        self
    }

    /// The statement with its values bound. `persistent`: kept prepared on the connection
    /// (statements whose text changes with a list of ids are not).
    fn query(self, persistent: bool) -> Query<'static, MySql, MySqlArguments> {
        let mut q = sqlx::query(AssertSqlSafe(self.sql)).persistent(persistent);
        for arg in self.args {
            q = match arg {
                Arg::Int(i) => q.bind(i),
                Arg::Text(s) => q.bind(s),
            };
        }
        q
    }
}

/// `cond` as a count of the rows it holds for.
fn count_if(cond: &Q) -> Q {
    Q::new("CAST(SUM(CASE WHEN ")
        .and(cond)
        .push(" THEN 1 ELSE 0 END) AS SIGNED)")
}

/// `(a AND b AND ..)` of fragments.
fn all(parts: &[&Q]) -> Q {
    let mut out = Q::new("(");
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            out = out.push(" AND ");
        }
        out = out.and(p);
    }
    out.push(")")
}

fn not(q: &Q) -> Q {
    Q::new("NOT ").and(q)
}

/// The lock name of a key expression, as [`lock_name`] computes it: `"<database>:<key>"`, or the
/// lowercase hex SHA-256 of its UTF-8 bytes when longer than 64 characters or holding a
/// character outside the Basic Multilingual Plane (which a conversion to utf8mb3 loses).
fn lock_name_sql(key: &str) -> String {
    let n = format!("CONCAT(CONVERT(DATABASE() USING utf8mb4), ':', {key})");
    format!(
        "IF(CHAR_LENGTH({n}) <= {MAX_LOCK_NAME_CHARS} \
         AND CAST(CONVERT({n} USING utf8mb3) AS BINARY) = CAST({n} AS BINARY), {n}, SHA2({n}, 256))"
    )
}

/// The fragments of one table's admin statements. Columns are qualified with an alias: `q` in
/// a `SELECT .. FROM t AS q`, the table's own name in an `UPDATE` or `DELETE` (which take no
/// alias on every supported version).
struct Frag<'t> {
    t: &'t TableDescription,
    table: String,
    id: String,
}

impl<'t> Frag<'t> {
    fn new(t: &'t TableDescription) -> Self {
        Self {
            t,
            table: ident(t.name()),
            id: ident(t.id()),
        }
    }

    fn col(&self, a: &str, c: &str) -> String {
        format!("{a}.{}", ident(c))
    }

    /// Unfinished rows.
    fn unfinished(&self, a: &str) -> Q {
        let mut c: Vec<String> = self
            .t
            .unfinished_columns()
            .into_iter()
            .map(|c| format!("{} IS NULL", self.col(a, c)))
            .collect();
        if c.is_empty() {
            c.push("1 = 1".into());
        }
        Q::new(format!("({})", c.join(" AND ")))
    }

    /// Due at `now_ms`, as the claim reads it (a NULL due time is due at once).
    fn due(&self, a: &str, now_ms: i64) -> Q {
        match self.t.due_at() {
            Some(d) => {
                let d = self.col(a, d);
                Q::new(format!("({d} IS NULL OR {d} <= "))
                    .time(now_ms)
                    .push(")")
            }
            None => Q::new("(1 = 1)"),
        }
    }

    /// The advisory key of a row, as the claim renders it (NULL values as empty text).
    fn key(&self, template: &KeyTemplate, a: &str) -> String {
        let parts: Vec<String> = template
            .parts()
            .iter()
            .map(|p| match p {
                KeyPart::Literal(text) => literal(text),
                KeyPart::Column(c) => format!("IFNULL(CAST({} AS CHAR), '')", self.col(a, c)),
            })
            .collect();
        format!("CONCAT('', {})", parts.join(", "))
    }

    /// Whether a delivery holds the row now, row by row (see the module docs). Row lock mode
    /// reads the join of [`free_rows`](Self::free_rows).
    fn held(&self, a: &str, now_ms: i64) -> Q {
        match self.t.mode_columns() {
            ModeColumns::Lease { locked_until } => {
                let lu = self.col(a, locked_until);
                Q::new(format!("({lu} IS NOT NULL AND {lu} > "))
                    .time(now_ms)
                    .push(")")
            }
            ModeColumns::Advisory { key } => Q::new(format!(
                "(IS_USED_LOCK({}) IS NOT NULL)",
                lock_name_sql(&self.key(key, a))
            )),
            _ => Q::new("(sqlx_broker_free.id IS NULL)"),
        }
    }

    /// Row lock mode: a join of each row of `q` to itself where a shared locking read that
    /// skips locked rows still finds it (see the module docs); a row it found no match for is
    /// held. Empty in the other modes. `share`: the server's spelling of the locking clause.
    fn free_rows(&self, share: &str) -> String {
        if self.t.mode() != ClaimMode::RowLock {
            return String::new();
        }
        // FORCE INDEX (PRIMARY): the locking read looks rows up through the primary key. Through
        // a secondary index it would lock the index entries of rows it passes (a delivery's
        // ack could then wait for it).
        format!(
            " LEFT JOIN (SELECT f.{id} AS id FROM {table} AS f FORCE INDEX (PRIMARY) WHERE {unf} \
             {share}) AS sqlx_broker_free ON sqlx_broker_free.id = q.{id}",
            id = self.id,
            table = self.table,
            unf = self.unfinished("f").sql,
        )
    }

    /// What holds a row, in words, for a refusal.
    fn holder(&self) -> &'static str {
        match self.t.mode() {
            ClaimMode::Lease => "its lease has not run out",
            ClaimMode::Advisory => {
                "its advisory key is held (by its delivery, or one of another row with the same key)"
            }
            _ => "a delivery's transaction holds its row lock",
        }
    }

    fn dead_column(&self) -> Option<&'t str> {
        match self.t.dead_letter() {
            Some(DeadLetter::Column(c)) => Some(c.as_str()),
            _ => None,
        }
    }

    fn dead_table(&self) -> Option<String> {
        match self.t.dead_letter() {
            Some(DeadLetter::Table(d)) => Some(ident(d)),
            _ => None,
        }
    }

    /// Where the dead letters are, and the condition of one on the alias `a`.
    fn dead_letters(&self, a: &str) -> (String, String) {
        match (self.dead_column(), self.dead_table()) {
            (Some(c), _) => (
                self.table.clone(),
                format!("{} IS NOT NULL", self.col(a, c)),
            ),
            (None, Some(d)) => (d, "1 = 1".into()),
            (None, None) => unreachable!("checked by the core"),
        }
    }

    /// Which dead letters, on the alias `a`. The error text matches as bytes (as PostgreSQL's
    /// `strpos` does), not through the column's case-insensitive collation.
    fn which(&self, a: &str, which: &DeadLetters) -> Q {
        match which {
            DeadLetters::Ids(ids) => {
                let mut q = Q::new(format!("{} IN (", self.col(a, self.t.id())));
                for (i, id) in ids.iter().enumerate() {
                    if i > 0 {
                        q = q.push(", ");
                    }
                    q = q.int(*id);
                }
                q.push(")")
            }
            DeadLetters::ErrorContains(text) => {
                Q::new("LOCATE(CAST(").text(text.clone()).push(&format!(
                    " AS BINARY), CAST({} AS BINARY)) > 0",
                    self.col(a, self.t.last_error().expect("checked by the core"))
                ))
            }
            _ => Q::new("1 = 1"),
        }
    }

    /// The ids `ids`, on the alias `a`.
    fn ids(&self, a: &str, ids: &[i64]) -> Q {
        self.which(a, &DeadLetters::Ids(ids.to_vec()))
    }
}

/// The operator statements of a MySQL / MariaDB backend ([`AdminDriver`]), borrowing its pool: what
/// [`Backend::admin`](broker_core::Backend::admin) returns.
pub struct MySqlAdmin<'a> {
    pub(crate) pool: &'a MySqlPool,
    /// Which server this is, read once (the locking clause of the row lock probe differs).
    pub(crate) flavor: &'a OnceCell<Flavor>,
}

impl MySqlAdmin<'_> {
    async fn conn(&self, table: &str) -> Result<Conn> {
        Conn::acquire(self.pool, table).await
    }

    /// The server's shared locking read that skips locked rows.
    async fn share_skip(&self, conn: &mut MySqlConnection, table: &str) -> Result<&'static str> {
        let flavor = self
            .flavor
            .get_or_try_init(|| async {
                let found: String = sqlx::query_scalar("SELECT VERSION()")
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(|e| SqlxBrokerError::statement(table, "version", e))?;
                Ok::<_, SqlxBrokerError>(version::parse(&found).map_or(Flavor::MySql, |s| s.flavor))
            })
            .await?;
        // -- needs SKIP LOCKED: MySQL 8.0.1 (FOR SHARE), MariaDB 10.6 (LOCK IN SHARE MODE; no
        // FOR SHARE on MariaDB 10.11)
        Ok(match flavor {
            Flavor::MariaDb => "LOCK IN SHARE MODE SKIP LOCKED",
            Flavor::MySql => "FOR SHARE SKIP LOCKED",
        })
    }

    /// Runs `build` (given the row lock probe's join) and fetches its rows: in row lock mode in
    /// a READ COMMITTED transaction of its own (the probe's shared locks end with it), else as
    /// one autocommit statement.
    async fn fetch_all(
        &self,
        t: &TableDescription,
        name: &'static str,
        build: impl FnOnce(&str) -> Q,
    ) -> Result<Vec<MySqlRow>> {
        let err = |e| SqlxBrokerError::statement(t.name(), name, e);
        let mut conn = self.conn(t.name()).await?;
        let out = async {
            if t.mode() != ClaimMode::RowLock {
                return build("")
                    .query(true)
                    .fetch_all(&mut *conn)
                    .await
                    .map_err(err);
            }
            let share = self.share_skip(&mut conn, t.name()).await?;
            let join = Frag::new(t).free_rows(share);
            in_rc_tx(&mut conn, err, async |tx| {
                build(&join).query(true).fetch_all(tx).await.map_err(err)
            })
            .await
        }
        .await;
        conn.finish();
        out
    }

    async fn execute(&self, t: &str, name: &'static str, q: Q, persistent: bool) -> Result<u64> {
        let mut conn = self.conn(t).await?;
        let out = q
            .query(persistent)
            .execute(&mut *conn)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| SqlxBrokerError::statement(t, name, e));
        conn.finish();
        out
    }

    /// In `tx`, locks the dead letters `which` names and returns their ids. Candidates are read
    /// without locks, then locked through the primary key with `SKIP LOCKED`: a scan that
    /// locks would wait for every row a delivery holds, and a dead letter is never one. With
    /// [`DeadLetters::Ids`] every id must be a dead letter, else the first that is not is named
    /// and nothing changes.
    async fn all_dead(
        &self,
        tx: &mut MySqlConnection,
        t: &TableDescription,
        which: &DeadLetters,
    ) -> Result<Vec<i64>> {
        let f = Frag::new(t);
        let err = |e| SqlxBrokerError::statement(t.name(), "dead letters", e);
        let (from, dead) = f.dead_letters("q");
        let mut candidates: Vec<i64> = match which {
            DeadLetters::Ids(ids) => ids.clone(),
            _ => {
                let q = Q::new(format!(
                    "SELECT CAST(q.{id} AS SIGNED) FROM {from} AS q WHERE {dead} AND ",
                    id = f.id
                ))
                .and(&f.which("q", which));
                q.query(false)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(err)?
                    .iter()
                    .map(|r| r.try_get::<i64, _>(0))
                    .collect::<std::result::Result<_, _>>()
                    .map_err(err)?
            }
        };
        candidates.sort_unstable();
        candidates.dedup();
        let mut locked = Vec::with_capacity(candidates.len());
        for chunk in candidates.chunks(IDS_PER_STATEMENT) {
            // -- needs SKIP LOCKED: MySQL 8.0.1, MariaDB 10.6
            let q = Q::new(format!(
                "SELECT CAST(q.{id} AS SIGNED) FROM {from} AS q FORCE INDEX (PRIMARY) WHERE {dead} AND ",
                id = f.id
            ))
            .and(&f.ids("q", chunk))
            .push(" FOR UPDATE SKIP LOCKED");
            for r in q.query(false).fetch_all(&mut *tx).await.map_err(err)? {
                locked.push(r.try_get::<i64, _>(0).map_err(err)?);
            }
        }
        if let DeadLetters::Ids(ids) = which
            && let Some(missing) = ids.iter().find(|id| !locked.contains(id))
        {
            return Err(SqlxBrokerError::RowNotFound {
                table: t.name().to_owned(),
                id: *missing,
                where_: " among the dead letters",
            });
        }
        Ok(locked)
    }

    /// Runs `work` on the dead letters `which` names, locked, in one READ COMMITTED
    /// transaction; nothing changes when it fails.
    async fn on_dead<'s>(
        &'s self,
        t: &'s TableDescription,
        name: &'static str,
        which: &'s DeadLetters,
        work: impl AsyncFnOnce(&mut MySqlConnection, Vec<i64>) -> Result<()>,
    ) -> Result<u64> {
        let err = |e| SqlxBrokerError::statement(t.name(), name, e);
        let mut conn = self.conn(t.name()).await?;
        let out = in_rc_tx(&mut conn, err, async |tx| {
            let ids = self.all_dead(tx, t, which).await?;
            let n = u64::try_from(ids.len()).unwrap_or(u64::MAX);
            work(tx, ids).await?;
            Ok(n)
        })
        .await;
        conn.finish();
        out
    }

    /// Why row `id` was not changed: gone or finished, in work, or (`due`) due already.
    async fn why_not(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = Frag::new(t);
        let rows = self
            .fetch_all(t, "row check", |join| {
                Q::new("SELECT CAST(")
                    .and(&f.held("q", now_ms))
                    .push(" AS SIGNED) FROM ")
                    .push(&format!("{} AS q{join} WHERE q.{} = ", f.table, f.id))
                    .int(id)
                    .push(" AND ")
                    .and(&f.unfinished("q"))
            })
            .await?;
        let Some(row) = rows.first() else {
            return Ok(RowChange::NotFound);
        };
        let held: i64 = row
            .try_get(0)
            .map_err(|e| SqlxBrokerError::statement(t.name(), "row check", e))?;
        Ok(match held {
            0 => RowChange::Unchanged,
            _ => RowChange::InWork(f.holder().into()),
        })
    }

    /// Runs `change` (a statement on row `id`, fenced in lease mode by the lease in its
    /// `WHERE`) and tells what happened. Row lock mode first locks the row with `SKIP LOCKED`
    /// in the change's transaction, so a row a delivery holds is skipped, never waited for;
    /// advisory mode holds the row's key (`GET_LOCK(name, 0)`, on a connection of its own) for
    /// the change, so no claim can take the row meanwhile.
    async fn fenced(
        &self,
        t: &TableDescription,
        name: &'static str,
        id: i64,
        now_ms: i64,
        change: Q,
    ) -> Result<RowChange> {
        let f = Frag::new(t);
        let err = |e| SqlxBrokerError::statement(t.name(), name, e);
        let mut conn = self.conn(t.name()).await?;
        let changed = match t.mode_columns() {
            ModeColumns::Advisory { key } => {
                let sql = Q::new(format!(
                    "SELECT CAST(DATABASE() AS CHAR), {key} FROM {table} AS q WHERE q.{id} = ",
                    key = f.key(key, "q"),
                    table = f.table,
                    id = f.id,
                ))
                .int(id)
                .push(" AND ")
                .and(&f.unfinished("q"));
                let row = sql
                    .query(true)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(err)?;
                let Some(row) = row else {
                    conn.finish();
                    return Ok(RowChange::NotFound);
                };
                let database: Option<String> = row.try_get(0).map_err(err)?;
                let key: String = row.try_get(1).map_err(err)?;
                let Some(database) = database else {
                    conn.finish();
                    return Err(SqlxBrokerError::Setup {
                        table: t.name().to_owned(),
                        what: "the connection has no default database; name it in the URL (mysql://host/db)".into(),
                    });
                };
                let lock = lock_name(&database, &key);
                let got: Option<i64> = sqlx::query_scalar("SELECT CAST(GET_LOCK(?, 0) AS SIGNED)")
                    .bind(&lock)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(err)?;
                if got != Some(1) {
                    // GET_LOCK found the key held (0), or failed (NULL): this session holds
                    // nothing either way.
                    conn.finish();
                    return Ok(RowChange::InWork(format!(
                        "its advisory key \"{key}\" is held"
                    )));
                }
                // An error from here on leaves `conn` armed: dropped, it is closed, and the
                // session's end frees the key.
                let n = change
                    .query(true)
                    .execute(&mut *conn)
                    .await
                    .map_err(err)?
                    .rows_affected();
                let released: Option<i64> =
                    sqlx::query_scalar("SELECT CAST(RELEASE_LOCK(?) AS SIGNED)")
                        .bind(&lock)
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(err)?;
                if released == Some(1) {
                    conn.finish();
                }
                n
            }
            ModeColumns::RowLock => {
                let out = in_rc_tx(&mut conn, err, async |tx| {
                    // -- needs SKIP LOCKED: MySQL 8.0.1, MariaDB 10.6
                    let lock = Q::new(format!(
                        "SELECT CAST(q.{id} AS SIGNED) FROM {table} AS q FORCE INDEX (PRIMARY) WHERE q.{id} = ",
                        id = f.id,
                        table = f.table,
                    ))
                    .int(id)
                    .push(" AND ")
                    .and(&f.unfinished("q"))
                    .push(" FOR UPDATE SKIP LOCKED");
                    let found = lock
                        .query(true)
                        .fetch_optional(&mut *tx)
                        .await
                        .map_err(err)?;
                    if found.is_none() {
                        return Ok(0);
                    }
                    change
                        .query(true)
                        .execute(tx)
                        .await
                        .map(|r| r.rows_affected())
                        .map_err(err)
                })
                .await;
                conn.finish();
                out?
            }
            _ => {
                let out = change
                    .query(true)
                    .execute(&mut *conn)
                    .await
                    .map(|r| r.rows_affected())
                    .map_err(err);
                conn.finish();
                out?
            }
        };
        if changed > 0 {
            return Ok(RowChange::Done);
        }
        self.why_not(t, id, now_ms).await
    }

    /// The rows a fenced change may touch, on the table's own name: row `id` if unfinished and,
    /// in lease mode, not leased (the other modes fence before the change, see
    /// [`fenced`](Self::fenced)).
    fn target(&self, t: &TableDescription, id: i64, now_ms: i64) -> Q {
        let f = Frag::new(t);
        let a = f.table.clone();
        let mut q = Q::new(format!("{a}.{} = ", f.id))
            .int(id)
            .push(" AND ")
            .and(&f.unfinished(&a));
        if t.mode() == ClaimMode::Lease {
            q = q.push(" AND NOT ").and(&f.held(&a, now_ms));
        }
        q
    }
}

/// The counts of a lease or row lock table, in one statement: every row the statement's read
/// sees is in exactly one of due, scheduled, in work, dead and finished. `join`: the row lock
/// probe (see [`Frag::free_rows`]), empty in lease mode.
fn stats_by_row(t: &TableDescription, now_ms: i64, join: &str) -> Q {
    let f = Frag::new(t);
    let (unf, due, held) = (f.unfinished("q"), f.due("q", now_ms), f.held("q", now_ms));
    let free_due = all(&[&unf, &due, &not(&held)]);
    let due_ms = t
        .due_at()
        .map(|d| read_ms(&f.col("q", d)))
        .unwrap_or_else(|| "NULL".into());
    let finished = match t.processed_at() {
        Some(p) => count_if(&Q::new(format!("{} IS NOT NULL", f.col("q", p)))),
        None => Q::new("CAST(NULL AS SIGNED)"),
    };
    // The dead-letter table is counted in the same statement, so in the same snapshot: a row
    // that moves there meanwhile is counted once.
    let dead = match (f.dead_column(), f.dead_table()) {
        (Some(c), _) => count_if(&Q::new(format!("{} IS NOT NULL", f.col("q", c)))),
        // A kinds table counts its dead-letter table by kind (see `by_kind`).
        (None, Some(_)) if t.kind().is_some() => Q::new("0"),
        (None, Some(d)) => Q::new(format!("(SELECT COUNT(*) FROM {d})")),
        (None, None) => Q::new("CAST(NULL AS SIGNED)"),
    };
    let kind = t
        .kind()
        .map(|k| format!("CAST({} AS BINARY)", f.col("q", k)))
        .unwrap_or_default();
    let (kind_col, grouped) = by_kind(t, &kind);
    Q::new("SELECT ")
        .and(&count_if(&free_due))
        .push(", ")
        .and(&count_if(&all(&[&unf, &not(&due), &not(&held)])))
        .push(", ")
        .and(&count_if(&all(&[&unf, &held])))
        .push(", ")
        .and(&count_if(&all(&[
            &unf,
            &Q::new(format!("{} > 1", f.col("q", t.attempt()))),
        ])))
        .push(", ")
        .and(&finished)
        .push(", ")
        .and(&dead)
        .push(", CAST(MIN(CASE WHEN ")
        .and(&free_due)
        .push(&format!(
            " THEN {due_ms} END) AS SIGNED){kind_col} FROM {} AS q{join}{grouped}",
            f.table
        ))
}

/// On a kinds table, the kind column of a stats statement, `kind` (the kind as bytes, so kinds
/// are told apart whatever the column's collation), and its grouping followed by the
/// dead-letter table's counts by kind in the same statement; empty texts otherwise.
fn by_kind(t: &TableDescription, kind: &str) -> (String, String) {
    let Some(k) = t.kind() else {
        return (String::new(), String::new());
    };
    let mut grouped = format!(" GROUP BY {kind}");
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        grouped.push_str(&broker_core::driver::dead_by_kind(
            &ident(d),
            &format!("CAST({} AS BINARY)", ident(k)),
            "CAST(NULL AS SIGNED)",
        ));
    }
    (format!(", {kind}"), grouped)
}

/// The counts of an advisory table, in one statement: the rows grouped by key (as bytes, the
/// way lock names compare), each key's lock asked once (`IS_USED_LOCK`, in the select list of
/// the grouped derived table, which the server materializes once), then summed. A held key with
/// due rows is one row in work and the rest of its due rows are due; its scheduled rows stay
/// scheduled, so a key still held just after its row was put back for later counts nothing
/// twice.
fn stats_by_key(t: &TableDescription, key: &KeyTemplate, now_ms: i64) -> Q {
    let f = Frag::new(t);
    let (unf, due) = (f.unfinished("q"), f.due("q", now_ms));
    let flag = |cond: &Q| Q::new("CASE WHEN ").and(cond).push(" THEN 1 ELSE 0 END");
    let due_rows = all(&[&unf, &due]);
    let finished = match t.processed_at() {
        Some(p) => flag(&Q::new(format!("{} IS NOT NULL", f.col("q", p)))),
        None => Q::new("0"),
    };
    let marked = match f.dead_column() {
        Some(c) => flag(&Q::new(format!("{} IS NOT NULL", f.col("q", c)))),
        None => Q::new("0"),
    };
    let due_ms = match t.due_at() {
        Some(d) => Q::new("CASE WHEN ")
            .and(&due_rows)
            .push(&format!(" THEN {} END", read_ms(&f.col("q", d)))),
        None => Q::new("NULL"),
    };
    let kd = t
        .kind()
        .map(|k| format!(", CAST({} AS BINARY) AS kd", f.col("q", k)))
        .unwrap_or_default();
    let rows = Q::new(format!("SELECT CAST({} AS BINARY) AS k, ", f.key(key, "q")))
        .and(&flag(&due_rows))
        .push(" AS d, ")
        .and(&flag(&all(&[&unf, &not(&due)])))
        .push(" AS l, ")
        .and(&flag(&all(&[
            &unf,
            &Q::new(format!("{} > 1", f.col("q", t.attempt()))),
        ])))
        .push(" AS r, ")
        .and(&finished)
        .push(" AS f, ")
        .and(&marked)
        .push(" AS m, ")
        .and(&due_ms)
        .push(&format!(" AS ms{kd} FROM {} AS q", f.table));
    // A kinds table groups by key and kind: a held key counts in work once in each kind with
    // due rows under it (see `KindStats`).
    let keys = Q::new(format!(
        "SELECT SUM(x.d) AS d, SUM(x.l) AS l, SUM(x.r) AS r, SUM(x.f) AS f, SUM(x.m) AS m, \
         MIN(x.ms) AS ms, CASE WHEN SUM(x.d) > 0 THEN IS_USED_LOCK({}) IS NOT NULL ELSE 0 END AS h{} \
         FROM (",
        lock_name_sql("CONVERT(x.k USING utf8mb4)"),
        if t.kind().is_some() { ", x.kd AS kd" } else { "" },
    ))
    .and(&rows)
    .push(if t.kind().is_some() {
        ") AS x GROUP BY x.k, x.kd"
    } else {
        ") AS x GROUP BY x.k"
    });
    let finished = match t.processed_at() {
        Some(_) => "CAST(SUM(g.f) AS SIGNED)".to_owned(),
        None => "CAST(NULL AS SIGNED)".to_owned(),
    };
    let dead = match (f.dead_column(), f.dead_table()) {
        (Some(_), _) => "CAST(SUM(g.m) AS SIGNED)".to_owned(),
        (None, Some(_)) if t.kind().is_some() => "0".to_owned(),
        (None, Some(d)) => format!("(SELECT COUNT(*) FROM {d})"),
        (None, None) => "CAST(NULL AS SIGNED)".to_owned(),
    };
    // The derived table's kind is bytes already.
    let (kind_col, grouped) = by_kind(t, "g.kd");
    Q::new(format!(
        "SELECT CAST(SUM(g.d) - SUM(g.h) AS SIGNED), CAST(SUM(g.l) AS SIGNED), \
         CAST(SUM(g.h) AS SIGNED), CAST(SUM(g.r) AS SIGNED), {finished}, {dead}, \
         CAST(MIN(CASE WHEN g.h = 0 THEN g.ms END) AS SIGNED){kind_col} FROM ("
    ))
    .and(&keys)
    .push(") AS g")
    .push(&grouped)
}

/// The control table's DDL (see [`CONTROL_TABLE`]). The queue is the table's name, compared as
/// bytes as MySQL compares table names on Linux.
pub(crate) fn control_ddl() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {CONTROL_TABLE} (queue VARCHAR(255) CHARACTER SET utf8mb4 \
         COLLATE utf8mb4_bin NOT NULL PRIMARY KEY, paused_at_ms BIGINT NOT NULL, paused_by TEXT NOT NULL) \
         ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    )
}

/// The cancel table's DDL (see [`CANCEL_TABLE`]): its key serves the read of one queue's
/// requests; the queue compares as the control table's does.
pub(crate) fn cancels_ddl() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {CANCEL_TABLE} (queue VARCHAR(255) CHARACTER SET utf8mb4 \
         COLLATE utf8mb4_bin NOT NULL, id BIGINT NOT NULL, requested_at_ms BIGINT NOT NULL, \
         PRIMARY KEY (queue, id)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    )
}

/// The statement of [`drop_ddl`](crate::schema::drop_ddl) that deletes a dropped queue's pause
/// (see [`broker_core::driver::unpause_ddl`]).
pub(crate) fn unpause_ddl(table: &str) -> String {
    broker_core::driver::unpause_ddl(&literal(table))
}

/// The statement of [`drop_ddl`](crate::schema::drop_ddl) that deletes a dropped queue's cancel
/// requests (see [`broker_core::driver::uncancel_ddl`]).
pub(crate) fn uncancel_ddl(table: &str) -> String {
    broker_core::driver::uncancel_ddl(&literal(table))
}

impl AdminDriver for MySqlAdmin<'_> {
    async fn stats(&self, t: &TableDescription, now_ms: i64) -> Result<StatsCounts> {
        let rows = match t.mode_columns() {
            ModeColumns::Advisory { key } => {
                let q = stats_by_key(t, key, now_ms);
                self.fetch_all(t, "stats", |_| q).await?
            }
            _ => {
                self.fetch_all(t, "stats", |join| stats_by_row(t, now_ms, join))
                    .await?
            }
        };
        if t.kind().is_some() {
            let mut parts = Vec::with_capacity(rows.len());
            let mut oldest: Option<i64> = None;
            for row in &rows {
                let get = |i: usize| -> Result<Option<i64>> {
                    row.try_get::<Option<i64>, _>(i)
                        .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))
                };
                let kind: Option<Vec<u8>> = row
                    .try_get(7)
                    .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))?;
                let kind = kind.map(|k| String::from_utf8_lossy(&k).into_owned());
                let counts = [get(0)?, get(1)?, get(2)?, get(3)?, get(4)?, get(5)?];
                parts.push(broker_core::driver::kind_part(kind, counts, |n| {
                    Count::exact(u64::try_from(n).unwrap_or(0))
                }));
                oldest = match (oldest, get(6)?) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            return Ok(StatsCounts::by_kind(t, parts, oldest));
        }
        let row = rows.first().ok_or_else(|| SqlxBrokerError::Invariant {
            table: t.name().to_owned(),
            statement: "stats",
            what: "the counts came back without a row".into(),
        })?;
        let get = |i: usize| -> Result<Option<i64>> {
            row.try_get::<Option<i64>, _>(i)
                .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))
        };
        let count = |v: Option<i64>| Count::exact(u64::try_from(v.unwrap_or(0)).unwrap_or(0));
        Ok(StatsCounts {
            due: count(get(0)?),
            scheduled: count(get(1)?),
            in_work: count(get(2)?),
            retrying: count(get(3)?),
            finished: t.processed_at().map(|_| ()).and(Some(count(get(4)?))),
            dead: t.dead_letter().map(|_| ()).and(Some(count(get(5)?))),
            oldest_due_ms: get(6)?,
            kinds: Vec::new(),
        })
    }

    async fn list(
        &self,
        t: &TableDescription,
        state: JobState,
        page: Page,
        error_chars: usize,
        kind: Option<&str>,
        now_ms: i64,
    ) -> Result<Vec<JobInfo>> {
        let f = Frag::new(t);
        let build = |join: &str| -> Q {
            let (unf, due, held) = (f.unfinished("q"), f.due("q", now_ms), f.held("q", now_ms));
            let (from, join, filter) = match state {
                JobState::Due => (f.table.clone(), join, all(&[&unf, &due, &not(&held)])),
                JobState::Scheduled => {
                    (f.table.clone(), join, all(&[&unf, &not(&due), &not(&held)]))
                }
                JobState::InWork => (f.table.clone(), join, all(&[&unf, &held])),
                JobState::Retrying => (
                    f.table.clone(),
                    "",
                    all(&[&unf, &Q::new(format!("{} > 1", f.col("q", t.attempt())))]),
                ),
                JobState::Finished => (
                    f.table.clone(),
                    "",
                    Q::new(format!(
                        "{} IS NOT NULL",
                        f.col("q", t.processed_at().expect("checked by the core"))
                    )),
                ),
                _ => {
                    let (from, dead) = f.dead_letters("q");
                    (from, "", Q::new(dead))
                }
            };
            let time = |c: Option<&str>| {
                c.map(|c| format!("CAST({} AS SIGNED)", read_ms(&f.col("q", c))))
                    .unwrap_or_else(|| "CAST(NULL AS SIGNED)".into())
            };
            let finished_at = match state {
                JobState::Finished => time(t.processed_at()),
                JobState::Dead => time(f.dead_column()),
                _ => time(None),
            };
            let cap = broker_core::admin::PAYLOAD_PREVIEW_BYTES;
            let payload = match t.payload() {
                // Hex of the first bytes, enough to fill the preview and tell it was cut.
                Some((p, ColumnType::Bytes)) => format!(
                    "CONCAT({}, LOWER(HEX(LEFT({}, {}))))",
                    literal("\\x"),
                    f.col("q", p),
                    cap / 2 + 1
                ),
                Some((p, _)) => format!("LEFT(CAST({} AS CHAR), {})", f.col("q", p), cap + 1),
                None => "CAST(NULL AS CHAR)".into(),
            };
            let text_of = |c: Option<&str>| {
                c.map(|c| format!("CAST({} AS CHAR)", f.col("q", c)))
                    .unwrap_or_else(|| "CAST(NULL AS CHAR)".into())
            };
            Q::new(format!(
                "SELECT CAST(q.{id} AS SIGNED), CAST({a} AS SIGNED), {due_ms}, {lu}, {finished_at}, \
                 {key}, {group}, {payload}, {error}, {kind} FROM {from} AS q{join} WHERE ",
                id = f.id,
                a = f.col("q", t.attempt()),
                due_ms = time(t.due_at()),
                lu = time(t.locked_until()),
                key = t
                    .advisory_lock()
                    .map_or_else(|| "CAST(NULL AS CHAR)".into(), |k| f.key(k, "q")),
                group = text_of(t.group()),
                kind = text_of(t.kind()),
                error = t.last_error().map_or_else(
                    || "CAST(NULL AS CHAR)".into(),
                    |c| format!(
                        "LEFT(CAST({} AS CHAR), {})",
                        f.col("q", c),
                        error_chars.saturating_add(1)
                    )
                ),
            ))
            .and(&filter)
            .and(&match (kind, t.kind()) {
                // As bytes: a case-insensitive column would match another kind's case.
                (Some(k), Some(c)) => Q::new(format!(" AND CAST({} AS BINARY) = CAST(", f.col("q", c)))
                    .text(k)
                    .push(" AS BINARY)"),
                _ => Q::new(""),
            })
            .push(&format!(" AND q.{} > ", f.id))
            .int(page.after.unwrap_or(i64::MIN))
            .push(&format!(" ORDER BY q.{} LIMIT ", f.id))
            .int(i64::try_from(page.limit).unwrap_or(i64::MAX))
        };
        let rows = self.fetch_all(t, "list", build).await?;
        rows.iter()
            .map(|r| -> std::result::Result<JobInfo, sqlx::Error> {
                let mut info =
                    JobInfo::new(r.try_get(0)?, r.try_get(1)?, state).with_payload(r.try_get(7)?);
                info.due_ms = r.try_get(2)?;
                info.locked_until_ms = r.try_get(3)?;
                info.finished_ms = r.try_get(4)?;
                info.key = r.try_get(5)?;
                info.group = r.try_get(6)?;
                info.kind = r.try_get(9)?;
                Ok(info.with_last_error(r.try_get(8)?, error_chars))
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| SqlxBrokerError::statement(t.name(), "list", e))
    }

    async fn requeue_dead(
        &self,
        t: &TableDescription,
        which: &DeadLetters,
        now_ms: i64,
    ) -> Result<u64> {
        let f = Frag::new(t);
        let err = |e| SqlxBrokerError::statement(t.name(), "requeue dead letters", e);
        let table = f.table.clone();
        // Back to a fresh row's state: attempt 1, due now, no lease.
        let mut reset = Q::new(format!("{}.{} = 1", table, ident(t.attempt())));
        if let Some(d) = t.due_at() {
            reset = reset
                .push(&format!(", {}.{} = ", table, ident(d)))
                .time(now_ms);
        }
        if let Some(lu) = t.locked_until() {
            reset = reset.push(&format!(", {}.{} = NULL", table, ident(lu)));
        }
        let dead_table = f.dead_table();
        let dead_column = f.dead_column();
        self.on_dead(t, "requeue dead letters", which, async |tx, ids| {
            for chunk in ids.chunks(IDS_PER_STATEMENT) {
                let mut steps = Vec::new();
                if let Some(d) = &dead_table {
                    // Back with their ids (an AUTO_INCREMENT column takes a given value); the
                    // dead-letter table has the queue table's columns in its order (the DDL
                    // helper makes it so).
                    steps.push(
                        Q::new(format!("INSERT INTO {table} SELECT * FROM {d} WHERE "))
                            .and(&f.ids(d, chunk)),
                    );
                    steps.push(Q::new(format!("DELETE FROM {d} WHERE ")).and(&f.ids(d, chunk)));
                }
                let mut sets = reset.clone();
                if let Some(c) = dead_column {
                    sets = sets.push(&format!(", {}.{} = NULL", table, ident(c)));
                }
                steps.push(
                    Q::new(format!("UPDATE {table} SET "))
                        .and(&sets)
                        .push(" WHERE ")
                        .and(&f.ids(&table, chunk)),
                );
                for q in steps {
                    q.query(false).execute(&mut *tx).await.map_err(err)?;
                }
            }
            Ok(())
        })
        .await
    }

    async fn discard_dead(&self, t: &TableDescription, which: &DeadLetters) -> Result<u64> {
        let f = Frag::new(t);
        let err = |e| SqlxBrokerError::statement(t.name(), "discard dead letters", e);
        let (from, _) = f.dead_letters("q");
        self.on_dead(t, "discard dead letters", which, async |tx, ids| {
            for chunk in ids.chunks(IDS_PER_STATEMENT) {
                Q::new(format!("DELETE FROM {from} WHERE "))
                    .and(&f.ids(&from, chunk))
                    .query(false)
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?;
            }
            Ok(())
        })
        .await
    }

    async fn cancel(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = Frag::new(t);
        let sql =
            Q::new(format!("DELETE FROM {} WHERE ", f.table)).and(&self.target(t, id, now_ms));
        self.fenced(t, "cancel", id, now_ms, sql).await
    }

    async fn run_now(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = Frag::new(t);
        let Some(d) = t.due_at() else {
            // Without a due time every unfinished row is due.
            return self.why_not(t, id, now_ms).await;
        };
        let sql = Q::new(format!(
            "UPDATE {} SET {}.{} = ",
            f.table,
            f.table,
            ident(d)
        ))
        .time(now_ms)
        .push(" WHERE ")
        .and(&self.target(t, id, now_ms))
        .push(" AND NOT ")
        .and(&f.due(&f.table, now_ms));
        self.fenced(t, "run now", id, now_ms, sql).await
    }

    async fn purge_finished(&self, t: &TableDescription, before_ms: i64) -> Result<u64> {
        let f = Frag::new(t);
        let p = f.col(&f.table, t.processed_at().expect("checked by the core"));
        let err = |e| SqlxBrokerError::statement(t.name(), "purge", e);
        let mut conn = self.conn(t.name()).await?;
        // READ COMMITTED: the delete locks only the rows it deletes; a row a delivery holds is
        // unfinished, so it is passed over (read as last committed) instead of waited for.
        let purge = Q::new(format!(
            "DELETE FROM {} WHERE {p} IS NOT NULL AND {p} < ",
            f.table
        ))
        .time(before_ms);
        let out = in_rc_tx(&mut conn, err, async |tx| {
            purge
                .query(true)
                .execute(tx)
                .await
                .map(|r| r.rows_affected())
                .map_err(err)
        })
        .await;
        conn.finish();
        out
    }

    async fn record_error(
        &self,
        t: &TableDescription,
        id: i64,
        error: &str,
        dead: bool,
    ) -> Result<()> {
        let f = Frag::new(t);
        let col = ident(t.last_error().expect("only called for tables with one"));
        let target = match (dead, f.dead_table()) {
            (true, Some(d)) => d,
            _ => f.table.clone(),
        };
        let sql = Q::new(format!("UPDATE {target} SET {target}.{col} = "))
            .text(last_error_text(error))
            .push(&format!(" WHERE {target}.{} = ", f.id))
            .int(id);
        self.execute(t.name(), "record error", sql, true)
            .await
            .map(drop)
    }

    async fn set_pause(&self, table: &str, pause: Option<&Pause>) -> Result<bool> {
        let q = match pause {
            Some(p) => Q::new(format!(
                "INSERT INTO {CONTROL_TABLE} (queue, paused_at_ms, paused_by) VALUES ("
            ))
            .text(table)
            .push(", ")
            .int(p.since_ms)
            .push(", ")
            .text(p.by.clone())
            .push(")"),
            None => Q::new(format!("DELETE FROM {CONTROL_TABLE} WHERE queue = ")).text(table),
        };
        match self.execute(table, "pause", q, true).await {
            Ok(n) => Ok(n > 0),
            // Paused already: the queue is the primary key (duplicate entry, 1062).
            Err(e) if e.sqlx_source().and_then(error_number) == Some(1062) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn pause_state(&self, table: &str) -> Result<Option<Pause>> {
        let mut conn = self.conn(table).await?;
        let row: Result<Option<(i64, String)>> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT paused_at_ms, CAST(paused_by AS CHAR) FROM {CONTROL_TABLE} WHERE queue = ?"
        )))
        .bind(table)
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| SqlxBrokerError::statement(table, "pause state", e));
        conn.finish();
        Ok(row?.map(|(since_ms, by)| Pause { since_ms, by }))
    }

    async fn has_control_table(&self) -> Result<bool> {
        let mut conn = self.conn("").await?;
        let found: Result<i64> = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(CONTROL_TABLE)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| SqlxBrokerError::statement("", "control table check", e));
        conn.finish();
        Ok(found? > 0)
    }

    async fn request_cancel(&self, table: &str, id: i64, now_ms: i64) -> Result<()> {
        let q = Q::new(format!(
            "INSERT INTO {CANCEL_TABLE} (queue, id, requested_at_ms) VALUES ("
        ))
        .text(table)
        .push(", ")
        .int(id)
        .push(", ")
        .int(now_ms)
        .push(") ON DUPLICATE KEY UPDATE requested_at_ms = requested_at_ms");
        self.execute(table, "cancel request", q, true)
            .await
            .map(drop)
    }

    async fn cancel_requests(&self, table: &str) -> Result<Vec<i64>> {
        let mut conn = self.conn(table).await?;
        let ids = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT id FROM {CANCEL_TABLE} WHERE queue = ?"
        )))
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| SqlxBrokerError::statement(table, "cancel requests", e));
        conn.finish();
        ids
    }

    async fn clear_cancel(&self, table: &str, id: i64) -> Result<()> {
        let q = Q::new(format!("DELETE FROM {CANCEL_TABLE} WHERE queue = "))
            .text(table)
            .push(" AND id = ")
            .int(id);
        self.execute(table, "cancel clear", q, true).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_written_in_hex() {
        assert_eq!(literal(""), "''");
        assert_eq!(
            literal("a'\\"),
            "CONVERT(X'61275c' USING utf8mb4) COLLATE utf8mb4_bin"
        );
    }

    #[test]
    fn fragments_bind_their_values_in_text_order() {
        let t = TableDescription::builder("jobs")
            .due_at("due")
            .locked_until("lu")
            .processed_at("done")
            .build()
            .unwrap();
        let q = stats_by_row(&t, 1_000, "");
        assert_eq!(q.sql.matches('?').count(), q.args.len());
        assert!(q.sql.contains("q.`done` IS NULL"), "{}", q.sql);
        let ids = Frag::new(&t).ids("q", &[3, 4]);
        assert_eq!(ids.sql, "q.`id` IN (?, ?)");
    }
}
