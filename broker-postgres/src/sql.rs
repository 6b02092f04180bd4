//! Quoting, time conversions, error classes, and the statement fragments every PostgreSQL
//! strategy shares. Values are always bound, never pasted: only identifiers (quoted) and the
//! broker's own fragments reach the SQL text.
//!
//! Every parameter carries an explicit cast (`$2::int8`). sqlx caches a statement by its text on
//! each connection; the startup check prepares the statements without arguments, so without the
//! casts the server would infer types from the columns (an `integer` id, say) and a later
//! execution binding an `int8` would send the wrong binary width.

use std::future::Future;
use std::sync::Arc;

use broker_core::driver::{
    self, DeadMove, DeadStatements, Fence, Position, Run, Settle, alias, bind_settle,
};
use broker_core::{DeadLetter, SqlxBrokerError, TableDescription};
use sqlx::{AssertSqlSafe, PgConnection};

use crate::fifo;

/// Quotes an identifier in double quotes, a double quote inside doubled.
pub(crate) fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A text as an escape string constant (`E'..'`), for statements that cannot bind it (sent in
/// the simple protocol, DDL, catalog reads) and for the broker's own texts (key template
/// pieces, names). An `E` string reads backslashes as escapes whatever
/// `standard_conforming_strings` says, so doubling both quotes and backslashes keeps any text
/// one literal under either setting; a plain `'..'` with doubled quotes breaks on `\'` when
/// the setting is off.
pub(crate) fn literal(text: &str) -> String {
    format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "''"))
}

/// A host time bound as unix milliseconds (`int8`) as a `TIMESTAMPTZ`. An interval of whole
/// milliseconds is exact in microseconds, so a lease token written and later compared this way
/// matches to the bit.
pub(crate) fn ts(param: &str) -> String {
    format!("(TIMESTAMPTZ 'epoch' + {param}::int8 * INTERVAL '1 millisecond')")
}

/// The claim's sort key for a due-time column `col` (qualified or not): the due time, a NULL
/// (due at once) first of all. The claim index has this very expression, so the planner matches
/// the claim's condition and order to it.
pub(crate) fn due_key(col: &str) -> String {
    format!("COALESCE({col}, TIMESTAMPTZ '-infinity')")
}

/// A `TIMESTAMPTZ` expression read back as unix milliseconds.
pub(crate) fn ms(expr: &str) -> String {
    format!("(EXTRACT(EPOCH FROM {expr}) * 1000)::int8")
}

/// How the broker treats a driver error: the core's classes, which its retry policy reads.
pub use broker_core::driver::ErrorClass;

/// Classifies a driver error. The one place this crate maps PostgreSQL error codes: claims and
/// single-statement settlements run again (a few times, with a short pause) on a transient
/// error, so a deadlock or serialization failure never surfaces as lost work.
pub fn classify(err: &sqlx::Error) -> ErrorClass {
    match err {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("40001" | "40P01" | "55P03") => ErrorClass::Transient,
            Some(code) if code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03") => {
                ErrorClass::Connection
            }
            _ => ErrorClass::Permanent,
        },
        // A terminated session can also surface as an unexpected message or a closed stream.
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::PoolTimedOut => {
            ErrorClass::Connection
        }
        _ => ErrorClass::Permanent,
    }
}

/// Whether `error` is transient on PostgreSQL: a serialization failure, a deadlock, a `NOWAIT`
/// lock that was not available, or a lost connection (see [`classify`]). Claims are retried by
/// the subscription engine on their own.
pub fn is_transient(error: &SqlxBrokerError) -> bool {
    broker_core::driver::retry::is_transient(classify, error)
}

/// A statement that failed, by name, before the table is known to the error.
#[derive(Debug)]
pub(crate) struct Failed {
    pub(crate) name: &'static str,
    pub(crate) source: sqlx::Error,
}

impl Failed {
    pub(crate) fn new(name: &'static str) -> impl FnOnce(sqlx::Error) -> Failed {
        move |source| Failed { name, source }
    }

