//! Advisory mode on PostgreSQL: each key is a session-level advisory lock on its 64-bit hash,
//! `pg_try_advisory_lock(hashtextextended(key, 0))` (-- needs hashtextextended: PostgreSQL 11),
//! held on a pool connection of its own that follows the delivery until it settles.
//!
//! The claim first reads due rows with their keys, leaving out keys that any session holds now
//! (read from `pg_locks`, where a bigint lock shows its high half as `classid` and its low half as
//! `objid`, with `objsubid = 1`), so a held key costs no connection. That read takes no lock: the
//! lock is tried afterwards, one key at a time, in a statement of its own. A probe in the scan of
//! due rows could be run by the planner on every row it passes, locking every due key.
//!
//! Session locks need the session: behind a transaction-mode pooler (PgBouncer
//! `pool_mode = transaction`) the lock and the statements after it may land on different server
//! connections. Preparing an advisory table checks that two statements on one connection see one
//! backend and refuses the table otherwise.

use std::sync::Arc;

use broker_core::driver::retry::TRANSIENT_RETRIES;
use broker_core::driver::{AdvisoryStrategy, Candidate, ClaimedRow, Settle};
use broker_core::{KeyPart, Result, SqlxBrokerError, TableDescription};
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, Row};

use crate::fifo;
use crate::sql::{
    ErrorClass, Failed, Fence, SettleStatements, Statements, classify, ident, query,
    settle_retries, with_retries,
};

/// How long an advisory settlement whose key session went away runs again on pool connections.
const ADVISORY_SETTLE_RETRY: std::time::Duration = std::time::Duration::from_secs(10);

/// A held advisory key: the pool connection whose session holds the lock.
///
/// [`PgAdvisory::unlock`] frees the key and returns the connection to the pool. Dropped without
/// it, the connection is closed instead of returned, so its session ends and the server frees
/// the key.
#[derive(Debug)]
pub struct KeyLock {
    conn: Option<PoolConnection<Postgres>>,
    key: String,
}

impl KeyLock {
    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    fn conn(&mut self) -> &mut PgConnection {
        self.conn
            .as_mut()
            .expect("a key lock keeps its connection until unlocked")
    }
}

impl Drop for KeyLock {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            // Returned to the pool, the session (and its lock) would live on.
            conn.close_on_drop();
        }
    }
}

/// The key of a row as SQL, and the template's literal pieces it binds from parameter `first`
/// on: `concat` reads NULL as the empty string, as the template does.
fn key_expr(t: &TableDescription, first: usize) -> (String, Vec<String>) {
    let template = t.advisory_lock().expect("advisory mode has a template");
    let mut literals = Vec::new();
    let parts: Vec<String> = template
        .parts()
        .iter()
        .map(|part| match part {
            KeyPart::Literal(text) => {
                literals.push(text.clone());
                format!("${}::text", first + literals.len() - 1)
            }
            KeyPart::Column(c) => format!("q.{}", ident(c)),
        })
        .collect();
    (format!("concat({})", parts.join(", ")), literals)
}

/// The advisory strategy of one PostgreSQL table.
#[derive(Debug)]
pub struct PgAdvisory {
    pool: PgPool,
    table: Arc<TableDescription>,
    /// The template's literal pieces, bound after each statement's own parameters.
    literals: Vec<String>,
    candidates: Arc<str>,
    take: Arc<str>,
    /// FIFO tables: the guard prefix the take binds.
    guard: Option<String>,
    settle: SettleStatements,
}

const TRY_LOCK: &str = "SELECT pg_try_advisory_lock(hashtextextended($1::text, 0))";
const UNLOCK: &str = "SELECT pg_advisory_unlock(hashtextextended($1::text, 0))";

