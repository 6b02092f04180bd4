//! Operating a PostgreSQL queue: counts by state, listings, and changes to rows outside the
//! claim path, each fenced as a settlement is (see `broker_core::admin`).
//!
//! What "in work" means on PostgreSQL, and how exact it is:
//! - lease: a `locked_until` after now (exact, on the host's clock);
//! - advisory: a row whose key an advisory lock holds (`pg_locks`), counted once per held key
//!   (one delivery per key); rows waiting behind a held key count as due;
//! - row lock: a row whose `xmax` is a transaction that is still running (`pg_locks` lists the
//!   transaction ids of running transactions): a row a delivery's transaction locked `FOR
//!   UPDATE`. Exact for deliveries; a row that some other open transaction locked or updated
//!   counts too.
//!
//! These statements are not on the hot path: they are built per call and sent unnamed where
//! the backend is behind a transaction-mode pooler.

use broker_core::driver::{AdminDriver, CANCEL_TABLE, CONTROL_TABLE, Signal, StatsCounts};
use broker_core::{
    ClaimMode, Count, DeadLetter, DeadLetters, JobInfo, JobState, KeyPart, KeyTemplate,
    ModeColumns, Page, Pause, Result, SqlxBrokerError, TableDescription,
    admin::{RowChange, last_error_text},
};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Row};

use crate::notify::SIGNALS;
use crate::sql::{due_key, ident, literal, ts};

/// `expr` (a `TIMESTAMPTZ`) as unix ms, NULL when infinite.
fn ms_or_null(expr: &str) -> String {
    format!("CASE WHEN isfinite({expr}) THEN floor(EXTRACT(EPOCH FROM {expr}) * 1000)::int8 END")
}

/// The fragments of one table's admin statements, on the alias `q`.
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

    fn col(&self, c: &str) -> String {
        format!("q.{}", ident(c))
    }

    /// Unfinished rows.
    fn unfinished(&self) -> String {
        let mut c: Vec<String> = self
            .t
            .unfinished_columns()
            .into_iter()
            .map(|c| format!("{} IS NULL", self.col(c)))
            .collect();
        if c.is_empty() {
            c.push("TRUE".into());
        }
        format!("({})", c.join(" AND "))
    }

    /// Due at `$1` (unix ms).
    fn due(&self) -> String {
        match self.t.due_at() {
            Some(d) => format!("({} <= {})", due_key(&self.col(d)), ts("$1")),
            None => "($1::int8 IS NOT NULL)".into(),
        }
    }

    /// The advisory key of a row, as the claim renders it.
    fn key(&self, template: &KeyTemplate) -> String {
        let parts: Vec<String> = template
            .parts()
            .iter()
            .map(|p| match p {
                KeyPart::Literal(text) => literal(text),
                KeyPart::Column(c) => self.col(c),
            })
            .collect();
        format!("concat({})", parts.join(", "))
    }

    /// Whether a delivery holds the row now (see the module docs).
    fn held(&self) -> String {
        match self.t.mode_columns() {
            ModeColumns::Lease { locked_until } => {
                let lu = self.col(locked_until);
                format!("({lu} IS NOT NULL AND {lu} > {})", ts("$1"))
            }
            ModeColumns::Advisory { key } => format!(
                "(hashtextextended({}, 0) IN (SELECT h.k FROM sqlx_broker_held AS h))",
                self.key(key)
            ),
            _ => "(q.xmax IN (SELECT h.x FROM sqlx_broker_held AS h))".into(),
        }
    }

    /// The locks a statement that uses [`held`](Self::held) reads, once (`pg_locks` changes
    /// while a statement runs; read in each filter, one row could count in two states), as a
    /// `WITH` clause; empty in lease mode. A CTE read more than once is evaluated once (and
    /// PostgreSQL 11 evaluates every CTE once).
    fn held_locks(&self) -> &'static str {
        match self.t.mode() {
            ClaimMode::Lease => "",
            ClaimMode::Advisory => {
                "WITH sqlx_broker_held AS (SELECT (l.classid::int8 << 32) | l.objid::int8 AS k \
                 FROM pg_locks AS l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
                 AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())) "
            }
            _ => {
                "WITH sqlx_broker_held AS (SELECT l.transactionid AS x FROM pg_locks AS l \
                 WHERE l.locktype = 'transactionid' AND l.transactionid IS NOT NULL) "
            }
        }
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

    fn dead_column(&self) -> Option<String> {
        match self.t.dead_letter() {
            Some(DeadLetter::Column(c)) => Some(self.col(c)),
            _ => None,
        }
    }

    fn dead_table(&self) -> Option<String> {
        match self.t.dead_letter() {
            Some(DeadLetter::Table(d)) => Some(ident(d)),
            _ => None,
        }
    }

    /// Which dead letters (on the alias `q`), with their parameter as `$n`.
    fn which(&self, which: &DeadLetters, n: usize) -> String {
        match which {
            DeadLetters::Ids(_) => format!("q.{} = ANY(${n}::int8[])", self.id),
            DeadLetters::ErrorContains(_) => format!(
                "strpos({}, ${n}::text) > 0",
                self.col(self.t.last_error().expect("checked by the core"))
            ),
            _ => format!("${n}::text IS NULL"),
        }
    }
}

