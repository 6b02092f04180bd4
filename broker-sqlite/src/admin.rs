//! Operating a SQLite queue: counts by state, listings, and changes to rows outside the claim
//! path, each fenced as a settlement is (see `broker_core::admin`).
//!
//! What "in work" means on SQLite, and how exact it is:
//! - lease: a `locked_until` after now (exact, on the host's clock);
//! - advisory: a row whose key this process holds (the key table of the database file, see
//!   `crate::keys`), counted once per held key (one delivery per key); rows waiting behind a held
//!   key count as due. The held keys are read once, just before the statement, and bound into
//!   it, so every row of the statement is judged against the same keys. Exact for this
//!   process; deliveries of another process on the same file are not seen (its keys are its
//!   own), and a key held for a row of another table of the file counts too (keys belong to the
//!   file, as the claims treat them).
//!
//! SQLite has no row lock mode. Every count is one statement, so one snapshot of the file (the
//! dead-letter table included).
//!
//! These statements are not on the hot path: they are built per call. Writes take this
//! process's turn to write to the file, as the strategies' writes do.

use std::sync::Arc;

use broker_core::driver::{AdminDriver, CANCEL_TABLE, CONTROL_TABLE, StatsCounts};
use broker_core::{
    ClaimMode, ColumnType, Count, DeadLetter, DeadLetters, JobInfo, JobState, KeyPart, KeyTemplate,
    ModeColumns, Page, Pause, Result, SqlxBrokerError, TableDescription,
    admin::{RowChange, last_error_text},
};
use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteRow};
use sqlx::{AssertSqlSafe, Connection, Row, Sqlite, SqliteConnection, SqlitePool};

use crate::keys::KeyTable;
use crate::sql::{due_key, ident};

/// A text as a SQL string literal (only quotes are doubled). For the broker's own texts (key
/// template pieces, table names), never for values from outside.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Texts as a JSON array, for `json_each`.
fn json_texts<'a>(texts: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = String::from("[");
    for (i, text) in texts.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push(']');
    out
}

/// Ids as a JSON array, for `json_each`.
fn json_ids(ids: &[i64]) -> String {
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("[{}]", ids.join(","))
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

    fn and(mut self, other: &Q) -> Self {
        self.sql.push_str(&other.sql);
        self.args.extend(other.args.iter().cloned());
        self
    }

    fn query(self) -> Query<'static, Sqlite, SqliteArguments> {
        let mut q = sqlx::query(AssertSqlSafe(self.sql));
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
    Q::new("count(CASE WHEN ").and(cond).push(" THEN 1 END)")
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

/// The fragments of one table's admin statements. Columns go unqualified: every statement
/// reads one table at a time (a subquery's columns are its own table's).
struct Frag<'t> {
    t: &'t TableDescription,
    table: String,
    id: String,
    /// Advisory mode: the keys this process holds, as a JSON array, read once per statement.
    held_keys: String,
}

impl<'t> Frag<'t> {
    fn new(t: &'t TableDescription, keys: &KeyTable) -> Self {
        let held_keys = match t.mode() {
            ClaimMode::Advisory => {
                let held = keys.held();
                json_texts(held.iter().map(String::as_str))
            }
            _ => "[]".into(),
        };
        Self {
            t,
            table: ident(t.name()),
            id: ident(t.id()),
            held_keys,
        }
    }

    /// Unfinished rows.
    fn unfinished(&self) -> Q {
        let mut c: Vec<String> = self
            .t
            .unfinished_columns()
            .into_iter()
            .map(|c| format!("{} IS NULL", ident(c)))
            .collect();
        if c.is_empty() {
            c.push("1 = 1".into());
        }
        Q::new(format!("({})", c.join(" AND ")))
    }

    /// Due at `now_ms`, as the claim reads it (a NULL due time is due at once).
    fn due(&self, now_ms: i64) -> Q {
        match self.t.due_at() {
            Some(d) => Q::new(format!("({} <= ", due_key(&ident(d))))
                .int(now_ms)
                .push(")"),
            None => Q::new("(1 = 1)"),
        }
    }

    /// The advisory key of a row, as the claim renders it (NULL values as empty text).
    fn key(&self, template: &KeyTemplate) -> String {
        let parts: Vec<String> = template
            .parts()
            .iter()
            .map(|p| match p {
                KeyPart::Literal(text) => literal(text),
                KeyPart::Column(c) => format!("ifnull(CAST({} AS TEXT), '')", ident(c)),
            })
            .collect();
        format!("('' || {})", parts.join(" || "))
    }