impl PgAdvisory {
    pub(crate) fn new(pool: PgPool, table: Arc<TableDescription>, columns: &[String]) -> Self {
        let s = Statements::new(&table, columns);
        // $1 now, $2 limit, literals from $3, then the skip.
        let (key, literals) = key_expr(&table, 3);
        // The held keys are read once per claim, as a hashed subplan the rows are probed
        // against (`NOT IN` over an uncorrelated subquery; the hashes are never NULL): a
        // correlated `NOT EXISTS` read all of pg_locks again for every row it passed, 6x slower
        // with 10,000 rows of one held key ahead (EXPLAIN ANALYZE: 13.6 ms against 2.1 ms),
        // and slower the more locks the server holds.
        // The skip comes after the template's literals.
        let skip = 3 + literals.len();
        let candidates = format!(
            "SELECT q.{id}::int8, {key} FROM {t} AS q WHERE {claimable} \
             AND hashtextextended({key}, 0) NOT IN (SELECT (l.classid::int8 << 32) | l.objid::int8 \
                 FROM pg_locks AS l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
                 AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())) \
             ORDER BY {order} LIMIT $2::int8 OFFSET ${skip}::int8",
            id = s.id,
            t = s.table,
            claimable = s.claimable,
            order = s.order,
        );
        // $1 now, $2 id, $3 the locked key, literals from $4; FIFO: the guard prefix after them.
        // The key must still be the row's key: a row whose key columns changed since the
        // candidates were read is not this lock's to take.
        let (key, _) = key_expr(&table, 4);
        let still = format!(" AND q.{id} = $2::int8 AND {key} = $3::text", id = s.id);
        let columns = s.claimed_columns(true);
        let (take, guard) = match table.group().filter(|_| table.fifo()) {
            Some(group) => {
                let prefix = format!("${}", 4 + literals.len());
                (
                    format!(
                        "WITH {cand} UPDATE {t} AS q SET {a} = q.{a} + 1 FROM sqlx_broker_cand AS c \
                         WHERE q.{id} = c.id AND {claimable} RETURNING {columns}",
                        cand = fifo::candidates(&s, group, &still, "1", "1", &prefix),
                        t = s.table,
                        a = s.attempt,
                        id = s.id,
                        claimable = s.claimable,
                    ),
                    Some(fifo::guard_prefix(&table)),
                )
            }
            None => (
                format!(
                    "UPDATE {t} AS q SET {a} = q.{a} + 1 WHERE {claimable}{still} RETURNING {columns}",
                    t = s.table,
                    a = s.attempt,
                    claimable = s.claimable,
                ),
                None,
            ),
        };
        let settle = s.settle(&table, false, &format!(" AND q.{} = $3::int8", s.attempt));
        Self {
            pool,
            table,
            literals,
            candidates: candidates.into(),
            take: take.into(),
            guard,
            settle,
        }
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![("candidates", &*self.candidates), ("take", &*self.take)];
        out.extend(self.settle.named());
        out
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }
}

impl AdvisoryStrategy for PgAdvisory {
    type Db = Postgres;
    type KeyLock = KeyLock;

