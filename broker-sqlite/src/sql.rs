//! Quoting and the statement fragments every SQLite strategy shares. Values are always bound,
//! never pasted: only identifiers (quoted) and the broker's own fragments reach the SQL text.

use std::future::Future;

use broker_core::driver::{DeadMove, DeadStatements, Fence, Run, Settle, alias, bind_settle};
use broker_core::{DeadLetter, Result, SqlxBrokerError, TableDescription};
use sqlx::{Connection, SqliteConnection, SqlitePool};

use crate::backend::{Warm, write_conn};
use crate::fifo;
use crate::keys::KeyTable;

/// How the broker treats a driver error: the core's classes, which its retry policy reads.
pub use broker_core::driver::ErrorClass;

/// Classifies a driver error. The one place this crate maps SQLite result codes: busy (5) and
/// locked (6), with their extended codes, are transient (another writer held the file past the
/// busy timeout); I/O errors and a pool that cannot hand out a connection are connection
/// errors; the rest is permanent.
pub fn classify(err: &sqlx::Error) -> ErrorClass {
    match err {
        sqlx::Error::Database(db) => {
            let code = db.code().and_then(|c| c.parse::<i64>().ok()).unwrap_or(0);
            if matches!(code % 256, 5 | 6) {
                ErrorClass::Transient
            } else {
                ErrorClass::Permanent
            }
        }
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => {
            ErrorClass::Connection
        }
        _ => ErrorClass::Permanent,
    }
}

/// Runs `work` under the core's policy for errors the database undid
/// ([`retry::transient`](broker_core::driver::retry::transient)): busy or locked past the busy
/// timeout, so a claim that met another writer is not reported as a failed claim. Only for
/// work that a failed try leaves unchanged (one statement in autocommit, or a transaction that
/// rolled back).
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

/// Whether `error` is transient on SQLite: busy or locked past the busy timeout, or a lost
/// connection (see [`classify`]). Claims are retried by the subscription engine on their own.
pub fn is_transient(error: &SqlxBrokerError) -> bool {
    broker_core::driver::retry::is_transient(classify, error)
}

/// Quotes an identifier in backticks, a backtick inside doubled. Not in double quotes: SQLite
/// reads a double-quoted name that matches no column as a string literal, so a misspelt column
/// would pass every check and compare against its own name.
pub(crate) fn ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// The claim's sort key for the due-time column `col` (unix ms): the due time, NULL (due at
/// once) as 0, before every real one. The claim index has this very expression, so SQLite reads
/// the claim's condition and order from it.
pub(crate) fn due_key(col: &str) -> String {
    format!("ifnull({col}, 0)")
}

/// The statements of one table, built once at subscribe time.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    pub(crate) table: String,
    pub(crate) id: String,
    pub(crate) attempt: String,
    /// `WHERE` conditions of a claimable row; `?1` is the host's now (unix ms).
    pub(crate) claimable: String,
    /// The same without the FIFO head condition: the row is due and free, whatever its group.
    pub(crate) claimable_row: String,
    /// `ORDER BY` of a claim.
    pub(crate) order: String,
    /// What a claim returns: the whole row plus the broker's aliases. `attempt_expr` is the
    /// attempt before the claim.
    aliases_tail: String,
}

impl Statements {
    pub(crate) fn new(t: &TableDescription) -> Self {
        let table = ident(t.name());
        let id = ident(t.id());
        let attempt = ident(t.attempt());
        let mut claimable: Vec<String> = t
            .unfinished_columns()
            .into_iter()
            .map(|c| format!("{} IS NULL", ident(c)))
            .collect();
        // The due time leads the claim order (after the priority), as the claim index's
        // expression: due rows come first and the scan stops at the first row not due yet,
        // however many scheduled rows come earlier in id order. NULL is due at once.
        let due = t.due_at().map(|c| due_key(&ident(c)));
        if let Some(due) = &due {
            claimable.push(format!("{due} <= ?1"));
        }
        if let Some(c) = t.locked_until() {
            let c = ident(c);
            claimable.push(format!("({c} IS NULL OR {c} <= ?1)"));
        }
        // A subscription of some kinds claims only rows of its kinds.
        claimable.extend(t.kind().and_then(|k| t.kind_condition(&ident(k))));
        if claimable.is_empty() {
            claimable.push("1 = 1".into());
        }
        let claimable_row = claimable.join(" AND ");
        if let Some(head) = fifo::head_condition(t) {
            claimable.push(head);
        }
        let mut order = Vec::new();
        if let Some(p) = t.priority() {
            order.push(format!("{} DESC", ident(p)));
        }
        order.extend(due);
        order.push(id.clone());
        let order = order.join(", ");
        let mut aliases_tail = format!(", {id} AS {}", alias::ID);
        if let Some((p, _)) = t.payload() {
            aliases_tail.push_str(&format!(", {} AS {}", ident(p), alias::PAYLOAD));
        }
        // The due time (unix ms), for the time from a row's due time to its handler's start.
        if let Some(c) = t.due_at() {
            aliases_tail.push_str(&format!(", {} AS {}", ident(c), alias::DUE));
        }
        if let Some(n) = t.snoozes() {
            aliases_tail.push_str(&format!(", {} AS {}", ident(n), alias::SNOOZES));
        }
        if let Some(k) = t.kind() {
            aliases_tail.push_str(&format!(", {} AS {}", ident(k), alias::KIND));
        }
        if let Some(c) = t.job_timeout() {
            aliases_tail.push_str(&format!(", {} AS {}", ident(c), alias::TIMEOUT_MS));
        }
        Self {
            table,
            id,
            attempt,
            claimable: claimable.join(" AND "),
            claimable_row,
            order,
            aliases_tail,
        }
    }