    /// Whether a delivery holds the row now (see the module docs).
    fn held(&self, now_ms: i64) -> Q {
        match self.t.mode_columns() {
            ModeColumns::Lease { locked_until } => {
                let lu = ident(locked_until);
                Q::new(format!("({lu} IS NOT NULL AND {lu} > "))
                    .int(now_ms)
                    .push(")")
            }
            ModeColumns::Advisory { key } => Q::new(format!(
                "({} IN (SELECT value FROM json_each(",
                self.key(key)
            ))
            .text(self.held_keys.clone())
            .push(")))"),
            // Row lock mode: SQLite offers none (the core refuses such a table before any admin
            // call reaches here), so nothing can hold a row.
            _ => Q::new("(1 = 0)"),
        }
    }

    /// What holds a row, in words, for a refusal.
    fn holder(&self) -> &'static str {
        match self.t.mode() {
            ClaimMode::Lease => "its lease has not run out",
            _ => {
                "its advisory key is held in this process (by its delivery, or one of another row with the same key)"
            }
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

    /// Where the dead letters are, and the condition of one.
    fn dead_letters(&self) -> (String, String) {
        match (self.dead_column(), self.dead_table()) {
            (Some(c), _) => (self.table.clone(), format!("{} IS NOT NULL", ident(c))),
            (None, Some(d)) => (d, "1 = 1".into()),
            (None, None) => unreachable!("checked by the core"),
        }
    }

    /// Which dead letters.
    fn which(&self, which: &DeadLetters) -> Q {
        match which {
            DeadLetters::Ids(ids) => {
                Q::new(format!("{} IN (SELECT value FROM json_each(", self.id))
                    .text(json_ids(ids))
                    .push("))")
            }
            DeadLetters::ErrorContains(text) => Q::new(format!(
                "instr({}, ",
                ident(self.t.last_error().expect("checked by the core"))
            ))
            .text(text.clone())
            .push(") > 0"),
            _ => Q::new("1 = 1"),
        }
    }
}

/// The operator statements of a SQLite backend ([`AdminDriver`]), borrowing its pool: what
/// [`Backend::admin`](broker_core::Backend::admin) returns.
pub struct SqliteAdmin<'a> {
    pub(crate) pool: &'a SqlitePool,
    /// The database file's key table and turn to write.
    pub(crate) file: &'a Arc<KeyTable>,
}