    async fn candidates(&self, limit: usize, skip: usize, now_ms: i64) -> Result<Vec<Candidate>> {
        let rows = with_retries(|| async {
            // Advisory mode needs a session of its own (it is refused behind a transaction-mode
            // pooler), so its statements are always prepared.
            let mut q = query(&self.candidates, true)
                .bind(now_ms)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX));
            for literal in &self.literals {
                q = q.bind(literal.clone());
            }
            q.bind(i64::try_from(skip).unwrap_or(i64::MAX))
                .fetch_all(&self.pool)
                .await
                .map_err(Failed::new("candidates"))
        })
        .await
        .map_err(|e| e.on(self.table.name()))?;
        rows.iter()
            .map(|row| {
                Ok(Candidate {
                    id: row.try_get(0).map_err(self.err("candidates"))?,
                    key: row.try_get(1).map_err(self.err("candidates"))?,
                })
            })
            .collect()
    }

    /// Tries the key's lock on a pool connection of its own; the connection goes back to the
    /// pool at once when another session holds the key.
    async fn try_lock(&self, key: &str) -> Result<Option<KeyLock>> {
        let mut conn = self.pool.acquire().await.map_err(self.err("acquire"))?;
        let locked: bool = sqlx::query_scalar(TRY_LOCK)
            .bind(key)
            .fetch_one(&mut *conn)
            .await
            .map_err(self.err("try lock"))?;
        Ok(locked.then(|| KeyLock {
            conn: Some(conn),
            key: key.to_owned(),
        }))
    }

    /// Takes the row on the lock's connection: counts the attempt and reads the row, only while
    /// it is still claimable and still has the locked key.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled take may have counted the attempt; dropping the lock then
    /// closes its connection, which frees the key.
    async fn take(
        &self,
        lock: &mut KeyLock,
        id: i64,
        now_ms: i64,
    ) -> Result<Option<ClaimedRow<Postgres>>> {
        let key = lock.key.clone();
        let conn = lock.conn();
        let mut tries = 0;
        let row = loop {
            let mut q = query(&self.take, true)
                .bind(now_ms)
                .bind(id)
                .bind(key.clone());
            for literal in &self.literals {
                q = q.bind(literal.clone());
            }
            if let Some(prefix) = &self.guard {
                q = q.bind(prefix.clone());
            }
            match q
                .fetch_optional(&mut *conn)
                .await
                .map_err(Failed::new("take"))
            {
                Err(e) if e.is_transient() && tries < TRANSIENT_RETRIES => tries += 1,
                other => break other.map_err(|e| e.on(self.table.name()))?,
            }
        };
        row.map(|row| crate::backend::claimed(row, Some(key)).map_err(self.err("take")))
            .transpose()
    }

    /// Settles on the lock's connection, fenced on the attempt the take wrote: while the key's
    /// session lives no other claim can take the row, and a row claimed again after the session
    /// ended is left alone ([`SqlxBrokerError::ClaimLost`]).
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled settlement may or may not have landed; the key stays locked
    /// until the lock is unlocked or dropped.
    async fn settle(&self, lock: &mut KeyLock, settle: Settle) -> Result<()> {
        let conn = lock.conn();
        let mut tries = 0;
        let first = loop {
            match self
                .settle
                .run(conn, settle, Fence::Attempt(settle.attempt))
                .await
            {
                Err(e) if e.is_transient() && tries < TRANSIENT_RETRIES => tries += 1,
                other => break other,
            }
        };
        let changed = match first {
            // The key's session went away under the delivery (its key is free now): the
            // settlement is fenced on the attempt the take wrote, so it runs again on pool
            // connections for a while, and changes nothing if the row was taken again meanwhile.
            Err(e) if classify(&e.source) == ErrorClass::Connection => {
                let deadline = broker_core::driver::clock::after_ms(ADVISORY_SETTLE_RETRY);
                settle_retries(deadline, || async {
                    let mut conn = self.pool.acquire().await.map_err(Failed::new("acquire"))?;
                    self.settle
                        .run(&mut conn, settle, Fence::Attempt(settle.attempt))
                        .await
                })
                .await
            }
            other => other,
        }
        .map_err(|e| e.on(self.table.name()))?;
        if changed == 1 {
            Ok(())
        } else {
            Err(SqlxBrokerError::ClaimLost {
                table: self.table.name().to_owned(),
                id: settle.id,
            })
        }
    }

    /// Unlocks and returns the connection to the pool; when the unlock fails, the connection is
    /// closed instead, which frees the key as well.
    async fn unlock(&self, mut lock: KeyLock) -> Result<()> {
        let Some(mut conn) = lock.conn.take() else {
            return Ok(());
        };
        let unlocked = sqlx::query_scalar::<_, bool>(UNLOCK)
            .bind(&lock.key)
            .fetch_one(&mut *conn)
            .await;
        match unlocked {
            Ok(true) => Ok(()),
            Ok(false) => {
                // The session did not hold the key (it cannot happen while the connection is the
                // lock's own); close it rather than return a session in an unknown state.
                conn.close_on_drop();
                tracing::warn!(
                    table = self.table.name(),
                    key = lock.key,
                    "advisory unlock found the key not held"
                );
                Ok(())
            }
            Err(e) => {
                conn.close_on_drop();
                Err(self.err("unlock")(e))
            }
        }
    }
}