    /// What a claim hands out (its `RETURNING` list): the whole row plus the broker's aliases.
    /// `counted`: the statement has just added one to the attempt, so the attempt before the
    /// claim is one less.
    pub(crate) fn claimed_columns(&self, counted: bool) -> String {
        format!(
            "*{}, {}{} AS {}",
            self.aliases_tail,
            self.attempt,
            if counted { " - 1" } else { "" },
            alias::ATTEMPT
        )
    }

    /// The statements of a settlement. `fence` holds the extra conditions that must still hold
    /// (lease: the token); parameters: `?1` id, `?2` now or due, then the fence's own from `?3`.
    pub(crate) fn settle(&self, t: &TableDescription, fence: &str) -> SettleStatements {
        let (table, id) = (&self.table, &self.id);
        let clear_lease = t
            .locked_until()
            .map(|c| format!(", {} = NULL", ident(c)))
            .unwrap_or_default();
        let ack = match t.processed_at() {
            Some(c) => format!(
                "UPDATE {table} SET {} = ?2{clear_lease} WHERE {id} = ?1{fence}",
                ident(c)
            ),
            None => format!("DELETE FROM {table} WHERE {id} = ?1 AND ?2 IS NOT NULL{fence}"),
        };
        let retry = match t.due_at() {
            Some(c) => format!(
                "UPDATE {table} SET {} = ?2{clear_lease} WHERE {id} = ?1{fence}",
                ident(c)
            ),
            None => format!(
                "UPDATE {table} SET {id} = {id}{clear_lease} WHERE {id} = ?1 AND ?2 IS NULL{fence}"
            ),
        };
        let dead = match t.dead_letter() {
            Some(DeadLetter::Column(c)) => DeadStatements::Mark(format!(
                "UPDATE {table} SET {} = ?2{clear_lease} WHERE {id} = ?1{fence}",
                ident(c)
            )),
            Some(DeadLetter::Table(d)) => DeadStatements::Move(DeadMove {
                lock: None,
                count: None,
                copy: Some(format!(
                    "INSERT INTO {} SELECT * FROM {table} WHERE {id} = ?1 AND ?2 IS NOT NULL{fence}",
                    ident(d)
                )),
                delete: format!("DELETE FROM {table} WHERE {id} = ?1 AND ?2 IS NOT NULL{fence}"),
            }),
            None => DeadStatements::None,
        };
        // A snooze takes back the attempt the claim counted (every SQLite mode counts at the
        // claim); the fence reads the row before the update.
        let snooze = t.due_at().map(|c| {
            let counter = t
                .snoozes()
                .map(|n| format!(", {n} = COALESCE({n}, 0) + 1", n = ident(n)))
                .unwrap_or_default();
            format!(
                "UPDATE {table} SET {} = ?2, {a} = {a} - 1{counter}{clear_lease} WHERE {id} = ?1{fence}",
                ident(c),
                a = self.attempt
            )
        });
        // An operator's cancel deletes the row even where acks keep it.
        let cancel = format!("DELETE FROM {table} WHERE {id} = ?1 AND ?2 IS NOT NULL{fence}");
        SettleStatements {
            ack,
            retry: Some(retry),
            dead,
            snooze,
            cancel,
        }
    }
}

/// Settlement statements of one mode (`?2` of the retry is the due time, NULL: due at once).
pub(crate) type SettleStatements = broker_core::driver::SettleStatements<String>;

/// The settlement statements with their names, for the startup check.
pub(crate) fn settle_named(statements: &SettleStatements) -> Vec<(&'static str, &str)> {
    statements
        .named()
        .into_iter()
        .map(|(name, sql)| (name, sql.as_str()))
        .collect()
}