impl SqliteAdmin<'_> {
    fn frag<'t>(&self, t: &'t TableDescription) -> Frag<'t> {
        Frag::new(t, self.file)
    }

    async fn fetch_all(&self, t: &str, name: &'static str, q: Q) -> Result<Vec<SqliteRow>> {
        q.query()
            .fetch_all(self.pool)
            .await
            .map_err(|e| SqlxBrokerError::statement(t, name, e))
    }

    /// Runs a write statement in this process's turn to write.
    async fn execute(&self, t: &str, name: &'static str, q: Q) -> Result<u64> {
        let err = |e| SqlxBrokerError::statement(t, name, e);
        let mut conn = self.pool.acquire().await.map_err(err)?;
        let _turn = self.file.write_turn().await;
        q.query()
            .execute(&mut *conn)
            .await
            .map(|r| r.rows_affected())
            .map_err(err)
    }

    /// With [`DeadLetters::Ids`], checks in `tx` (a write transaction: nothing changes under
    /// it) that every id is a dead letter.
    async fn all_dead(
        &self,
        tx: &mut SqliteConnection,
        t: &TableDescription,
        which: &DeadLetters,
    ) -> Result<()> {
        let DeadLetters::Ids(ids) = which else {
            return Ok(());
        };
        let f = self.frag(t);
        let (from, dead) = f.dead_letters();
        let sql = Q::new(format!(
            "SELECT {id} FROM {from} WHERE {dead} AND ",
            id = f.id
        ))
        .and(&f.which(which));
        let found: Vec<i64> = sql
            .query()
            .fetch_all(&mut *tx)
            .await
            .and_then(|rows| rows.iter().map(|r| r.try_get::<i64, _>(0)).collect())
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

    /// Runs `steps` in one write transaction (`BEGIN IMMEDIATE`, in this process's turn to
    /// write) after checking the ids of `which`; returns the rows the last step changed.
    async fn on_dead(
        &self,
        t: &TableDescription,
        name: &'static str,
        which: &DeadLetters,
        steps: Vec<Q>,
    ) -> Result<u64> {
        let err = |e| SqlxBrokerError::statement(t.name(), name, e);
        let mut conn = self.pool.acquire().await.map_err(err)?;
        let _turn = self.file.write_turn().await;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(err)?;
        let done = async {
            self.all_dead(&mut tx, t, which).await?;
            let mut n = 0;
            for q in steps {
                n = q
                    .query()
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?
                    .rows_affected();
            }
            Ok(n)
        }
        .await;
        // Ended here, not on drop: a rollback left to the drop would keep the file's write lock
        // until the connection's next use.
        match done {
            Ok(n) => {
                tx.commit().await.map_err(err)?;
                Ok(n)
            }
            Err(e) => {
                tx.rollback().await.map_err(err)?;
                Err(e)
            }
        }
    }

    /// Why row `id` was not changed: gone or finished, in work, or (`due`) due already.
    async fn why_not(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = self.frag(t);
        let sql = Q::new("SELECT ")
            .and(&f.held(now_ms))
            .push(&format!(" FROM {} WHERE {} = ", f.table, f.id))
            .int(id)
            .push(" AND ")
            .and(&f.unfinished());
        let rows = self.fetch_all(t.name(), "row check", sql).await?;
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
    /// `WHERE`) and tells what happened. Advisory tables take the row's key in this process's
    /// key table first and hold it for the change, so no claim can take the row meanwhile.
    async fn fenced(
        &self,
        t: &TableDescription,
        name: &'static str,
        id: i64,
        now_ms: i64,
        change: Q,
    ) -> Result<RowChange> {
        let f = self.frag(t);
        let mut _key = None;
        if let ModeColumns::Advisory { key } = t.mode_columns() {
            let sql = Q::new(format!(
                "SELECT {} FROM {} WHERE {} = ",
                f.key(key),
                f.table,
                f.id
            ))
            .int(id)
            .push(" AND ")
            .and(&f.unfinished());
            let rows = self.fetch_all(t.name(), name, sql).await?;
            let Some(row) = rows.first() else {
                return Ok(RowChange::NotFound);
            };
            let key: String = row
                .try_get(0)
                .map_err(|e| SqlxBrokerError::statement(t.name(), name, e))?;
            match self.file.try_lock(&key) {
                Some(lock) => _key = Some(lock),
                None => {
                    return Ok(RowChange::InWork(format!(
                        "its advisory key \"{key}\" is held in this process"
                    )));
                }
            }
        }
        let n = self.execute(t.name(), name, change).await?;
        // The key is free again before the row is looked at once more.
        drop(_key);
        if n > 0 {
            return Ok(RowChange::Done);
        }
        self.why_not(t, id, now_ms).await
    }

    /// The rows a fenced change may touch: row `id` if unfinished and, in lease mode, not
    /// leased.
    fn target(&self, f: &Frag<'_>, id: i64, now_ms: i64) -> Q {
        let q = Q::new(format!("{} = ", f.id))
            .int(id)
            .push(" AND ")
            .and(&f.unfinished());
        match f.t.mode() {
            ClaimMode::Lease => q.push(" AND NOT ").and(&f.held(now_ms)),
            _ => q,
        }
    }
}

/// The control table's DDL (see [`CONTROL_TABLE`]).
pub(crate) fn control_ddl() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {CONTROL_TABLE} (queue TEXT PRIMARY KEY, \
         paused_at_ms INTEGER NOT NULL, paused_by TEXT NOT NULL)"
    )
}

/// The cancel table's DDL (see [`CANCEL_TABLE`]): its key serves the read of one queue's
/// requests.
pub(crate) fn cancels_ddl() -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {CANCEL_TABLE} (queue TEXT NOT NULL, id INTEGER NOT NULL, \
         requested_at_ms INTEGER NOT NULL, PRIMARY KEY (queue, id))"
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

