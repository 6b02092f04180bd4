//! Quoting, bound parameters, time conversion and the statement fragments every MySQL strategy
//! shares. Values are always bound, never pasted: only identifiers (quoted) and the broker's own
//! fragments reach the SQL text.

use std::sync::Arc;

use broker_core::driver::{
    DeadMove, DeadStatements, Fence, LeaseToken, MoveStep, Run, Settle, alias,
};
use broker_core::{DeadLetter, Result, SqlxBrokerError, TableDescription};
use sqlx::mysql::{MySqlArguments, MySqlDatabaseError, MySqlRow};
use sqlx::query::Query;
use sqlx::{Connection, Executor, MySql, MySqlConnection};

use crate::fifo;

/// Quotes an identifier in backticks, a backtick inside doubled.
pub(crate) fn ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// The alias of the group column in claimed rows of FIFO tables (the guard reads it).
pub(crate) const GROUP_ALIAS: &str = "sqlx_broker_group";

/// The savepoint a row lock delivery sets when its handler first asks for the transaction: a
/// retry or dead letter rolls back to it, undoing the handler's writes while keeping the claimed
/// row locked. Deliveries whose handlers write nothing through it never set it.
pub(crate) const WRITES_SAVEPOINT: &str = "SAVEPOINT sqlx_broker_writes";
/// Undoes what the handler wrote through the delivery's transaction (see [`WRITES_SAVEPOINT`]).
/// InnoDB keeps the row locks taken before the savepoint.
pub(crate) const ROLLBACK_TO_WRITES: &str = "ROLLBACK TO SAVEPOINT sqlx_broker_writes";
/// Ends the savepoint before the settlement changes the queue row.
pub(crate) const RELEASE_WRITES: &str = "RELEASE SAVEPOINT sqlx_broker_writes";

/// The epoch as DATETIME(6). Times cross the wire as integers from the epoch and are turned
/// into DATETIME arithmetic (`TIMESTAMPADD`/`TIMESTAMPDIFF`), not `FROM_UNIXTIME` /
/// `UNIX_TIMESTAMP`: the arithmetic ignores the session time zone for DATETIME columns, and
/// MariaDB before 11.5 returns NULL from `FROM_UNIXTIME` past 2038, which would make a job
/// scheduled for 2040 due at once.
pub(crate) const EPOCH6: &str = "CAST('1970-01-01 00:00:00' AS DATETIME(6))";
/// The epoch as DATETIME without fractions, for lease expiries (whole seconds).
pub(crate) const EPOCH0: &str = "CAST('1970-01-01 00:00:00' AS DATETIME)";

/// 9999-12-31 23:59:59.999 UTC, the last DATETIME, in unix milliseconds.
const MAX_MS: i64 = 253_402_300_799_999;

/// Unix milliseconds as the microseconds a statement adds to the epoch, clamped to DATETIME's
/// range (a later time would overflow to NULL, which reads as "due now").
pub(crate) fn micros(ms: i64) -> i64 {
    ms.clamp(0, MAX_MS) * 1000
}

/// A lease expiry (unix milliseconds at a whole second) as whole seconds, rounding up should a
/// fraction ever arrive, so the written value and every token compare equal on a column without
/// fractions.
pub(crate) fn whole_seconds(ms: i64) -> i64 {
    let ms = ms.clamp(0, MAX_MS);
    ms.div_euclid(1000) + i64::from(ms.rem_euclid(1000) != 0)
}

/// A time column read back as unix milliseconds (NULL stays NULL).
pub(crate) fn read_ms(column: &str) -> String {
    format!("(TIMESTAMPDIFF(MICROSECOND, {EPOCH6}, {column}) DIV 1000)")
}

/// What a `?` in a statement stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum P {
    /// The host's now (unix milliseconds).
    Now,
    /// A row id.
    Id,
    /// A row count (`LIMIT`).
    Limit,
    /// Rows to pass over first (`OFFSET`).
    Skip,
    /// The new lease expiry (whole seconds).
    Expires,
    /// The time a settlement writes: `processed_at`, the dead-letter mark or the due time (unix
    /// milliseconds, or NULL).
    Written,
    /// The held lease token's expiry (whole seconds).
    TokenExpires,
    /// The held lease token's attempt.
    TokenAttempt,
    /// A group value.
    Group,
    /// The attempt column's value the settling delivery holds.
    HeldAttempt,
    /// The n-th id of a claim window's run (the last one again past its end).
    Candidate(usize),
    /// Where a FIFO claim window's walk of the groups starts, written in (never bound) for
    /// `group > ? OR group >= ?`: the group the walk starts after (NULL to start at the first
    /// group) ...
    After,
    /// ... and the least group, `''`, when the walk starts at the first group (NULL otherwise).
    First,
    /// The n-th key column of the key an advisory key walk starts after.
    KeyAfter(usize),
}