    pub(crate) fn is_transient(&self) -> bool {
        classify(&self.source) == ErrorClass::Transient
    }

    pub(crate) fn on(self, table: &str) -> SqlxBrokerError {
        SqlxBrokerError::statement(table, self.name, self.source)
    }
}

/// Runs a fenced settlement (or renewal) `f` under the core's policy for fenced statements
/// ([`retry::fenced`](broker_core::driver::retry::fenced)): again on a fresh connection after a
/// connection error while the host's clock is before `deadline_ms` (the lease's expiry less a
/// margin: past it another claim may hold the row). A try whose connection failed may have
/// landed: the fence makes the next try change nothing then, and report the claim lost.
pub(crate) async fn settle_retrying<T, F, Fut>(deadline_ms: i64, f: F) -> Result<T, Failed>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failed>>,
{
    broker_core::driver::retry::fenced(|e: &Failed| classify(&e.source), deadline_ms, f).await
}

/// Runs `f` under the core's policy for errors the server undid
/// ([`retry::transient`](broker_core::driver::retry::transient)). Only for work that a failed
/// try leaves unchanged (one statement in autocommit, or a transaction that rolled back).
pub(crate) async fn retrying<T, F, Fut>(f: F) -> Result<T, Failed>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failed>>,
{
    broker_core::driver::retry::transient(|e: &Failed| classify(&e.source), f).await
}

/// Runs a statement text (a broker-built statement, never user input) as a query: prepared under
/// a name and cached per connection (`prepared`), or sent as an unnamed statement, which a
/// transaction-mode pooler passes through (see `PgBackend::behind_transaction_pooler`).
pub(crate) fn query(
    sql: &Arc<str>,
    prepared: bool,
) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql.clone())).persistent(prepared)
}

pub(crate) use broker_core::driver::{ConnFuture, on_pool};

/// [`on_pool`] on a connection kept from the last statement where there is one
/// ([`WarmConnections`](broker_core::driver::WarmConnections)); the connection is kept again
/// when `f` succeeds, and every kept one goes back to the pool when it fails (the server may
/// have dropped them all).
pub(crate) async fn on_warm<T>(
    warm: &broker_core::driver::WarmConnections<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    pool: &sqlx::PgPool,
    prepared: bool,
    f: impl for<'c> FnOnce(&'c mut PgConnection) -> ConnFuture<'c, T>,
) -> Result<T, sqlx::Error> {
    use sqlx::Connection;
    let mut conn = warm.acquire(pool).await?;
    let out = if prepared {
        f(&mut conn).await
    } else {
        async {
            let mut tx = conn.begin().await?;
            let out = f(&mut tx).await?;
            tx.commit().await?;
            Ok(out)
        }
        .await
    };
    warm.keep_if(conn, out.is_ok());
    out
}

/// The statements of one table, built once at subscribe time. Every statement names the queue
/// table `q`, so the fragments below fit each of them.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    pub(crate) table: String,
    pub(crate) id: String,
    pub(crate) attempt: String,
    /// `WHERE` conditions of a claimable row `q`; `$1` is the host's now (unix ms).
    pub(crate) claimable: String,
    /// The same without the FIFO head condition: the row is due and free, whatever its group.
    pub(crate) claimable_row: String,
    /// `ORDER BY` of a claim, on `q`.
    pub(crate) order: String,
    /// The same order on the unqualified columns, for ordering a CTE's output.
    pub(crate) order_out: String,
    payload: Option<String>,
    /// The due-time column, quoted.
    due: Option<String>,
    /// The snooze counter column, quoted.
    snoozes: Option<String>,
    /// The kind column, quoted.
    kind: Option<String>,
    /// The job timeout column, quoted.
    job_timeout: Option<String>,
    /// Whether claims resume from a position (see [`Position::resumes`]).
    resumes: bool,
    /// The table's columns, quoted, in table order; empty when unknown (the table check then
    /// fails before any statement runs).
    columns: Vec<String>,
}