impl AdminDriver for SqliteAdmin<'_> {
    async fn stats(&self, t: &TableDescription, now_ms: i64) -> Result<StatsCounts> {
        let f = self.frag(t);
        let (unf, due, held) = (f.unfinished(), f.due(now_ms), f.held(now_ms));
        let due_ms = t.due_at().map(ident).unwrap_or_else(|| "NULL".into());
        let free_due = all(&[&unf, &due, &not(&held)]);
        // Advisory counts one delivery per held key that has due rows; the rest of its due rows
        // count as due, its scheduled rows as scheduled.
        let (due_count, scheduled, in_work) = match t.mode_columns() {
            ModeColumns::Advisory { key } => {
                let keys = Q::new("count(DISTINCT CASE WHEN ")
                    .and(&all(&[&unf, &due, &held]))
                    .push(&format!(" THEN {} END)", f.key(key)));
                (
                    count_if(&all(&[&unf, &due])).push(" - ").and(&keys),
                    count_if(&all(&[&unf, &not(&due)])),
                    keys,
                )
            }
            _ => (
                count_if(&free_due),
                count_if(&all(&[&unf, &not(&due), &not(&held)])),
                count_if(&all(&[&unf, &held])),
            ),
        };
        let finished = match t.processed_at() {
            Some(p) => count_if(&Q::new(format!("{} IS NOT NULL", ident(p)))),
            None => Q::new("NULL"),
        };
        // The dead-letter table is counted in the same statement, so in the same snapshot: a
        // row that moves there meanwhile is counted once.
        let dead = match (f.dead_column(), f.dead_table()) {
            (Some(c), _) => count_if(&Q::new(format!("{} IS NOT NULL", ident(c)))),
            // A kinds table counts its dead-letter table by kind in the same statement.
            (None, Some(_)) if t.kind().is_some() => Q::new("0"),
            (None, Some(d)) => Q::new(format!("(SELECT count(*) FROM {d})")),
            (None, None) => Q::new("NULL"),
        };
        let kind = t.kind().map(|k| format!("CAST({} AS TEXT)", ident(k)));
        let kind_col = kind.as_ref().map(|k| format!(", {k}")).unwrap_or_default();
        let sql = Q::new("SELECT ")
            .and(&due_count)
            .push(", ")
            .and(&scheduled)
            .push(", ")
            .and(&in_work)
            .push(", ")
            .and(&count_if(&all(&[
                &unf,
                &Q::new(format!("{} > 1", ident(t.attempt()))),
            ])))
            .push(", ")
            .and(&finished)
            .push(", ")
            .and(&dead)
            .push(", min(CASE WHEN ")
            .and(&free_due)
            .push(&format!(" THEN {due_ms} END){kind_col} FROM {}", f.table));
        if let Some(kind) = kind {
            // One row per kind, then the dead-letter table's per kind: one statement, one
            // snapshot, every row counted once and in one kind.
            let mut sql = sql.push(&format!(" GROUP BY {kind}"));
            if let Some(d) = f.dead_table() {
                sql = sql.push(&broker_core::driver::dead_by_kind(&d, &kind, "NULL"));
            }
            let rows = self.fetch_all(t.name(), "stats", sql).await?;
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
                    Count::exact(u64::try_from(n).unwrap_or(0))
                }));
                oldest = match (oldest, get(6)?) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            return Ok(StatsCounts::by_kind(t, parts, oldest));
        }
        let rows = self.fetch_all(t.name(), "stats", sql).await?;
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
        let f = self.frag(t);
        let (unf, due, held) = (f.unfinished(), f.due(now_ms), f.held(now_ms));
        let (from, filter) = match state {
            JobState::Due => (f.table.clone(), all(&[&unf, &due, &not(&held)])),
            JobState::Scheduled => (f.table.clone(), all(&[&unf, &not(&due), &not(&held)])),
            JobState::InWork => (f.table.clone(), all(&[&unf, &held])),
            JobState::Retrying => (
                f.table.clone(),
                all(&[&unf, &Q::new(format!("{} > 1", ident(t.attempt())))]),
            ),
            JobState::Finished => (
                f.table.clone(),
                Q::new(format!(
                    "{} IS NOT NULL",
                    ident(t.processed_at().expect("checked by the core"))
                )),
            ),
            _ => {
                let (from, dead) = f.dead_letters();
                (from, Q::new(dead))
            }
        };
        let time = |c: Option<&str>| c.map(ident).unwrap_or_else(|| "NULL".into());
        let finished_at = match state {
            JobState::Finished => time(t.processed_at()),
            JobState::Dead => time(f.dead_column()),
            _ => time(None),
        };
        let cap = broker_core::admin::PAYLOAD_PREVIEW_BYTES;
        let payload = match t.payload() {
            // Hex of the first bytes, enough to fill the preview and tell it was cut.
            Some((p, ColumnType::Bytes)) => format!(
                "'\\x' || lower(hex(substr({}, 1, {})))",
                ident(p),
                cap / 2 + 1
            ),
            Some((p, _)) => format!("substr(CAST({} AS TEXT), 1, {})", ident(p), cap + 1),
            None => "NULL".into(),
        };
        let text_of = |c: Option<&str>| {
            c.map(|c| format!("CAST({} AS TEXT)", ident(c)))
                .unwrap_or_else(|| "NULL".into())
        };
        let sql = Q::new(format!(
            "SELECT {id}, {a}, {due_ms}, {lu}, {finished_at}, {key}, {group}, {payload}, {error}, \
             {kind} FROM {from} WHERE ",
            id = f.id,
            kind = text_of(t.kind()),
            a = ident(t.attempt()),
            due_ms = time(t.due_at()),
            lu = time(t.locked_until()),
            key = t
                .advisory_lock()
                .map_or_else(|| "NULL".into(), |k| f.key(k)),
            group = text_of(t.group()),
            error = t.last_error().map_or_else(
                || "NULL".into(),
                |c| format!(
                    "substr(CAST({} AS TEXT), 1, {})",
                    ident(c),
                    error_chars.saturating_add(1)
                )
            ),
        ))
        .and(&filter)
        .and(&match (kind, t.kind()) {
            (Some(k), Some(c)) => Q::new(format!(" AND {} = ", ident(c))).text(k),
            _ => Q::new(""),
        })
        .push(&format!(" AND {} > ", f.id))
        .int(page.after.unwrap_or(i64::MIN))
        .push(&format!(" ORDER BY {} LIMIT ", f.id))
        .int(i64::try_from(page.limit).unwrap_or(i64::MAX));
        let rows = self.fetch_all(t.name(), "list", sql).await?;
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
        let f = self.frag(t);
        // Back to a fresh row's state: attempt 1, due now, no lease.
        let mut reset = Q::new(format!("{} = 1", ident(t.attempt())));
        if let Some(d) = t.due_at() {
            reset = reset.push(&format!(", {} = ", ident(d))).int(now_ms);
        }
        if let Some(lu) = t.locked_until() {
            reset = reset.push(&format!(", {} = NULL", ident(lu)));
        }
        let steps = match (f.dead_column(), f.dead_table()) {
            (Some(c), _) => vec![
                Q::new(format!("UPDATE {} SET {} = NULL, ", f.table, ident(c)))
                    .and(&reset)
                    .push(&format!(" WHERE {} IS NOT NULL AND ", ident(c)))
                    .and(&f.which(which)),
            ],
            (None, Some(d)) => vec![
                // Back with their ids; the dead-letter table has the queue table's columns in its
                // order (the DDL helper makes it so). The reset reads the ids from the dead-letter
                // table before the last step deletes them there; the write transaction keeps
                // the three steps on the same rows.
                Q::new(format!("INSERT INTO {} SELECT * FROM {d} WHERE ", f.table))
                    .and(&f.which(which)),
                Q::new(format!("UPDATE {} SET ", f.table))
                    .and(&reset)
                    .push(&format!(
                        " WHERE {} IN (SELECT {} FROM {d} WHERE ",
                        f.id, f.id
                    ))
                    .and(&f.which(which))
                    .push(")"),
                Q::new(format!("DELETE FROM {d} WHERE ")).and(&f.which(which)),
            ],
            (None, None) => unreachable!("checked by the core"),
        };
        self.on_dead(t, "requeue dead letters", which, steps).await
    }

    async fn discard_dead(&self, t: &TableDescription, which: &DeadLetters) -> Result<u64> {
        let f = self.frag(t);
        let (from, dead) = f.dead_letters();
        let steps =
            vec![Q::new(format!("DELETE FROM {from} WHERE {dead} AND ")).and(&f.which(which))];
        self.on_dead(t, "discard dead letters", which, steps).await
    }

    async fn cancel(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = self.frag(t);
        let sql =
            Q::new(format!("DELETE FROM {} WHERE ", f.table)).and(&self.target(&f, id, now_ms));
        self.fenced(t, "cancel", id, now_ms, sql).await
    }

    async fn run_now(&self, t: &TableDescription, id: i64, now_ms: i64) -> Result<RowChange> {
        let f = self.frag(t);
        let Some(d) = t.due_at() else {
            // Without a due time every unfinished row is due.
            return self.why_not(t, id, now_ms).await;
        };
        let sql = Q::new(format!("UPDATE {} SET {} = ", f.table, ident(d)))
            .int(now_ms)
            .push(" WHERE ")
            .and(&self.target(&f, id, now_ms))
            .push(" AND NOT ")
            .and(&f.due(now_ms));
        self.fenced(t, "run now", id, now_ms, sql).await
    }

    async fn purge_finished(&self, t: &TableDescription, before_ms: i64) -> Result<u64> {
        let p = ident(t.processed_at().expect("checked by the core"));
        let sql = Q::new(format!(
            "DELETE FROM {} WHERE {p} IS NOT NULL AND {p} < ",
            ident(t.name())
        ))
        .int(before_ms);
        self.execute(t.name(), "purge", sql).await
    }

    async fn record_error(
        &self,
        t: &TableDescription,
        id: i64,
        error: &str,
        dead: bool,
    ) -> Result<()> {
        let f = self.frag(t);
        let col = ident(t.last_error().expect("only called for tables with one"));
        let target = match (dead, f.dead_table()) {
            (true, Some(d)) => d,
            _ => f.table.clone(),
        };
        let sql = Q::new(format!("UPDATE {target} SET {col} = "))
            .text(last_error_text(error))
            .push(&format!(" WHERE {} = ", f.id))
            .int(id);
        self.execute(t.name(), "record error", sql).await.map(drop)
    }

    async fn set_pause(&self, table: &str, pause: Option<&Pause>) -> Result<bool> {
        let sql = match pause {
            Some(p) => Q::new(format!(
                "INSERT INTO {CONTROL_TABLE} (queue, paused_at_ms, paused_by) VALUES ("
            ))
            .text(table)
            .push(", ")
            .int(p.since_ms)
            .push(", ")
            .text(p.by.clone())
            .push(") ON CONFLICT (queue) DO NOTHING"),
            None => Q::new(format!("DELETE FROM {CONTROL_TABLE} WHERE queue = ")).text(table),
        };
        self.execute(table, "pause", sql).await.map(|n| n > 0)
    }

    async fn pause_state(&self, table: &str) -> Result<Option<Pause>> {
        let row: Option<(i64, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT paused_at_ms, paused_by FROM {CONTROL_TABLE} WHERE queue = ?1"
        )))
        .bind(table)
        .fetch_optional(self.pool)
        .await
        .map_err(|e| SqlxBrokerError::statement(table, "pause state", e))?;
        Ok(row.map(|(since_ms, by)| Pause { since_ms, by }))
    }

    async fn has_control_table(&self) -> Result<bool> {
        let found: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
        )
        .bind(CONTROL_TABLE)
        .fetch_one(self.pool)
        .await
        .map_err(|e| SqlxBrokerError::statement("", "control table check", e))?;
        Ok(found > 0)
    }

    async fn request_cancel(&self, table: &str, id: i64, now_ms: i64) -> Result<()> {
        let sql = Q::new(format!(
            "INSERT INTO {CANCEL_TABLE} (queue, id, requested_at_ms) VALUES ("
        ))
        .text(table)
        .push(", ")
        .int(id)
        .push(", ")
        .int(now_ms)
        .push(") ON CONFLICT (queue, id) DO NOTHING");
        self.execute(table, "cancel request", sql).await.map(drop)
    }

    async fn cancel_requests(&self, table: &str) -> Result<Vec<i64>> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT id FROM {CANCEL_TABLE} WHERE queue = ?1"
        )))
        .bind(table)
        .fetch_all(self.pool)
        .await
        .map_err(|e| SqlxBrokerError::statement(table, "cancel requests", e))
    }

    async fn clear_cancel(&self, table: &str, id: i64) -> Result<()> {
        let sql = Q::new(format!("DELETE FROM {CANCEL_TABLE} WHERE queue = "))
            .text(table)
            .push(" AND id = ")
            .int(id);
        self.execute(table, "cancel clear", sql).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_keys_and_ids_are_written_as_json_arrays() {
        assert_eq!(
            json_texts(["a", "b\"\\", "\n"]),
            r#"["a","b\"\\","\u000a"]"#
        );
        assert_eq!(json_texts([]), "[]");
        assert_eq!(json_ids(&[1, -2]), "[1,-2]");
    }

    #[test]
    fn fragments_bind_their_values_in_text_order() {
        let t = TableDescription::builder("jobs")
            .column("k", ColumnType::Text)
            .advisory_lock("key-{k}")
            .due_at("due")
            .build()
            .unwrap();
        let f = Frag::new(&t, &KeyTable::default());
        let q = all(&[&f.unfinished(), &f.due(5), &f.held(5)]);
        assert_eq!(q.sql.matches('?').count(), q.args.len());
        assert_eq!(
            f.key(t.advisory_lock().unwrap()),
            "('' || 'key-' || ifnull(CAST(`k` AS TEXT), ''))"
        );
    }
}