/// The values a statement's parameters take.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Args<'a> {
    pub(crate) now_ms: i64,
    pub(crate) id: i64,
    pub(crate) limit: i64,
    pub(crate) skip: i64,
    pub(crate) expires_ms: i64,
    pub(crate) written_ms: Option<i64>,
    pub(crate) token: Option<LeaseToken>,
    pub(crate) group: Option<&'a str>,
    pub(crate) held_attempt: i64,
    /// The ids a claim window's take locks from (see [`crate::window`]).
    pub(crate) candidates: &'a [i64],
    /// The key columns of the key an advisory key walk starts after.
    pub(crate) key_after: &'a [String],
}

/// SQL text with its parameters in order, built up from fragments.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sql {
    text: String,
    params: Vec<P>,
    /// Where each parameter's `?` sits in `text` (byte offsets), for [`Stmt::inline`].
    at: Vec<usize>,
}

impl Sql {
    pub(crate) fn new(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            params: Vec::new(),
            at: Vec::new(),
        }
    }

    /// Appends text.
    pub(crate) fn push(mut self, text: &str) -> Self {
        self.text.push_str(text);
        self
    }

    /// Appends a plain `?`.
    pub(crate) fn param(mut self, p: P) -> Self {
        self.at.push(self.text.len());
        self.text.push('?');
        self.params.push(p);
        self
    }

    /// Appends a time given in unix milliseconds, as DATETIME(6).
    pub(crate) fn time_ms(mut self, p: P) -> Self {
        self.text.push_str("TIMESTAMPADD(MICROSECOND, ");
        self = self.param(p);
        self.text.push_str(&format!(", {EPOCH6})"));
        self
    }

    /// Appends a time given in whole seconds, as DATETIME.
    pub(crate) fn time_s(mut self, p: P) -> Self {
        self.text.push_str("TIMESTAMPADD(SECOND, ");
        self = self.param(p);
        self.text.push_str(&format!(", {EPOCH0})"));
        self
    }

    /// Appends another fragment with its parameters.
    pub(crate) fn append(mut self, other: &Sql) -> Self {
        let base = self.text.len();
        self.at.extend(other.at.iter().map(|a| a + base));
        self.text.push_str(&other.text);
        self.params.extend_from_slice(&other.params);
        self
    }

    /// Joins fragments with `sep`.
    pub(crate) fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    pub(crate) fn join(parts: &[Sql], sep: &str) -> Sql {
        let mut out = Sql::default();
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                out = out.push(sep);
            }
            out = out.append(part);
        }
        out
    }

    pub(crate) fn stmt(self, name: &'static str) -> Stmt {
        Stmt {
            name,
            sql: self.text.into(),
            params: self.params.into(),
            at: self.at.into(),
        }
    }
}

/// A finished statement: its name (for errors), its text and what each `?` binds.
#[derive(Debug, Clone)]
pub(crate) struct Stmt {
    pub(crate) name: &'static str,
    sql: Arc<str>,
    params: Arc<[P]>,
    at: Arc<[usize]>,
}

impl Stmt {
    #[cfg(test)]
    pub(crate) fn sql(&self) -> &str {
        &self.sql
    }

    /// The statement's name and text, as every backend's `statements()` lists them.
    pub(crate) fn named(&self) -> (&'static str, &str) {
        (self.name, &self.sql)
    }