impl Statements {
    /// The statements of `t`, whose columns (as the server lists them, in order) are `columns`.
    pub(crate) fn new(t: &TableDescription, columns: &[String]) -> Self {
        let table = ident(t.name());
        let id = ident(t.id());
        let attempt = ident(t.attempt());
        let mut claimable: Vec<String> = t
            .unfinished_columns()
            .into_iter()
            .map(|c| format!("q.{} IS NULL", ident(c)))
            .collect();
        // The due time leads the claim order (after the priority), and the claim index has it as
        // an expression: the claim then reads due rows first and stops at the first row not due
        // yet, however many scheduled rows come earlier in id order. A NULL due time is due at
        // once, first of all.
        let due = t.due_at().map(|c| due_key(&format!("q.{}", ident(c))));
        if let Some(due) = &due {
            claimable.push(format!("{due} <= {}", ts("$1")));
        }
        if let Some(c) = t.locked_until() {
            let c = ident(c);
            claimable.push(format!("(q.{c} IS NULL OR q.{c} <= {})", ts("$1")));
        }
        // A subscription of some kinds claims only rows of its kinds.
        claimable.extend(
            t.kind()
                .and_then(|k| t.kind_condition(&format!("q.{}", ident(k)))),
        );
        if t.due_at().is_none() && t.locked_until().is_none() {
            // No time condition reads the host's now, but every claim binds it as $1: keep the
            // parameter in the statement, typed, so the bind count and types still match.
            claimable.push("$1::int8 IS NOT NULL".into());
        }
        let claimable_row = claimable.join(" AND ");
        if let Some(head) = fifo::head_condition(t) {
            claimable.push(head);
        }
        let mut order = Vec::new();
        let mut order_out = Vec::new();
        if let Some(p) = t.priority() {
            let p = ident(p);
            order.push(format!("q.{p} DESC"));
            order_out.push(format!("{p} DESC"));
        }
        if let (Some(due), Some(c)) = (&due, t.due_at()) {
            order.push(due.clone());
            order_out.push(due_key(&ident(c)));
        }
        order.push(format!("q.{id}"));
        order_out.push(id.clone());
        let (order, order_out) = (order.join(", "), order_out.join(", "));
        Self {
            table,
            id,
            attempt,
            claimable: claimable.join(" AND "),
            claimable_row,
            order,
            order_out,
            payload: t.payload().map(|(p, _)| ident(p)),
            due: t.due_at().map(ident),
            snoozes: t.snoozes().map(ident),
            kind: t.kind().map(ident),
            job_timeout: t.job_timeout().map(ident),
            resumes: Position::resumes(t),
            columns: columns.iter().map(|c| ident(c)).collect(),
        }
    }

    /// The condition that keeps a claim's rows at or after a [`Position`] in the claim order,
    /// bound from parameter `first` on (the due time as unix ms, NULL for none, then the id;
    /// the id alone on a table without a due time). It has
    /// the claim index's own expressions as a row comparison, so the index scan starts at the
    /// position instead of walking the entries before it (acked rows vacuum has not removed
    /// yet). `None` for tables whose claims always read from the start.
    pub(crate) fn resume_condition(&self, first: usize) -> Option<String> {
        if !self.resumes {
            return None;
        }
        Some(match &self.due {
            Some(due) => format!(
                " AND ({}, q.{}) >= (COALESCE({}, TIMESTAMPTZ '-infinity'), ${}::int8)",
                due_key(&format!("q.{due}")),
                self.id,
                ts(&format!("${first}")),
                first + 1
            ),
            None => format!(" AND q.{} >= ${first}::int8", self.id),
        })
    }

    /// A statement that resumes from a position: `sql` with the condition of
    /// [`resume_condition`](Self::resume_condition) in it.
    pub(crate) fn resume(&self, sql: String) -> Resume {
        Resume {
            sql: sql.into(),
            due: self.due.is_some(),
        }
    }