/// Binds the parameter of [`Frag::which`].
fn bind_which<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    which: &DeadLetters,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    match which {
        DeadLetters::Ids(ids) => q.bind(ids.clone()),
        DeadLetters::ErrorContains(text) => q.bind(text.clone()),
        _ => q.bind(None::<String>),
    }
}

/// The operator statements of a PostgreSQL backend ([`AdminDriver`]), borrowing its pool: what
/// [`Backend::admin`](broker_core::Backend::admin) returns.
pub struct PgAdmin<'a> {
    pub(crate) pool: &'a PgPool,
    /// Whether statements may be prepared under a name (not behind a transaction-mode pooler).
    pub(crate) prepared: bool,
}

impl PgAdmin<'_> {
    fn query(
        &self,
        sql: String,
    ) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(AssertSqlSafe(sql)).persistent(self.prepared)
    }

    /// A connection in a transaction of its own.
    async fn begin(&self, table: &str) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        self.pool
            .begin()
            .await
            .map_err(|e| SqlxBrokerError::statement(table, "admin begin", e))
    }

    /// The planner's estimate of the rows in `table` (from its statistics, scaled to its size
    /// now): one `EXPLAIN`, no rows read.
    async fn planned_rows(&self, t: &TableDescription, table: &str) -> Result<u64> {
        let q = self.query(format!("EXPLAIN SELECT 1 FROM {table}"));
        let rows = crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_all(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(t.name(), "stats estimate", e))?;
        let plan: String = rows
            .first()
            .and_then(|r| r.try_get::<String, _>(0).ok())
            .unwrap_or_default();
        // "Seq Scan on jobs  (cost=0.00..1541.00 rows=100000 width=0)"
        Ok(plan
            .split("rows=")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0))
    }

    /// The due time of the oldest row a claim could take now, through the claim index.
    async fn oldest_due(&self, t: &TableDescription, now_ms: i64) -> Result<Option<i64>> {
        let Some(d) = t.due_at() else {
            return Ok(None);
        };
        let f = Frag::new(t);
        let sql = format!(
            "{with}SELECT {due_ms} FROM {table} AS q WHERE {unf} AND {due} AND NOT {held} \
             ORDER BY {key} LIMIT 1",
            with = f.held_locks(),
            due_ms = ms_or_null(&f.col(d)),
            table = f.table,
            unf = f.unfinished(),
            due = f.due(),
            held = f.held(),
            key = due_key(&f.col(d)),
        );
        let q = self.query(sql).bind(now_ms);
        let row = crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_optional(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))?;
        row.map(|r| r.try_get::<Option<i64>, _>(0))
            .transpose()
            .map(Option::flatten)
            .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))
    }

    /// Counts by state in one statement: of every row, or (`sample`: a percentage of the
    /// table's pages) of a sample, scaled to the table.
    async fn counted(
        &self,
        t: &TableDescription,
        now_ms: i64,
        sample: Option<f64>,
    ) -> Result<StatsCounts> {
        let f = Frag::new(t);
        let (unf, due, held) = (f.unfinished(), f.due(), f.held());
        let due_ms = t
            .due_at()
            .map(|d| ms_or_null(&f.col(d)))
            .unwrap_or_else(|| "NULL::int8".into());
        // Advisory counts one delivery per held key with due rows; rows waiting behind it count
        // as due. A held key without due rows (its delivery's row just put back for later, the
        // key not unlocked yet) is no row in work: its rows are scheduled, and counted there.
        let (due_count, scheduled, in_work) = match t.mode_columns() {
            ModeColumns::Advisory { key } => {
                let kh = format!("hashtextextended({}, 0)", f.key(key));
                (
                    format!(
                        "count(*) FILTER (WHERE {unf} AND {due}) \
                         - count(DISTINCT {kh}) FILTER (WHERE {unf} AND {due} AND {held})"
                    ),
                    format!("count(*) FILTER (WHERE {unf} AND NOT {due})"),
                    format!("count(DISTINCT {kh}) FILTER (WHERE {unf} AND {due} AND {held})"),
                )
            }
            _ => (
                format!("count(*) FILTER (WHERE {unf} AND {due} AND NOT {held})"),
                format!("count(*) FILTER (WHERE {unf} AND NOT {due} AND NOT {held})"),
                format!("count(*) FILTER (WHERE {unf} AND {held})"),
            ),
        };
        let finished = match t.processed_at() {
            Some(p) => format!("count(*) FILTER (WHERE {} IS NOT NULL)", f.col(p)),
            None => "NULL::int8".into(),
        };
        // The dead-letter table is counted in the same statement, so in the same snapshot: a
        // row that moves there meanwhile is counted once.
        let dead = match (f.dead_column(), f.dead_table()) {
            (Some(c), _) => format!("count(*) FILTER (WHERE {c} IS NOT NULL)"),
            // A sample reads the dead-letter table apart (see `stats`), and a kinds table
            // counts it by kind below.
            (None, Some(_)) if sample.is_some() || t.kind().is_some() => "NULL::int8".into(),
            (None, Some(d)) => format!("(SELECT count(*) FROM {d})"),
            (None, None) => "NULL::int8".into(),
        };
        let sampled = match sample {
            Some(_) => " TABLESAMPLE SYSTEM ($2::float8)",
            None => "",
        };
        // A kinds table: one row per kind (and per kind of its dead-letter table, in the same
        // statement), so every row counts once, in its kind.
        let kind = t.kind().map(|k| format!("{}::text", f.col(k)));
        let (kind_col, grouped) = match &kind {
            Some(k) => (format!(", {k}"), format!(" GROUP BY {k}")),
            None => (String::new(), String::new()),
        };
        let dead_kinds = match (&kind, f.dead_table(), sample) {
            (Some(_), Some(d), None) => {
                let k = format!("{}::text", ident(t.kind().unwrap_or_default()));
                broker_core::driver::dead_by_kind(&d, &k, "NULL::int8")
            }
            _ => String::new(),
        };
        let sql = format!(
            "{with}SELECT ({due_count})::int8, ({scheduled})::int8, ({in_work})::int8, \
             (count(*) FILTER (WHERE {unf} AND q.{a} > 1))::int8, ({finished})::int8, ({dead})::int8, \
             (min({due_ms}) FILTER (WHERE {unf} AND {due} AND NOT {held}))::int8{kind_col} \
             FROM {table} AS q{sampled}{grouped}{dead_kinds}",
            a = ident(t.attempt()),
            table = f.table,
            with = f.held_locks(),
        );
        let q = self.query(sql).bind(now_ms);
        let q = match sample {
            Some(percent) => q.bind(percent),
            None => q,
        };
        let count = |v: Option<i64>| scaled(v.unwrap_or(0), sample);
        if kind.is_some() {
            let rows = crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_all(c)))
                .await
                .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))?;
            let mut parts = Vec::with_capacity(rows.len());
            let mut oldest: Option<i64> = None;
            for row in &rows {
                let get = |i: usize| -> Result<Option<i64>> {
                    row.try_get::<Option<i64>, _>(i)
                        .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))
                };
                let kind: Option<String> = row
                    .try_get(7)
                    .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))?;
                let counts = [get(0)?, get(1)?, get(2)?, get(3)?, get(4)?, get(5)?];
                parts.push(broker_core::driver::kind_part(kind, counts, |n| {
                    scaled(n, sample)
                }));
                oldest = match (oldest, get(6)?) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            return Ok(StatsCounts::by_kind(t, parts, oldest));
        }
        let row = self.fetch_one(t, "stats", q).await?;
        let get = |i: usize| -> Result<Option<i64>> {
            row.try_get::<Option<i64>, _>(i)
                .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))
        };
        Ok(StatsCounts {
            due: count(get(0)?),
            scheduled: count(get(1)?),
            in_work: count(get(2)?),
            retrying: count(get(3)?),
            finished: t
                .processed_at()
                .map(|_| ())
                .and(get(4)?.map(|v| count(Some(v)))),
            dead: t
                .dead_letter()
                .map(|_| ())
                .and(get(5)?.map(|v| count(Some(v)))),
            oldest_due_ms: get(6)?,
            kinds: Vec::new(),
        })
    }

    /// A kinds table's dead letters by kind, from its dead-letter table `d`: counted, or
    /// (`sample`: a percentage of its pages) from a sample scaled to the table.
    async fn dead_kinds(
        &self,
        t: &TableDescription,
        d: &str,
        sample: Option<f64>,
    ) -> Result<Vec<broker_core::KindStats>> {
        let k = ident(t.kind().unwrap_or_default());
        let sampled = if sample.is_some() {
            " TABLESAMPLE SYSTEM ($1::float8)"
        } else {
            ""
        };
        let q = self.query(format!(
            "SELECT count(*)::int8, {k}::text FROM {d}{sampled} GROUP BY {k}::text"
        ));
        let q = match sample {
            Some(percent) => q.bind(percent),
            None => q,
        };
        let rows = crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_all(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))?;
        rows.iter()
            .map(|r| -> std::result::Result<_, sqlx::Error> {
                let n: i64 = r.try_get(0)?;
                let mut part = broker_core::KindStats::new(r.try_get(1)?);
                part.dead = Some(scaled(n, sample));
                Ok(part)
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))
    }

    async fn fetch_one(
        &self,
        t: &TableDescription,
        name: &'static str,
        q: sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<PgRow> {
        crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_one(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(t.name(), name, e))
    }

    async fn execute(
        &self,
        t: &TableDescription,
        name: &'static str,
        q: sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<u64> {
        crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.execute(c)))
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| SqlxBrokerError::statement(t.name(), name, e))
    }

    /// With [`DeadLetters::Ids`], checks in `tx` that every id is a dead letter, locking them.
    async fn all_dead(
        &self,
        tx: &mut PgConnection,
        t: &TableDescription,
        which: &DeadLetters,
    ) -> Result<()> {
        let DeadLetters::Ids(ids) = which else {
            return Ok(());
        };
        let f = Frag::new(t);
        let (from, dead) = match (f.dead_column(), f.dead_table()) {
            (Some(c), _) => (f.table.clone(), format!("{c} IS NOT NULL")),
            (None, Some(d)) => (d, "TRUE".into()),
            (None, None) => unreachable!("checked by the core"),
        };
        let sql = format!(
            "SELECT q.{id}::int8 FROM {from} AS q WHERE q.{id} = ANY($1::int8[]) AND {dead} FOR UPDATE",
            id = f.id
        );
        let found: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .persistent(self.prepared)
            .bind(ids.clone())
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| SqlxBrokerError::statement(t.name(), "dead letters", e))?;
        match ids.iter().find(|id| !found.contains(id)) {
            Some(missing) => Err(SqlxBrokerError::RowNotFound {
                table: t.name().to_owned(),
                id: *missing,
                where_: " among the dead letters",
            }),
            None => Ok(()),
        }
    }

    /// Why row `id` was not changed: gone or finished, in work, or (`due`) due already.
    async fn why_not(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = Frag::new(t);
        let sql = format!(
            "{with}SELECT {held}, {due} FROM {table} AS q WHERE q.{id} = $2::int8 AND {unf}",
            with = f.held_locks(),
            held = f.held(),
            due = f.due(),
            table = f.table,
            id = f.id,
            unf = f.unfinished(),
        );
        let q = self.query(sql).bind(now_ms).bind(id);
        let row = crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_optional(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(t.name(), "row check", e))?;
        Ok(match row {
            None => RowChange::NotFound,
            Some(r) if r.try_get::<bool, _>(0).unwrap_or(false) => {
                RowChange::InWork(f.holder().into())
            }
            Some(_) => RowChange::Unchanged,
        })
    }

    /// Runs `change` (a statement on row `$2` at `$1`, fenced by the mode's hold) and tells
    /// what happened. Advisory tables hold the row's key for the statement, so no claim can
    /// take the row meanwhile.
    async fn fenced(
        &self,
        t: &TableDescription,
        name: &'static str,
        id: i64,
        now_ms: i64,
        change: String,
        signal: Option<Signal>,
    ) -> Result<RowChange> {
        let f = Frag::new(t);
        let err = |e| SqlxBrokerError::statement(t.name(), name, e);
        // The signal rides in the change's statement: sent at its commit, and only when it
        // changed a row.
        let (change, payload) = match signal {
            Some(s) => (notifying(&change, 3), Some(s.payload(t.name()))),
            None => (change, None),
        };
        let bind_signal = |q: sqlx::query::Query<'static, sqlx::Postgres, _>| match &payload {
            Some(p) => q.bind(SIGNALS).bind(p.clone()),
            None => q,
        };
        if let ModeColumns::Advisory { key: template } = t.mode_columns() {
            // The key lock lives in the session: a connection of its own, closed afterwards.
            let mut conn = PgConnection::connect_with(&self.pool.connect_options())
                .await
                .map_err(err)?;
            let sql = format!(
                "SELECT {key} FROM {table} AS q WHERE q.{id} = $1::int8 AND {unf}",
                key = f.key(template),
                table = f.table,
                id = f.id,
                unf = f.unfinished(),
            );
            let key: Option<String> = sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(id)
                .fetch_optional(&mut conn)
                .await
                .map_err(err)?;
            let Some(key) = key else {
                let _ = conn.close().await;
                return Ok(RowChange::NotFound);
            };
            let locked: bool =
                sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1::text, 0))")
                    .bind(&key)
                    .fetch_one(&mut conn)
                    .await
                    .map_err(err)?;
            if !locked {
                let _ = conn.close().await;
                return Ok(RowChange::InWork(format!(
                    "its advisory key \"{key}\" is held"
                )));
            }
            let n = bind_signal(sqlx::query(AssertSqlSafe(change)).bind(now_ms).bind(id))
                .execute(&mut conn)
                .await
                .map_err(err)?
                .rows_affected();
            // Closing the session frees the key.
            let _ = conn.close().await;
            if n > 0 {
                return Ok(RowChange::Done);
            }
            return self.why_not(t, id, now_ms).await;
        }
        let n = self
            .execute(
                t,
                name,
                bind_signal(self.query(change).bind(now_ms).bind(id)),
            )
            .await?;
        if n > 0 {
            return Ok(RowChange::Done);
        }
        self.why_not(t, id, now_ms).await
    }

    /// The rows a fenced change may touch: row `$2` if unfinished and, in row lock mode, not
    /// locked (a locking read that skips a locked row), in lease mode not leased.
    fn target(&self, t: &TableDescription) -> String {
        let f = Frag::new(t);
        let unf = f.unfinished();
        match t.mode() {
            ClaimMode::RowLock => format!(
                "q.{id} IN (SELECT q.{id} FROM {table} AS q WHERE q.{id} = $2::int8 AND {unf} \
                 FOR UPDATE OF q SKIP LOCKED)",
                id = f.id,
                table = f.table,
            ),
            ClaimMode::Lease => format!("q.{} = $2::int8 AND {unf} AND NOT {}", f.id, f.held()),
            _ => format!("q.{} = $2::int8 AND {unf}", f.id),
        }
    }
}