    /// The statement's text with its parameters written in as integer literals, for a
    /// statement that must go over the text protocol in one round trip with others (the
    /// claim window's read, see [`crate::window`]). Only integers the broker computes itself
    /// (times, counts) and the start of a FIFO walk (hex) may be written in; any other
    /// parameter is a bug.
    pub(crate) fn inline(&self, a: &Args<'_>) -> String {
        let mut out = String::with_capacity(self.sql.len() + 16 * self.at.len());
        let mut from = 0;
        for (p, &at) in self.params.iter().zip(self.at.iter()) {
            out.push_str(&self.sql[from..at]);
            let value = match p {
                P::Now => micros(a.now_ms).to_string(),
                P::Limit => a.limit.to_string(),
                P::Skip => a.skip.to_string(),
                P::After => match a.group {
                    // Hex, so that no character of the group (a quote, a backslash under any
                    // sql_mode) can end the literal.
                    Some(g) => format!(
                        "CONVERT(X'{}' USING utf8mb4)",
                        g.bytes().map(|b| format!("{b:02x}")).collect::<String>()
                    ),
                    None => "NULL".to_owned(),
                },
                P::First => match a.group {
                    Some(_) => "NULL".to_owned(),
                    None => "''".to_owned(),
                },
                other => unreachable!("{other:?} is never written into a statement's text"),
            };
            out.push_str(&value);
            from = at + 1;
        }
        out.push_str(&self.sql[from..]);
        out
    }

    /// The statement with `args` bound in parameter order.
    pub(crate) fn bind<'q>(&self, a: &Args<'q>) -> Query<'q, MySql, MySqlArguments> {
        let mut q = sqlx::query(sqlx::AssertSqlSafe(self.sql.clone()));
        for p in self.params.iter() {
            q = match p {
                P::Now => q.bind(micros(a.now_ms)),
                P::Id => q.bind(a.id),
                P::Limit => q.bind(a.limit),
                P::Skip => q.bind(a.skip),
                P::Expires => q.bind(whole_seconds(a.expires_ms)),
                P::Written => q.bind(a.written_ms.map(micros)),
                P::TokenExpires => q.bind(a.token.map(|t| whole_seconds(t.expires_ms))),
                P::TokenAttempt => q.bind(a.token.map(|t| t.attempt)),
                P::Group => q.bind(a.group),
                P::HeldAttempt => q.bind(a.held_attempt),
                P::After | P::First => unreachable!("the walk's start is only written in"),
                P::KeyAfter(i) => q.bind(a.key_after.get(*i).map(String::as_str)),
                P::Candidate(i) => q.bind(
                    a.candidates
                        .get(*i)
                        .or(a.candidates.last())
                        .copied()
                        .unwrap_or(0),
                ),
            };
        }
        q
    }
}

/// The fragments of one table that every mode's statements are built from.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// The quoted table name.
    pub(crate) table: String,
    /// The id column, qualified with the table.
    pub(crate) id: String,
    /// The attempt column, qualified with the table.
    pub(crate) attempt: String,
    /// The conditions of a claimable row.
    pub(crate) claimable: Sql,
    /// The same without the FIFO head condition: the row is due and free, whatever its group.
    pub(crate) claimable_row: Sql,
    /// `ORDER BY` of a claim: higher priority first, then the due time, then publish order. The claim index the
    /// DDL helper creates has these columns in this order, so the claim reads rows in order
    /// instead of sorting them (a filesort would lock every row it scans).
    pub(crate) order: String,
    /// The broker's aliases after `t.*`, attempt as stored.
    aliases_tail: String,
}