    /// A row's due time as [`alias::DUE`] reads it: unix ms rounded down (so a position is
    /// never past its row), NULL for none or an infinite one.
    fn due_ms(&self) -> Option<String> {
        self.due.as_ref().map(|d| {
            format!(
                "CASE WHEN isfinite(q.{d}) THEN floor(EXTRACT(EPOCH FROM q.{d}) * 1000)::int8 END"
            )
        })
    }

    /// The due time of a candidate or claimed row ([`alias::DUE`]) as a select list item, with
    /// its leading comma; empty for a table without a due time.
    pub(crate) fn due_column(&self) -> String {
        self.due_ms()
            .map(|d| format!(", {d} AS {}", alias::DUE))
            .unwrap_or_default()
    }

    /// The row's columns on `alias`, listed by name rather than `alias.*`: a prepared statement
    /// whose result columns change fails with "cached plan must not change result type" on every
    /// connection that cached it, so a migration that adds a column would stop every claim until
    /// the connections were replaced. A list read at subscribe time survives an added column.
    fn row(&self, alias: &str) -> String {
        if self.columns.is_empty() {
            return format!("{alias}.*");
        }
        self.columns
            .iter()
            .map(|c| format!("{alias}.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// What a claim hands out: the whole row plus the broker's aliases. `counted`: the statement
    /// has just added one to the attempt, so the attempt before the claim is one less.
    pub(crate) fn claimed_columns(&self, counted: bool) -> String {
        let attempt = if counted {
            format!("(q.{} - 1)::int8", self.attempt)
        } else {
            format!("q.{}::int8", self.attempt)
        };
        let mut out = format!(
            "{}, q.{}::int8 AS {}, {attempt} AS {}",
            self.row("q"),
            self.id,
            alias::ID,
            alias::ATTEMPT
        );
        if let Some(p) = &self.payload {
            out.push_str(&format!(", q.{p} AS {}", alias::PAYLOAD));
        }
        out.push_str(&self.due_column());
        if let Some(n) = &self.snoozes {
            out.push_str(&format!(", q.{n}::int8 AS {}", alias::SNOOZES));
        }
        if let Some(k) = &self.kind {
            out.push_str(&format!(", q.{k}::text AS {}", alias::KIND));
        }
        if let Some(c) = &self.job_timeout {
            out.push_str(&format!(", q.{c}::int8 AS {}", alias::TIMEOUT_MS));
        }
        out
    }

    /// The lease ack of many rows in one statement, each fenced on its token: `$1` ids, `$2`
    /// expiries, `$3` attempts (arrays of `int8`, one entry per row), `$4` the time an ack
    /// writes. Returns the ids it acked.
    pub(crate) fn lease_ack_many(&self, t: &TableDescription, locked_until: &str) -> String {
        let (table, id, a) = (&self.table, &self.id, &self.attempt);
        let lu = ident(locked_until);
        let rows = "UNNEST($1::int8[], $2::int8[], $3::int8[]) AS b(id, expiry, attempt)";
        // `q.id = ANY($1)` lets every plan find the rows by the primary key. Without it, a
        // generic plan made while the table was empty (a new queue, or one vacuum left small)
        // hash-joins the ids with a scan of the whole table, and PostgreSQL keeps that plan
        // until the table is analyzed again, however large it grows meanwhile.
        let fenced = format!(
            "q.{id} = ANY($1::int8[]) AND q.{id} = b.id AND q.{lu} = {} AND q.{a} = b.attempt",
            ts("b.expiry")
        );
        match t.processed_at() {
            Some(c) => format!(
                "UPDATE {table} AS q SET {} = {}, {lu} = NULL FROM {rows} WHERE {fenced} RETURNING q.{id}::int8",
                ident(c),
                ts("$4")
            ),
            None => format!(
                "DELETE FROM {table} AS q USING {rows} WHERE {fenced} AND $4::int8 IS NOT NULL RETURNING q.{id}::int8"
            ),
        }
    }

    /// The statements of a settlement. `count_attempt`: the settlement counts the attempt (row
    /// lock). `fence` holds extra conditions that must still hold, on parameters from `$3` (see
    /// [`Fence`]). Parameters: `$1` id, `$2` the time the statement writes (now, or the due time).
    pub(crate) fn settle(
        &self,
        t: &TableDescription,
        count_attempt: bool,
        fence: &str,
    ) -> SettleStatements {
        let (table, id, a) = (&self.table, &self.id, &self.attempt);
        let clear_lease = t.locked_until().map(|c| format!("{} = NULL", ident(c)));
        // The assignments of an UPDATE; `count`: this one counts the attempt.
        let sets = |count: bool, write: Option<String>| {
            let count = count.then(|| format!("{a} = q.{a} + 1"));
            let sets: Vec<String> = [count, write, clear_lease.clone()]
                .into_iter()
                .flatten()
                .collect();
            if sets.is_empty() {
                // Nothing to write: a no-op assignment (not of the id, which may be an identity
                // column that refuses any value).
                format!("{a} = q.{a}")
            } else {
                sets.join(", ")
            }
        };
        let time = ts("$2");
        // `$2` is always bound; a statement that writes no time still names it (and checks it,
        // so a misrouted call changes nothing), as PostgreSQL must know every parameter's type.
        let ack = match t.processed_at() {
            Some(c) => format!(
                "UPDATE {table} AS q SET {} WHERE q.{id} = $1::int8{fence}",
                sets(false, Some(format!("{} = {time}", ident(c))))
            ),
            None => {
                format!(
                    "DELETE FROM {table} AS q WHERE q.{id} = $1::int8 AND $2::int8 IS NOT NULL{fence}"
                )
            }
        };
        let retry = match t.due_at() {
            Some(c) => format!(
                "UPDATE {table} AS q SET {} WHERE q.{id} = $1::int8{fence}",
                sets(count_attempt, Some(format!("{} = {time}", ident(c))))
            ),
            None => format!(
                "UPDATE {table} AS q SET {} WHERE q.{id} = $1::int8 AND $2::int8 IS NULL{fence}",
                sets(count_attempt, None)
            ),
        };
        let dead = match t.dead_letter() {
            Some(DeadLetter::Column(c)) => DeadStatements::Mark(format!(
                "UPDATE {table} AS q SET {} WHERE q.{id} = $1::int8{fence}",
                sets(count_attempt, Some(format!("{} = {time}", ident(c))))
            )),
            Some(DeadLetter::Table(d)) => DeadStatements::Move(DeadMove {
                lock: None,
                // Row lock counts the attempt first: one statement cannot both update the row and
                // move it.
                count: count_attempt.then(|| {
                    format!(
                        "UPDATE {table} AS q SET {a} = q.{a} + 1 WHERE q.{id} = $1::int8 AND $2::int8 IS NOT NULL"
                    )
                }),
                // One statement moves the row, so the copy and the delete land together. The
                // dead-letter table has the same columns (the DDL helper makes it so); they are
                // named, so a column added to the queue table later does not break the move.
                copy: None,
                delete: if self.columns.is_empty() {
                    format!(
                        "WITH sqlx_broker_moved AS (DELETE FROM {table} AS q WHERE q.{id} = $1::int8 AND $2::int8 IS NOT NULL{fence} RETURNING q.*) \
                         INSERT INTO {} SELECT * FROM sqlx_broker_moved",
                        ident(d)
                    )
                } else {
                    format!(
                        "WITH sqlx_broker_moved AS (DELETE FROM {table} AS q WHERE q.{id} = $1::int8 AND $2::int8 IS NOT NULL{fence} RETURNING {}) \
                         INSERT INTO {} ({}) SELECT {} FROM sqlx_broker_moved AS m",
                        self.row("q"),
                        ident(d),
                        self.columns.join(", "),
                        self.row("m"),
                    )
                },
            }),
            None => DeadStatements::None,
        };
        // A snooze leaves the attempt as it stood before the claim: where the claim counted it
        // (lease, advisory) it takes that count back; row lock counts at settlement, so it
        // counts nothing. The fence reads the row before the update, so it still sees the
        // attempt the claim wrote.
        let snooze = t.due_at().map(|c| {
            let mut sets = vec![format!("{} = {time}", ident(c))];
            if !count_attempt {
                sets.push(format!("{a} = q.{a} - 1"));
            }
            if let Some(n) = &self.snoozes {
                sets.push(format!("{n} = COALESCE(q.{n}, 0) + 1"));
            }
            sets.extend(clear_lease.clone());
            format!(
                "UPDATE {table} AS q SET {} WHERE q.{id} = $1::int8{fence}",
                sets.join(", ")
            )
        });
        // An operator's cancel deletes the row even where acks keep it.
        let cancel = format!(
            "DELETE FROM {table} AS q WHERE q.{id} = $1::int8 AND $2::int8 IS NOT NULL{fence}"
        );
        driver::SettleStatements {
            ack,
            retry: Some(retry),
            dead,
            snooze,
            cancel,
        }
        .map(Arc::from)
    }
}

/// A claim statement that reads the claim order from a [`Position`] on (see
/// [`Statements::resume_condition`]).
#[derive(Debug, Clone)]
pub(crate) struct Resume {
    pub(crate) sql: Arc<str>,
    /// Whether the position binds a due time before the id.
    due: bool,
}

impl Resume {
    /// The statement with its parameters before the position bound by `bind`, then the
    /// position.
    pub(crate) fn query(
        &self,
        prepared: bool,
        from: Position,
        bind: impl FnOnce(
            sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
        )
            -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let q = bind(query(&self.sql, prepared));
        match self.due {
            true => q.bind(from.due_ms).bind(from.id),
            false => q.bind(from.id),
        }
    }
}

/// Settlement statements of one mode (`$2` of the retry is the due time, NULL: due at once).
pub(crate) type SettleStatements = broker_core::driver::SettleStatements<Arc<str>>;

/// The settlement statements with their names, for the startup check.
pub(crate) fn settle_named(statements: &SettleStatements) -> Vec<(&'static str, &str)> {
    statements
        .named()
        .into_iter()
        .map(|(name, sql)| (name, &**sql))
        .collect()
}

/// Runs a settlement on `conn`; the statements must match the `fence` (built to match it), and
/// are prepared under a name or not as `prepared` says (see [`query`]). Returns the rows
/// changed (0: the fence no longer holds, and nothing changed). The statements of a move run
/// one after the other, so call this inside a transaction when there are two (row lock), or
/// rely on the single statement (lease, advisory).
pub(crate) async fn run_settle(
    statements: &SettleStatements,
    conn: &mut PgConnection,
    prepared: bool,
    settle: Settle,
    fence: Fence,
) -> Result<u64, Failed> {
    // Parameters: $1 id, $2 the time the statement writes, then the fence's from $3.
    let run = async |name: &'static str, sql: &Arc<str>, conn: &mut PgConnection| {
        bind_settle(query(sql, prepared), &settle, fence)
            .execute(conn)
            .await
            .map(|done| done.rows_affected())
            .map_err(Failed::new(name))
    };
    match statements.for_action(settle.action) {
        Run::One(name, sql) => run(name, sql, conn).await,
        Run::Nothing => unreachable!("PostgreSQL always builds a retry statement"),
        Run::Move(moved) => {
            let mut changed = 0;
            for (step, sql) in moved.steps() {
                changed = run(step.name(), sql, conn).await?;
            }
            Ok(changed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_with_inner_quotes_doubled() {
        assert_eq!(ident("my \"odd\" table"), "\"my \"\"odd\"\" table\"");
        assert_eq!(ident("order"), "\"order\"");
    }

    #[test]
    fn the_ack_with_processed_at_never_counts_an_attempt() {
        let t = TableDescription::builder("jobs")
            .processed_at("done_at")
            .build()
            .unwrap();
        let s = Statements::new(&t, &[]).settle(&t, true, "");
        assert!(!s.ack.contains("+ 1"), "{}", s.ack);
        let retry = s.retry.as_deref().unwrap();
        assert!(retry.contains("\"attempt\" = q.\"attempt\" + 1"), "{retry}");
    }
}