/// Runs a settlement on a kept connection (see [`Warm`]); with a lease `fence` the statements
/// must match its token. Returns the rows changed (0: the fence no longer holds, and nothing
/// changed).
pub(crate) async fn run_settle(
    statements: &SettleStatements,
    warm: &Warm,
    pool: &SqlitePool,
    file: &KeyTable,
    table: &str,
    settle: Settle,
    fence: Fence,
) -> Result<u64> {
    let (mut conn, turn) = write_conn(warm, pool, file, table).await?;
    let done = run_settle_on(statements, &mut conn, table, settle, fence).await;
    drop(turn);
    warm.keep_if(conn, done.is_ok());
    done
}

async fn run_settle_on(
    statements: &SettleStatements,
    conn: &mut SqliteConnection,
    table: &str,
    settle: Settle,
    fence: Fence,
) -> Result<u64> {
    let err = |name| move |e| SqlxBrokerError::statement(table, name, e);
    // Parameters: ?1 id, ?2 the time the statement writes, then the fence's from ?3.
    let run = async |name: &'static str, sql: &str, conn: &mut SqliteConnection| {
        let q = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()));
        bind_settle(q, &settle, fence)
            .execute(conn)
            .await
            .map(|done| done.rows_affected())
            .map_err(err(name))
    };
    let moved = match statements.for_action(settle.action) {
        Run::One(name, sql) => return run(name, sql, conn).await,
        Run::Nothing => unreachable!("SQLite always builds a retry statement"),
        Run::Move(moved) => moved,
    };
    // Copy to the dead-letter table, then delete, in one write transaction. BEGIN IMMEDIATE
    // takes the write lock up front, so the copy never meets another writer half way
    // ("database is locked").
    let mut tx = conn
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(err("dead letter"))?;
    let mut done = 0;
    for (step, sql) in moved.steps() {
        done = run(step.name(), sql, &mut tx).await?;
    }
    if done != 1 {
        // The fence no longer holds: the copy must not stay either. Rolled back here, not on
        // drop, since the connection is kept for the next statement.
        tx.rollback().await.map_err(err("dead letter rollback"))?;
        return Ok(0);
    }
    tx.commit().await.map_err(err("dead letter commit"))?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_with_inner_quotes_doubled() {
        assert_eq!(ident("my `odd` table"), "`my ``odd`` table`");
        assert_eq!(ident("order"), "`order`");
    }

    /// A write that finds another writer holding the file past its busy timeout fails with
    /// SQLite's busy code, which the retry policy must see as transient (a claim or settlement
    /// then runs again instead of failing); a statement that names no table is permanent. Real
    /// errors from a real file.
    #[tokio::test]
    async fn another_writer_past_the_busy_timeout_is_transient_and_bad_sql_is_not() {
        use sqlx::ConnectOptions;
        use sqlx::sqlite::SqliteConnectOptions;

        let path = std::env::temp_dir().join(format!(
            "sqlx-broker-classify-{}-{}.db",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        ));
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .busy_timeout(std::time::Duration::ZERO);
        let mut holder = options.connect().await.unwrap();
        let mut other = options.connect().await.unwrap();
        sqlx::raw_sql("CREATE TABLE t (x INTEGER)")
            .execute(&mut holder)
            .await
            .unwrap();
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut holder)
            .await
            .unwrap();
        let busy = sqlx::raw_sql("INSERT INTO t VALUES (1)")
            .execute(&mut other)
            .await
            .expect_err("the file is held by another writer");
        assert_eq!(classify(&busy), ErrorClass::Transient, "{busy}");
        let bad = sqlx::raw_sql("SELECT * FROM no_such_table")
            .execute(&mut other)
            .await
            .expect_err("no such table");
        assert_eq!(classify(&bad), ErrorClass::Permanent, "{bad}");
        // The public check, on the errors a caller gets from the broker.
        assert!(is_transient(&SqlxBrokerError::statement(
            "t", "insert", busy
        )));
        assert!(!is_transient(&SqlxBrokerError::statement(
            "t", "select", bad
        )));
        // A pool that cannot hand out a connection: a connection error, run again.
        let pool = SqlitePool::connect_with(options.clone()).await.unwrap();
        pool.close().await;
        let closed = pool.acquire().await.expect_err("the pool is closed");
        assert_eq!(classify(&closed), ErrorClass::Connection, "{closed}");
        assert!(is_transient(&SqlxBrokerError::statement(
            "t", "claim", closed
        )));
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut holder)
            .await
            .unwrap();
        drop((holder, other));
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
}