impl Statements {
    pub(crate) fn new(t: &TableDescription) -> Self {
        let table = ident(t.name());
        let col = |c: &str| format!("{table}.{}", ident(c));
        let id = col(t.id());
        let attempt = col(t.attempt());
        let mut claimable = Vec::new();
        for c in t.unfinished_columns() {
            claimable.push(Sql::new(format!("{} IS NULL", col(c))));
        }
        for c in [t.due_at(), t.locked_until()].into_iter().flatten() {
            let c = col(c);
            claimable.push(
                Sql::new(format!("({c} IS NULL OR {c} <= "))
                    .time_ms(P::Now)
                    .push(")"),
            );
        }
        // A subscription of some kinds claims only rows of its kinds.
        // Compared as bytes: on a case-insensitive column "Resize" is another kind than
        // "resize", as the workers' registry, the stats and the doctor see it.
        claimable.extend(
            t.kind()
                .and_then(|k| t.kind_condition(&format!("CAST({} AS BINARY)", col(k))))
                .map(Sql::new),
        );
        if claimable.is_empty() {
            claimable.push(Sql::new("1 = 1"));
        }
        let claimable_row = Sql::join(&claimable, " AND ");
        if let Some(head) = fifo::head_condition(t) {
            claimable.push(Sql::new(head));
        }
        // The due time leads the order after the priority: the claim index has it in that place,
        // so the claim's range scan reads NULL (due at once) and past due times first and ends
        // at the first row not due yet, however many scheduled rows have lower ids.
        let mut order = Vec::new();
        if let Some(p) = t.priority() {
            order.push(format!("{} DESC", col(p)));
        }
        if let Some(c) = t.due_at() {
            order.push(col(c));
        }
        order.push(id.clone());
        let order = order.join(", ");
        let mut aliases_tail = String::new();
        if let Some((p, _)) = t.payload() {
            aliases_tail.push_str(&format!(", {} AS {}", col(p), alias::PAYLOAD));
        }
        if let (true, Some(g)) = (t.fifo(), t.group()) {
            aliases_tail.push_str(&format!(", CAST({} AS CHAR) AS {GROUP_ALIAS}", col(g)));
        }
        // The due time, for the time from a row's due time to its handler's start.
        if let Some(c) = t.due_at() {
            aliases_tail.push_str(&format!(", {} AS {}", read_ms(&col(c)), alias::DUE));
        }
        if let Some(n) = t.snoozes() {
            aliases_tail.push_str(&format!(
                ", CAST({} AS SIGNED) AS {}",
                col(n),
                alias::SNOOZES
            ));
        }
        if let Some(k) = t.kind() {
            aliases_tail.push_str(&format!(", CAST({} AS CHAR) AS {}", col(k), alias::KIND));
        }
        if let Some(c) = t.job_timeout() {
            aliases_tail.push_str(&format!(
                ", CAST({} AS SIGNED) AS {}",
                col(c),
                alias::TIMEOUT_MS
            ));
        }
        Self {
            table,
            id,
            attempt,
            claimable: Sql::join(&claimable, " AND "),
            claimable_row,
            order,
            aliases_tail,
        }
    }

    /// What a claim hands out (its select list): the whole row plus the broker's aliases.
    /// `counted`: the attempt column already counts this delivery, so the alias reads one less
    /// (the attempt before the claim).
    pub(crate) fn claimed_columns(&self, counted: bool) -> String {
        format!(
            "{t}.*, CAST({id} AS SIGNED) AS {aid}, CAST({a} AS SIGNED){minus} AS {aa}{tail}",
            t = self.table,
            id = self.id,
            aid = alias::ID,
            a = self.attempt,
            minus = if counted { " - 1" } else { "" },
            aa = alias::ATTEMPT,
            tail = self.aliases_tail,
        )
    }