/// `change` (an `INSERT`, `UPDATE` or `DELETE` without `RETURNING`) as a statement that also
/// notifies, once per row it changes (PostgreSQL folds equal notifications of a transaction
/// into one), on channel `$first` with payload `$first + 1`; it returns one row per change, so
/// its row count is the change's. One statement: the notification is sent when the change
/// commits, and a listener never hears it before the change is visible.
fn notifying(change: &str, first: usize) -> String {
    format!(
        "WITH sqlx_broker_changed AS ({change} RETURNING 1) \
         SELECT pg_notify(${first}::text, ${}::text) FROM sqlx_broker_changed",
        first + 1
    )
}

/// `n` rows counted, or counted in a sample of `sample` percent of the table (scaled to it,
/// rounded to whole rows, an estimate).
fn scaled(n: i64, sample: Option<f64>) -> Count {
    let n = u64::try_from(n).unwrap_or(0);
    match sample {
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        Some(percent) => Count::estimate((n as f64 * 100.0 / percent).round() as u64),
        None => Count::exact(n),
    }
}

/// The control table's DDL (see [`CONTROL_TABLE`]).
pub(crate) fn control_ddl() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {CONTROL_TABLE} (queue TEXT PRIMARY KEY, \
         paused_at_ms BIGINT NOT NULL, paused_by TEXT NOT NULL)"
    )
}