    /// The statements of a settlement. `fence`: extra conditions that must still hold (lease:
    /// the token), starting with ` AND`. `count`: the settlement counts the attempt (row lock
    /// mode counts it when it puts the row back, so a crash, which rolls back, uses none).
    /// `open`: a condition the dead-letter move's copy and delete begin their `WHERE` with
    /// ([`IN_TRANSACTION`] for lease mode on MariaDB, else empty).
    pub(crate) fn settle(
        &self,
        t: &TableDescription,
        fence: &Sql,
        count: bool,
        open: &str,
    ) -> SettleStatements {
        let table = &self.table;
        let by_id = Sql::new(format!(" WHERE {} = ", self.id))
            .param(P::Id)
            .append(fence);
        let col = |c: &str| format!("{table}.{}", ident(c));
        // Every statement that leaves the row in place clears the lease, so the row never keeps
        // an expiry after its delivery ends.
        let clear_lease = t
            .locked_until()
            .map(|c| Sql::new(format!("{} = NULL", col(c))));
        let counted = Sql::new(format!("{a} = {a} + 1", a = self.attempt));
        let update = |mut sets: Vec<Sql>, name: &'static str| -> Option<Stmt> {
            if sets.is_empty() {
                if fence.is_empty() {
                    return None;
                }
                // Nothing to change, but the fence must still be checked.
                sets.push(Sql::new(format!("{id} = {id}", id = self.id)));
            }
            Some(
                Sql::new(format!("UPDATE {table} SET "))
                    .append(&Sql::join(&sets, ", "))
                    .append(&by_id)
                    .stmt(name),
            )
        };
        let ack = match t.processed_at() {
            Some(c) => {
                let mut sets = vec![Sql::new(format!("{} = ", col(c))).time_ms(P::Written)];
                sets.extend(clear_lease.clone());
                update(sets, "ack").expect("an ack sets processed_at")
            }
            None => Sql::new(format!("DELETE FROM {table}"))
                .append(&by_id)
                .stmt("ack"),
        };
        let mut retry_sets = Vec::new();
        if count {
            retry_sets.push(counted.clone());
        }
        if let Some(c) = t.due_at() {
            retry_sets.push(Sql::new(format!("{} = ", col(c))).time_ms(P::Written));
        }
        retry_sets.extend(clear_lease.clone());
        let retry = update(retry_sets, "retry");
        // A snooze leaves the attempt as it stood before the claim: where the claim counted it
        // (lease, advisory) it takes that count back; row lock counts at settlement, so it
        // counts nothing. MySQL checks the WHERE (the fence) on the row before the update.
        let snooze = t.due_at().map(|c| {
            let mut sets = vec![Sql::new(format!("{} = ", col(c))).time_ms(P::Written)];
            if !count {
                sets.push(Sql::new(format!("{a} = {a} - 1", a = self.attempt)));
            }
            if let Some(n) = t.snoozes() {
                sets.push(Sql::new(format!("{n} = COALESCE({n}, 0) + 1", n = col(n))));
            }
            sets.extend(clear_lease.clone());
            update(sets, "snooze").expect("a snooze sets the due time")
        });
        let dead = match t.dead_letter() {
            Some(DeadLetter::Column(c)) => {
                let mut sets = Vec::new();
                if count {
                    sets.push(counted.clone());
                }
                sets.push(Sql::new(format!("{} = ", col(c))).time_ms(P::Written));
                sets.extend(clear_lease);
                DeadStatements::Mark(update(sets, "dead letter").expect("a mark sets the column"))
            }
            Some(DeadLetter::Table(d)) => DeadStatements::Move(DeadMove {
                // The locking read checks the fence and holds the row while it is copied.
                lock: Some(
                    Sql::new(format!("SELECT {} FROM {table}", self.id))
                        .append(&by_id)
                        .push(" FOR UPDATE")
                        .stmt("dead letter lock"),
                ),
                count: count.then(|| {
                    Sql::new(format!("UPDATE {table} SET "))
                        .append(&counted)
                        .push(&format!(" WHERE {} = ", self.id))
                        .param(P::Id)
                        .stmt("dead letter count")
                }),
                copy: Some(
                    Sql::new(format!(
                        "INSERT INTO {} SELECT * FROM {table} WHERE {open}{} = ",
                        ident(d),
                        self.id
                    ))
                    .param(P::Id)
                    .stmt("dead letter copy"),
                ),
                delete: Sql::new(format!("DELETE FROM {table} WHERE {open}{} = ", self.id))
                    .param(P::Id)
                    .stmt("dead letter delete"),
            }),
            None => DeadStatements::None,
        };
        // An operator's cancel deletes the row even where acks keep it.
        let cancel = Sql::new(format!("DELETE FROM {table}"))
            .append(&by_id)
            .stmt("cancel");
        SettleStatements {
            ack,
            retry,
            dead,
            snooze,
            cancel,
        }
    }
}

/// The isolation level claim transactions open at: READ COMMITTED unless the table sets one, so
/// a locking read locks only the rows it returns (under REPEATABLE READ InnoDB would keep the
/// locks of every row it scanned and the gaps between them, and a second worker would skip
/// rows nobody claimed).
pub(crate) fn begin_sql(t: &TableDescription) -> Arc<str> {
    let level = t
        .isolation()
        .unwrap_or(broker_core::IsolationLevel::ReadCommitted);
    format!(
        "SET TRANSACTION ISOLATION LEVEL {}; START TRANSACTION",
        level.as_sql()
    )
    .into()
}

/// MariaDB: a condition that a statement runs inside a transaction (`@@in_transaction` reads 0
/// in autocommit), which the lease claim's update and the dead-letter move's copy and delete
/// begin their `WHERE` with. With it they change nothing once their transaction is over, and the
/// claim or the move sees that (fewer rows changed than it held) and gives up.
///
/// Seen on MariaDB 10.11 Galera under the three-node drain test (issue #34): a claim's
/// transaction, open after the locking take, was over after the FIFO guard's locking reads had
/// returned without an error (a brute-force abort for a replicated write, unreported), and
/// `@@in_transaction` read 0. The claim's update then ran on its own and committed at once. For
/// the same reason nothing runs between the claim's update and its commit: a `SELECT
/// @@in_transaction` put there (tried for this issue) once let two claims on two nodes hand out
/// the same rows, the commit of one of them having written nothing.
pub(crate) const IN_TRANSACTION: &str = "@@in_transaction = 1 AND ";