/// The cancel table's DDL (see [`CANCEL_TABLE`]): its key serves the read of one queue's
/// requests.
pub(crate) fn cancels_ddl() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {CANCEL_TABLE} (queue TEXT NOT NULL, id BIGINT NOT NULL, \
         requested_at_ms BIGINT NOT NULL, PRIMARY KEY (queue, id))"
    )
}

/// The statement of [`drop_ddl`](crate::schema::drop_ddl) that deletes a dropped queue's pause
/// (see [`broker_core::driver::unpause_ddl`]). Not a `DO` block, as it was: a name holding the
/// block's dollar-quote tag ended its body early.
pub(crate) fn unpause_ddl(table: &str) -> String {
    broker_core::driver::unpause_ddl(&literal(table))
}

impl AdminDriver for PgAdmin<'_> {
    /// Counts by state. Up to [`EXACT_ROWS`](broker_core::admin::EXACT_ROWS) rows (by the
    /// planner's estimate) every row is read and the counts are exact; past that, the counts
    /// come from a sample of the table's pages (`TABLESAMPLE SYSTEM`, about that many rows)
    /// scaled to the table and are marked as estimates, and the oldest due row is found
    /// through the claim index, so one call stays cheap on a table of millions.
    async fn stats(&self, t: &TableDescription, now_ms: i64) -> Result<StatsCounts> {
        let planned = self.planned_rows(t, &ident(t.name())).await?;
        let exact_rows = broker_core::admin::EXACT_ROWS;
        if planned <= exact_rows {
            return self.counted(t, now_ms, None).await;
        }
        // Precision loss is irrelevant to a sampling percentage.
        #[allow(clippy::cast_precision_loss)]
        let percent = (exact_rows as f64 * 100.0 / planned as f64).clamp(0.001, 100.0);
        let mut counts = self.counted(t, now_ms, Some(percent)).await?;
        counts.oldest_due_ms = self.oldest_due(t, now_ms).await?;
        if let (Some(d), Some(_)) = (Frag::new(t).dead_table(), t.kind()) {
            // By kind: counted up to as many rows as the table's sample, sampled past that.
            let planned_dead = self.planned_rows(t, &d).await?;
            #[allow(clippy::cast_precision_loss)]
            let sample = (planned_dead > exact_rows)
                .then(|| (exact_rows as f64 * 100.0 / planned_dead as f64).clamp(0.001, 100.0));
            let mut parts = std::mem::take(&mut counts.kinds);
            parts.extend(self.dead_kinds(t, &d, sample).await?);
            let oldest = counts.oldest_due_ms;
            return Ok(StatsCounts::by_kind(t, parts, oldest));
        }
        if let Some(d) = Frag::new(t).dead_table() {
            let planned_dead = self.planned_rows(t, &d).await?;
            counts.dead = Some(if planned_dead <= exact_rows {
                let n: i64 = self
                    .fetch_one(t, "stats", self.query(format!("SELECT count(*) FROM {d}")))
                    .await?
                    .try_get(0)
                    .map_err(|e| SqlxBrokerError::statement(t.name(), "stats", e))?;
                Count::exact(u64::try_from(n).unwrap_or(0))
            } else {
                Count::estimate(planned_dead)
            });
        }
        Ok(counts)
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
        let (unf, due, held) = (f.unfinished(), f.due(), f.held());
        let (from, filter) = match state {
            JobState::Due => (f.table.clone(), format!("{unf} AND {due} AND NOT {held}")),
            JobState::Scheduled => (
                f.table.clone(),
                format!("{unf} AND NOT {due} AND NOT {held}"),
            ),
            JobState::InWork => (f.table.clone(), format!("{unf} AND {held}")),
            JobState::Retrying => (
                f.table.clone(),
                format!("{unf} AND q.{} > 1", ident(t.attempt())),
            ),
            JobState::Finished => (
                f.table.clone(),
                format!(
                    "{} IS NOT NULL AND $1::int8 IS NOT NULL",
                    f.col(t.processed_at().expect("checked by the core"))
                ),
            ),
            _ => match (f.dead_column(), f.dead_table()) {
                (Some(c), _) => (
                    f.table.clone(),
                    format!("{c} IS NOT NULL AND $1::int8 IS NOT NULL"),
                ),
                (None, Some(d)) => (d, "$1::int8 IS NOT NULL".into()),
                (None, None) => unreachable!("checked by the core"),
            },
        };
        let time = |c: Option<&str>| {
            c.map(|c| ms_or_null(&f.col(c)))
                .unwrap_or_else(|| "NULL::int8".into())
        };
        let finished_at = match state {
            JobState::Finished => time(t.processed_at()),
            JobState::Dead => f
                .dead_column()
                .map(|c| ms_or_null(&c))
                .unwrap_or_else(|| "NULL::int8".into()),
            _ => "NULL::int8".into(),
        };
        let payload = match t.payload() {
            Some((p, broker_core::ColumnType::Bytes)) => {
                format!("{} || encode({}, 'hex')", literal("\\x"), f.col(p))
            }
            Some((p, _)) => format!("{}::text", f.col(p)),
            None => "NULL::text".into(),
        };
        let text_of = |c: Option<&str>| {
            c.map(|c| format!("{}::text", f.col(c)))
                .unwrap_or_else(|| "NULL::text".into())
        };
        let sql = format!(
            "{with}SELECT q.{id}::int8, q.{a}::int8, {due_ms}, {lu}, {finished_at}, {key}, {group}, \
             left({payload}, {cap} + 1), {error}, {kind} FROM {from} AS q \
             WHERE {filter}{of_kind} AND q.{id} > $2::int8 ORDER BY q.{id} LIMIT $3::int8",
            id = f.id,
            a = ident(t.attempt()),
            due_ms = time(t.due_at()),
            lu = time(t.locked_until()),
            key = t
                .advisory_lock()
                .map_or_else(|| "NULL::text".into(), |k| f.key(k)),
            group = text_of(t.group()),
            kind = text_of(t.kind()),
            of_kind = match (kind, t.kind()) {
                (Some(_), Some(c)) => format!(" AND {}::text = $4::text", f.col(c)),
                _ => String::new(),
            },
            // `substr` rather than `left`: it fetches only the slice it needs of a value
            // stored out of line, where `left` would read all of it first.
            error = t.last_error().map_or_else(
                || "NULL::text".into(),
                |c| format!(
                    "substr({}::text, 1, {})",
                    f.col(c),
                    error_chars.saturating_add(1)
                )
            ),
            cap = broker_core::admin::PAYLOAD_PREVIEW_BYTES,
            with = f.held_locks(),
        );
        let q = self
            .query(sql)
            .bind(now_ms)
            .bind(page.after.unwrap_or(i64::MIN))
            .bind(i64::try_from(page.limit).unwrap_or(i64::MAX));
        let q = match (kind, t.kind()) {
            (Some(k), Some(_)) => q.bind(k.to_owned()),
            _ => q,
        };
        let rows = crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_all(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(t.name(), "list", e))?;
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
        let mut tx = self.begin(t.name()).await?;
        self.all_dead(&mut tx, t, which).await?;
        // Back to a fresh row's state: attempt 1, due now, no lease.
        let mut reset = vec![format!("{} = 1", ident(t.attempt()))];
        if let Some(d) = t.due_at() {
            reset.push(format!("{} = {}", ident(d), ts("$1")));
        }
        if let Some(lu) = t.locked_until() {
            reset.push(format!("{} = NULL", ident(lu)));
        }
        let moved = match (f.dead_column(), f.dead_table()) {
            (Some(c), _) => {
                let sql = format!(
                    "UPDATE {table} AS q SET {c0} = NULL, {reset} WHERE {c} IS NOT NULL AND {which} \
                     AND $1::int8 IS NOT NULL",
                    table = f.table,
                    c0 = ident(match t.dead_letter() {
                        Some(DeadLetter::Column(c)) => c,
                        _ => unreachable!(),
                    }),
                    reset = reset.join(", "),
                    which = f.which(which, 2),
                );
                bind_which(self.query(sql).bind(now_ms), which)
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?
                    .rows_affected()
            }
            (None, Some(d)) => {
                // One statement moves the rows back (with their ids: the identity column takes
                // them with OVERRIDING SYSTEM VALUE), the next resets them. The dead-letter table
                // has the queue table's columns in its order (the DDL helper makes it so).
                let sql = format!(
                    "WITH sqlx_broker_back AS (DELETE FROM {d} AS q WHERE {which} RETURNING q.*) \
                     INSERT INTO {table} OVERRIDING SYSTEM VALUE SELECT * FROM sqlx_broker_back \
                     RETURNING {id}::int8",
                    table = f.table,
                    id = f.id,
                    which = f.which(which, 1),
                );
                let q = sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql)).persistent(self.prepared);
                let q = match which {
                    DeadLetters::Ids(ids) => q.bind(ids.clone()),
                    DeadLetters::ErrorContains(text) => q.bind(text.clone()),
                    _ => q.bind(None::<String>),
                };
                let ids = q.fetch_all(&mut *tx).await.map_err(err)?;
                if !ids.is_empty() {
                    let sql = format!(
                        "UPDATE {table} AS q SET {reset} WHERE q.{id} = ANY($2::int8[])",
                        table = f.table,
                        id = f.id,
                        reset = reset.join(", "),
                    );
                    let sql = if t.due_at().is_some() {
                        sql
                    } else {
                        sql.replace("WHERE", "WHERE $1::int8 IS NOT NULL AND")
                    };
                    self.query(sql)
                        .bind(now_ms)
                        .bind(ids.clone())
                        .execute(&mut *tx)
                        .await
                        .map_err(err)?;
                }
                u64::try_from(ids.len()).unwrap_or(u64::MAX)
            }
            (None, None) => unreachable!("checked by the core"),
        };
        if moved > 0 {
            // In the transaction: listeners hear it when the rows are back, never before.
            sqlx::query("SELECT pg_notify($1::text, $2::text)")
                .persistent(self.prepared)
                .bind(SIGNALS)
                .bind(Signal::RequeueDead.payload(t.name()))
                .execute(&mut *tx)
                .await
                .map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(moved)
    }

    async fn discard_dead(&self, t: &TableDescription, which: &DeadLetters) -> Result<u64> {
        let f = Frag::new(t);
        let err = |e| SqlxBrokerError::statement(t.name(), "discard dead letters", e);
        let mut tx = self.begin(t.name()).await?;
        self.all_dead(&mut tx, t, which).await?;
        let sql = match (f.dead_column(), f.dead_table()) {
            (Some(c), _) => format!(
                "DELETE FROM {} AS q WHERE {c} IS NOT NULL AND {}",
                f.table,
                f.which(which, 1)
            ),
            (None, Some(d)) => format!("DELETE FROM {d} AS q WHERE {}", f.which(which, 1)),
            (None, None) => unreachable!("checked by the core"),
        };
        let n = bind_which(self.query(sql), which)
            .execute(&mut *tx)
            .await
            .map_err(err)?
            .rows_affected();
        tx.commit().await.map_err(err)?;
        Ok(n)
    }

    async fn cancel(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = Frag::new(t);
        let sql = format!(
            "DELETE FROM {} AS q WHERE {} AND $1::int8 IS NOT NULL",
            f.table,
            self.target(t)
        );
        self.fenced(t, "cancel", id, now_ms, sql, None).await
    }

    async fn run_now(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = Frag::new(t);
        let Some(d) = t.due_at() else {
            // Without a due time every unfinished row is due.
            return self.why_not(t, id, now_ms).await;
        };
        let sql = format!(
            "UPDATE {} AS q SET {} = {} WHERE {} AND NOT {}",
            f.table,
            ident(d),
            ts("$1"),
            self.target(t),
            f.due(),
        );
        self.fenced(t, "run now", id, now_ms, sql, Some(Signal::RunNow))
            .await
    }

    async fn purge_finished(&self, t: &TableDescription, before_ms: i64) -> Result<u64> {
        let f = Frag::new(t);
        let p = f.col(t.processed_at().expect("checked by the core"));
        let sql = format!(
            "DELETE FROM {} AS q WHERE {p} IS NOT NULL AND {p} < {}",
            f.table,
            ts("$1")
        );
        self.execute(t, "purge", self.query(sql).bind(before_ms))
            .await
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
        let sql = format!(
            "UPDATE {target} AS q SET {col} = $2::text WHERE q.{} = $1::int8",
            f.id
        );
        self.execute(
            t,
            "record error",
            self.query(sql)
                .bind(id)
                .bind(last_error_text(error).to_owned()),
        )
        .await
        .map(drop)
    }

    async fn set_pause(&self, table: &str, pause: Option<&Pause>) -> Result<bool> {
        let err = |e| SqlxBrokerError::statement(table, "pause", e);
        // The signal rides in the change's statement: sent when the change commits, and only
        // when it changed the row.
        let q = match pause {
            Some(p) => self
                .query(notifying(
                    &format!(
                        "INSERT INTO {CONTROL_TABLE} (queue, paused_at_ms, paused_by) \
                         VALUES ($1::text, $2::int8, $3::text) ON CONFLICT (queue) DO NOTHING"
                    ),
                    4,
                ))
                .bind(table.to_owned())
                .bind(p.since_ms)
                .bind(p.by.clone())
                .bind(SIGNALS)
                .bind(Signal::Pause.payload(table)),
            None => self
                .query(notifying(
                    &format!("DELETE FROM {CONTROL_TABLE} WHERE queue = $1::text"),
                    2,
                ))
                .bind(table.to_owned())
                .bind(SIGNALS)
                .bind(Signal::Resume.payload(table)),
        };
        crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.execute(c)))
            .await
            .map(|r| r.rows_affected() > 0)
            .map_err(err)
    }

    async fn pause_state(&self, table: &str) -> Result<Option<Pause>> {
        let q = sqlx::query_as::<_, (i64, String)>(AssertSqlSafe(format!(
            "SELECT paused_at_ms, paused_by FROM {CONTROL_TABLE} WHERE queue = $1::text"
        )))
        .persistent(self.prepared)
        .bind(table.to_owned());
        let row = crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_optional(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(table, "pause state", e))?;
        Ok(row.map(|(since_ms, by)| Pause { since_ms, by }))
    }

    async fn has_control_table(&self) -> Result<bool> {
        let q = sqlx::query_scalar::<_, bool>(AssertSqlSafe(format!(
            "SELECT to_regclass('{CONTROL_TABLE}') IS NOT NULL"
        )))
        .persistent(self.prepared);
        crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_one(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement("", "control table check", e))
    }

    async fn request_cancel(&self, table: &str, id: i64, now_ms: i64) -> Result<()> {
        // The update on conflict returns the row, so a repeated request notifies again.
        let q = self
            .query(notifying(
                &format!(
                    "INSERT INTO {CANCEL_TABLE} (queue, id, requested_at_ms) \
                     VALUES ($1::text, $2::int8, $3::int8) \
                     ON CONFLICT (queue, id) DO UPDATE SET requested_at_ms = EXCLUDED.requested_at_ms"
                ),
                4,
            ))
            .bind(table.to_owned())
            .bind(id)
            .bind(now_ms)
            .bind(SIGNALS)
            .bind(Signal::Cancel { id }.payload(table));
        crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.execute(c)))
            .await
            .map(drop)
            .map_err(|e| SqlxBrokerError::statement(table, "cancel request", e))
    }

    async fn cancel_requests(&self, table: &str) -> Result<Vec<i64>> {
        let q = sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
            "SELECT id FROM {CANCEL_TABLE} WHERE queue = $1::text"
        )))
        .persistent(self.prepared)
        .bind(table.to_owned());
        crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.fetch_all(c)))
            .await
            .map_err(|e| SqlxBrokerError::statement(table, "cancel requests", e))
    }

    async fn clear_cancel(&self, table: &str, id: i64) -> Result<()> {
        let q = self
            .query(format!(
                "DELETE FROM {CANCEL_TABLE} WHERE queue = $1::text AND id = $2::int8"
            ))
            .bind(table.to_owned())
            .bind(id);
        crate::sql::on_pool(self.pool, self.prepared, |c| Box::pin(q.execute(c)))
            .await
            .map(drop)
            .map_err(|e| SqlxBrokerError::statement(table, "cancel clear", e))
    }
}