/// Settlement statements of one mode; a retry without one changes nothing in the row and has
/// no fence to check.
pub(crate) type SettleStatements = broker_core::driver::SettleStatements<Stmt>;

/// The settlement statements, for the startup check.
pub(crate) fn settle_named(statements: &SettleStatements) -> Vec<&Stmt> {
    statements
        .named()
        .into_iter()
        .map(|(_, stmt)| stmt)
        .collect()
}

/// Runs a settlement on `conn`. `fence`: what the row must still hold; the statements name
/// the lease token and the attempt the take wrote where they check them. `in_tx`: the
/// connection is inside the delivery's transaction already (row lock), so a dead-letter move
/// runs in it instead of in one of its own. Returns whether the row still held the fence
/// (always true without one); when it did not, nothing changed.
pub(crate) async fn run_settle(
    statements: &SettleStatements,
    conn: &mut MySqlConnection,
    table: &str,
    settle: Settle,
    fence: Fence,
    in_tx: bool,
) -> Result<bool> {
    let args = Args {
        id: settle.id,
        now_ms: settle.now_ms,
        written_ms: settle.written_ms(),
        token: fence.token(),
        held_attempt: settle.attempt,
        ..Args::default()
    };
    let exec = async |stmt: &Stmt, conn: &mut MySqlConnection| {
        stmt.bind(&args)
            .execute(conn)
            .await
            .map(|done| done.rows_affected() == 1)
            .map_err(|e| SqlxBrokerError::statement(table, stmt.name, e))
    };
    let moved = match statements.for_action(settle.action) {
        Run::One(_, stmt) => return exec(stmt, conn).await,
        Run::Nothing => return Ok(true),
        Run::Move(moved) => moved,
    };
    let err = |name| move |e| SqlxBrokerError::statement(table, name, e);
    // Lock (and fence), count if the mode counts here, copy to the dead-letter table, delete.
    let run_move = async |conn: &mut MySqlConnection| -> Result<bool> {
        let mut changed = false;
        for (step, stmt) in moved.steps() {
            if step == MoveStep::Lock {
                let held: Option<MySqlRow> = stmt
                    .bind(&args)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(err(stmt.name))?;
                if held.is_none() {
                    return Ok(false);
                }
            } else {
                changed = exec(stmt, conn).await?;
            }
        }
        Ok(changed)
    };
    if in_tx {
        run_move(conn).await
    } else {
        let mut tx = conn.begin().await.map_err(err("dead letter begin"))?;
        let moved = run_move(&mut tx).await?;
        if moved {
            tx.commit().await.map_err(err("dead letter commit"))?;
        } else {
            tx.rollback().await.map_err(err("dead letter rollback"))?;
        }
        Ok(moved)
    }
}

/// How the broker treats a driver error: the core's classes, which its retry policy reads.
pub use broker_core::driver::ErrorClass;

/// The MySQL error number of a driver error, if it has one.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Classifies a driver error: the one place this crate maps MySQL / MariaDB error numbers.
/// Claims, renewals and lease settlements run again (a few times, after a short pause) on a
/// transient error, so a deadlock never surfaces as lost work.
pub fn classify(e: &sqlx::Error) -> ErrorClass {
    match (e, error_number(e)) {
        (_, Some(1213 | 1205 | 3572)) => ErrorClass::Transient,
        // server shutdown, too many connections, gone away, lost, killed (MariaDB)
        (_, Some(1053 | 1040 | 2006 | 2013 | 1927)) => ErrorClass::Connection,
        (sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed, _) => {
            ErrorClass::Connection
        }
        _ => ErrorClass::Permanent,
    }
}

/// Whether `error` is transient on MySQL / MariaDB: a deadlock, a lock wait timeout, a `NOWAIT`
/// read that met a lock, or a lost connection (see [`classify`]). Claims are retried by the
/// subscription engine on their own.
pub fn is_transient(error: &SqlxBrokerError) -> bool {
    broker_core::driver::retry::is_transient(classify, error)
}

/// Runs `work` under the core's policy for errors the server undid
/// ([`retry::transient`](broker_core::driver::retry::transient)), so a claim that lost a race
/// is not reported as a failed claim.
pub(crate) async fn retrying<T, F, Fut>(work: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    broker_core::driver::retry::transient_by(classify, work).await
}

/// Runs a fenced settlement (or renewal) `work` under the core's policy for fenced statements
/// ([`retry::fenced`](broker_core::driver::retry::fenced)): again after a lost connection while
/// the host's clock is before `deadline_ms`.
pub(crate) async fn settle_retrying<T, F, Fut>(deadline_ms: i64, work: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    broker_core::driver::retry::fenced_by(classify, deadline_ms, work).await
}

/// Executes a statement that takes no parameters over the text protocol (transaction control:
/// `SAVEPOINT`, `ROLLBACK TO SAVEPOINT`).
pub(crate) async fn execute_plain(
    conn: &mut MySqlConnection,
    table: &str,
    name: &'static str,
    sql: &'static str,
) -> Result<()> {
    conn.execute(sql)
        .await
        .map(|_| ())
        .map_err(|e| SqlxBrokerError::statement(table, name, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_core::ColumnType;

    #[test]
    fn identifiers_are_quoted_with_inner_backticks_doubled() {
        assert_eq!(ident("my `odd` table"), "`my ``odd`` table`");
        assert_eq!(ident("order"), "`order`");
    }

    #[test]
    fn lock_conflicts_are_transient_and_other_errors_are_not() {
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), ErrorClass::Connection);
        assert_eq!(classify(&sqlx::Error::RowNotFound), ErrorClass::Permanent);
    }

    #[test]
    fn times_clamp_to_datetime_and_lease_expiries_are_whole_seconds() {
        assert_eq!(micros(1_700_000_000_123), 1_700_000_000_123_000);
        assert_eq!(micros(-5), 0);
        assert_eq!(micros(i64::MAX), MAX_MS * 1000);
        assert_eq!(whole_seconds(1_700_000_001_000), 1_700_000_001);
        assert_eq!(whole_seconds(1_700_000_000_001), 1_700_000_001);
    }

    #[test]
    fn parameters_follow_the_text_in_order() {
        let t = TableDescription::builder("jobs")
            .payload("payload", ColumnType::Text)
            .due_at("due")
            .locked_until("lu")
            .processed_at("done")
            .build()
            .unwrap();
        let s = Statements::new(&t);
        assert_eq!(s.claimable.params, vec![P::Now, P::Now]);
        assert_eq!(s.claimable.text.matches('?').count(), 2);
        assert!(s.claimable.text.starts_with("`jobs`.`done` IS NULL"));
        let fence = Sql::new(" AND `jobs`.`lu` = ")
            .time_s(P::TokenExpires)
            .push(" AND `jobs`.`attempt` = ")
            .param(P::TokenAttempt);
        let settle = s.settle(&t, &fence, false, "");
        let retry = settle.retry.as_ref().unwrap();
        assert_eq!(
            &*retry.params,
            &[P::Written, P::Id, P::TokenExpires, P::TokenAttempt]
        );
        assert!(
            retry.sql().contains("`jobs`.`lu` = NULL"),
            "{}",
            retry.sql()
        );
        assert!(!retry.sql().contains("+ 1"), "lease retries do not count");
        let counted = s.settle(&t, &Sql::default(), true, "");
        assert!(
            counted
                .retry
                .unwrap()
                .sql()
                .contains("`jobs`.`attempt` + 1")
        );
    }

    #[test]
    fn a_retry_without_a_due_column_only_checks_its_fence() {
        let t = TableDescription::builder("jobs")
            .column("k", ColumnType::Text)
            .advisory_lock("k-{k}")
            .build()
            .unwrap();
        let s = Statements::new(&t);
        assert!(s.settle(&t, &Sql::default(), false, "").retry.is_none());
        let fence = Sql::new(" AND `jobs`.`attempt` = ").param(P::HeldAttempt);
        let retry = s.settle(&t, &fence, false, "").retry.unwrap();
        assert_eq!(
            retry.sql(),
            "UPDATE `jobs` SET `jobs`.`id` = `jobs`.`id` WHERE `jobs`.`id` = ? AND `jobs`.`attempt` = ?"
        );
        assert_eq!(&*retry.params, &[P::Id, P::HeldAttempt]);
    }
}
