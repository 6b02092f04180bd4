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
use broker_core::driver::{
    AdvisoryStrategy, Candidate, ClaimedRow, Fence, KeyWalk, LockStatement, Position,
    SessionKeyLock, Settle, TryLocked, WarmConnections, settle_advisory,
};
use broker_core::{KeyPart, KeyTemplate, Result, SqlxBrokerError, TableDescription};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres, Row};

use crate::fifo;
use crate::sql::{
    Failed, Resume, SettleStatements, Statements, classify, ident, literal, on_warm, query,
    retrying, run_settle, settle_named,
};
use crate::stats::StatsWatch;

/// A held advisory key: the pool connection whose session holds the lock on the key (its
/// name is the key itself). [`PgAdvisory::unlock`] frees the key and keeps the connection for
/// the next try-lock; dropped without it, the connection is closed instead of returned, so its
/// session ends and the server frees the key.
type KeyLock = SessionKeyLock<Postgres>;

/// The key of a row (`alias`) as SQL, and the template's literal pieces it binds from parameter
/// `first` on: `concat` reads NULL as the empty string, as the template does.
fn key_expr(template: &KeyTemplate, alias: &str, first: usize) -> (String, Vec<String>) {
    let mut literals = Vec::new();
    let parts: Vec<String> = template
        .parts()
        .iter()
        .map(|part| match part {
            KeyPart::Literal(text) => {
                literals.push(text.clone());
                format!("${}::text", first + literals.len() - 1)
            }
            KeyPart::Column(c) => format!("{alias}.{}", ident(c)),
        })
        .collect();
    (format!("concat({})", parts.join(", ")), literals)
}

/// On a FIFO table, the condition that keeps the candidates in claim order to the rows without a
/// group (the claim index holds only those; grouped rows come through the walk of the groups).
fn ungrouped(t: &TableDescription, prefix: &str) -> String {
    t.group()
        .filter(|_| t.fifo())
        .map(|g| format!(" AND {prefix}{} IS NULL", ident(g)))
        .unwrap_or_default()
}

/// The advisory strategy of one PostgreSQL table.
#[derive(Debug)]
pub struct PgAdvisory {
    pool: PgPool,
    table: Arc<TableDescription>,
    /// The template's literal pieces, bound after each statement's own parameters.
    literals: Vec<String>,
    candidates: Arc<str>,
    /// The candidates from a position on (see `Statements::resume_condition`); `None` where
    /// claims always read from the start.
    candidates_from: Option<Resume>,
    /// The key walk from the first key, and from just after a key (see [`key_walk`]); `None`
    /// for a table without one.
    walk: Option<[Arc<str>; 2]>,
    take: Arc<str>,
    /// FIFO tables: the guard prefix the take binds.
    guard: Option<String>,
    /// FIFO tables: the second read of the take's transaction (see `fifo::claim_checked`).
    recheck: Option<Arc<str>>,
    settle: SettleStatements,
    /// Connections whose key was unlocked (or whose try-lock found the key held), kept for the
    /// next candidate read or try-lock: a pool acquire tests the connection with a round trip
    /// of its own, one more per row than a hand-written loop that keeps its connection.
    warm: WarmConnections<PoolConnection<Postgres>>,
    /// Analyzes the table when a burst left its statistics stale (see `stats`).
    stats: Arc<StatsWatch>,
}

const TRY_LOCK: LockStatement<bool> = LockStatement {
    sql: "SELECT pg_try_advisory_lock(hashtextextended($1::text, 0))",
    read: Some,
};
const UNLOCK: LockStatement<bool> = LockStatement {
    sql: "SELECT pg_advisory_unlock(hashtextextended($1::text, 0))",
    read: Some,
};

impl PgAdvisory {
    pub(crate) fn new(
        pool: PgPool,
        table: Arc<TableDescription>,
        template: &KeyTemplate,
        columns: &[String],
        stats: Arc<StatsWatch>,
    ) -> Self {
        let s = Statements::new(&table, columns);
        // $1 now, $2 limit, literals from $3, then the skip.
        let (key, literals) = key_expr(template, "q", 3);
        // Whether another session holds a row's key: the held keys are read once per statement,
        // as a hashed subplan each row is probed against (`IN` over an uncorrelated subquery;
        // the hashes are never NULL). A correlated `EXISTS` read all of pg_locks again for every
        // row (EXPLAIN ANALYZE, 10,000 rows of one held key: 13.6 ms against 2.1 ms). The
        // candidates only mark such rows, so that a window of held keys costs one read and the
        // claim goes on with the key walk, instead of scanning past every row of a held key.
        let held = |key: &str| {
            format!(
                "hashtextextended({key}, 0) IN (SELECT (l.classid::int8 << 32) | l.objid::int8 \
                 FROM pg_locks AS l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
                 AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database()))"
            )
        };
        let skip = 3 + literals.len();
        // Columns: id, key, held, and the due time where the table has one.
        let candidates_with = |from: &str| {
            format!(
                "SELECT q.{id}::int8, {key}, {held}{due} FROM {t} AS q \
                 WHERE {claimable}{ungrouped}{from} \
                 ORDER BY {order} LIMIT $2::int8 OFFSET ${skip}::int8",
                id = s.id,
                held = held(&key),
                due = s.due_column(),
                t = s.table,
                claimable = s.claimable,
                ungrouped = ungrouped(&table, "q."),
                order = s.order,
            )
        };
        let candidates = candidates_with("");
        // The position after the skip.
        let candidates_from = s
            .resume_condition(skip + 1)
            .map(|from| s.resume(candidates_with(&from)));
        let walk = table.key_walk_columns().map(|_| {
            [false, true].map(|after| {
                Arc::from(key_walk(&s, &table, template, &held, literals.len(), after))
            })
        });
        // $1 now, $2 id, $3 the locked key, literals from $4; FIFO: the guard prefix after them.
        // The key must still be the row's key: a row whose key columns changed since the
        // candidates were read is not this lock's to take.
        let (key, _) = key_expr(template, "q", 4);
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
        let recheck = guard
            .as_ref()
            .and_then(|_| fifo::no_longer_heads(&table))
            .map(Arc::from);
        Self {
            warm: WarmConnections::for_pool(&pool),
            stats,
            pool,
            table,
            literals,
            candidates: candidates.into(),
            candidates_from,
            walk,
            take: take.into(),
            recheck,
            guard,
            settle,
        }
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![("candidates", &*self.candidates), ("take", &*self.take)];
        if let Some(from) = &self.candidates_from {
            out.push(("candidates from a position", &*from.sql));
        }
        if let Some([first, after]) = &self.walk {
            out.extend([("key walk", &**first), ("key walk after", &**after)]);
        }
        if let Some(recheck) = &self.recheck {
            out.push(("fifo recheck", &**recheck));
        }
        out.extend(settle_named(&self.settle));
        out
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }
}

/// The key walk of an advisory table (see [`AdvisoryStrategy::walk_keys`]): a recursive
/// statement whose every step is one probe of the key index (the key columns, id; over
/// unfinished rows) for the next key, from the first or (`after`) from just after the key whose
/// columns are bound as text after the template's literals, pulled only as far as the `LIMIT`
/// ($2) asks; for each key its columns as text, its first claimable row by id (NULL when it has
/// none), the key and whether another session holds it. The bound columns are read into the
/// table's own column types through `json_populate_record` on the table's row type, so a key of
/// any type compares in the index's order (a stable expression, so it is an index bound). Keys
/// with a NULL column are not visited.
fn key_walk(
    s: &Statements,
    t: &TableDescription,
    template: &KeyTemplate,
    held: &dyn Fn(&str) -> String,
    literals: usize,
    after: bool,
) -> String {
    let (tbl, id) = (&s.table, &s.id);
    let cols: Vec<String> = t
        .key_walk_columns()
        .unwrap_or_default()
        .into_iter()
        .map(ident)
        .collect();
    let tuple = |alias: &str| {
        let list: Vec<String> = cols.iter().map(|c| format!("{alias}.{c}")).collect();
        format!("({})", list.join(", "))
    };
    let listed = |alias: &str| {
        cols.iter()
            .map(|c| format!("{alias}.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let unf_n: String = t
        .unfinished_columns()
        .into_iter()
        .map(|c| format!(" AND n.{} IS NULL", ident(c)))
        .collect();
    let not_null: String = cols
        .iter()
        .map(|c| format!(" AND n.{c} IS NOT NULL"))
        .collect();
    let start = if after {
        let first = 3 + literals;
        let object: Vec<String> = t
            .key_walk_columns()
            .unwrap_or_default()
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{}, ${}::text", literal(c), first + i))
            .collect();
        let typed: Vec<String> = cols
            .iter()
            .map(|c| {
                format!(
                    "(json_populate_record(NULL::{tbl}, json_build_object({}))).{c}",
                    object.join(", ")
                )
            })
            .collect();
        format!(" AND {} > ({})", tuple("n"), typed.join(", "))
    } else {
        String::new()
    };
    let same_key: Vec<String> = cols.iter().map(|c| format!("q.{c} = w.{c}")).collect();
    let read: Vec<String> = cols.iter().map(|c| format!("w.{c}::text")).collect();
    // A key's first claimable row, its key from the walk's columns (the template's); on a
    // FIFO table the group's head (its first unfinished row) when due and free, its key from
    // its own template columns.
    let (candidate, key, from) = if t.fifo() {
        let unf_q: String = t
            .unfinished_columns()
            .into_iter()
            .map(|c| format!(" AND q.{} IS NULL", ident(c)))
            .collect();
        (
            format!("CASE WHEN {} THEN q.{id}::int8 END", s.claimable_row),
            key_expr(template, "q", 3).0,
            format!(
                "sqlx_broker_keys AS w CROSS JOIN LATERAL (SELECT * FROM {tbl} AS q WHERE {}{unf_q} \
                 ORDER BY q.{id} LIMIT 1) AS q",
                same_key.join(" AND ")
            ),
        )
    } else {
        (
            format!(
                "(SELECT q.{id}::int8 FROM {tbl} AS q WHERE {} AND {} ORDER BY q.{id} LIMIT 1)",
                same_key.join(" AND "),
                s.claimable
            ),
            key_expr(template, "w", 3).0,
            "sqlx_broker_keys AS w".to_owned(),
        )
    };
    format!(
        "WITH RECURSIVE sqlx_broker_keys AS (\
         (SELECT {n_cols} FROM {tbl} AS n WHERE TRUE{not_null}{unf_n}{start} ORDER BY {n_cols} LIMIT 1) \
         UNION ALL SELECT {x_cols} FROM sqlx_broker_keys AS p, LATERAL (SELECT {n_cols} FROM {tbl} AS n \
         WHERE {n_tuple} > {p_tuple}{unf_n} ORDER BY {n_cols} LIMIT 1) AS x) \
         SELECT {read}, {candidate}, {key}, {held} FROM {from} LIMIT $2::int8",
        n_cols = listed("n"),
        x_cols = listed("x"),
        n_tuple = tuple("n"),
        p_tuple = tuple("p"),
        read = read.join(", "),
        held = held(&key),
    )
}

impl AdvisoryStrategy for PgAdvisory {
    type Db = Postgres;
    type KeyLock = KeyLock;

    async fn candidates(
        &self,
        limit: usize,
        skip: usize,
        now_ms: i64,
        position: Option<Position>,
    ) -> Result<Vec<Candidate>> {
        let began = std::time::Instant::now();
        let rows = retrying(|| async {
            let bind = |mut q: sqlx::query::Query<'static, Postgres, _>| {
                q = q
                    .bind(now_ms)
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX));
                for literal in &self.literals {
                    q = q.bind(literal.clone());
                }
                q.bind(i64::try_from(skip).unwrap_or(i64::MAX))
            };
            // Advisory mode needs a session of its own (it is refused behind a transaction-mode
            // pooler), so its statements are always prepared.
            let q = match (&self.candidates_from, position) {
                (Some(resume), Some(at)) => resume.query(true, at, bind),
                _ => bind(query(&self.candidates, true)),
            };
            on_warm(&self.warm, &self.pool, true, |c| Box::pin(q.fetch_all(c)))
                .await
                .map_err(Failed::new("candidates"))
        })
        .await
        .map_err(|e| e.on(self.table.name()))?;
        if skip == 0 {
            // Nothing due: kept connections go back to the pool until a read finds rows.
            self.warm.claimed(!rows.is_empty());
            self.stats.claimed(rows.len(), began.elapsed());
        }
        rows.iter()
            .map(|row| {
                Ok(Candidate {
                    id: row.try_get(0).map_err(self.err("candidates"))?,
                    key: row.try_get(1).map_err(self.err("candidates"))?,
                    held: row.try_get(2).map_err(self.err("candidates"))?,
                    due_ms: match row.len() > 3 {
                        true => row.try_get(3).map_err(self.err("candidates"))?,
                        false => None,
                    },
                })
            })
            .collect()
    }

    async fn walk_keys(
        &self,
        after: Option<&[String]>,
        limit: usize,
        now_ms: i64,
    ) -> Result<KeyWalk> {
        let Some([first, later]) = &self.walk else {
            return Ok(KeyWalk::default());
        };
        let sql = if after.is_some() { later } else { first };
        let rows = retrying(|| async {
            let mut q = query(sql, true)
                .bind(now_ms)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX));
            for literal in &self.literals {
                q = q.bind(literal.clone());
            }
            for v in after.unwrap_or_default() {
                q = q.bind(v.clone());
            }
            on_warm(&self.warm, &self.pool, true, |c| Box::pin(q.fetch_all(c)))
                .await
                .map_err(Failed::new("key walk"))
        })
        .await
        .map_err(|e| e.on(self.table.name()))?;
        let n = self.table.key_walk_columns().map_or(0, |c| c.len());
        let mut walk = KeyWalk {
            visited: rows.len(),
            ..KeyWalk::default()
        };
        for row in &rows {
            let values = (0..n)
                .map(|i| row.try_get::<String, _>(i))
                .collect::<Result<Vec<_>, _>>()
                .map_err(self.err("key walk"))?;
            let id: Option<i64> = row.try_get(n).map_err(self.err("key walk"))?;
            if let Some(id) = id {
                walk.candidates.push(Candidate {
                    id,
                    key: row.try_get(n + 1).map_err(self.err("key walk"))?,
                    held: row.try_get(n + 2).map_err(self.err("key walk"))?,
                    due_ms: None,
                });
            }
            walk.last = Some(values);
        }
        Ok(walk)
    }

    /// Tries the key's lock on a connection of its own (a kept one, else one from the pool);
    /// the connection is kept for the next try at once when another session holds the key.
    async fn try_lock(&self, key: &str) -> Result<Option<KeyLock>> {
        let conn = self
            .warm
            .acquire(&self.pool)
            .await
            .map_err(self.err("acquire"))?;
        let locked =
            SessionKeyLock::try_on(conn, &self.warm, key.to_owned(), key.to_owned(), TRY_LOCK)
                .await
                .map_err(self.err("try lock"))?;
        Ok(match locked {
            TryLocked::Locked(lock) => Some(lock),
            TryLocked::Held | TryLocked::Unknown => None,
        })
    }

    /// Takes the row on the lock's connection: counts the attempt and reads the row, only while
    /// it is still claimable and still has the locked key. On a FIFO table the take runs in a
    /// transaction that reads the row's group again once its guard is held, and takes nothing
    /// when the row is no longer the group's head (see `fifo::claim_checked`).
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
        let key = lock.key().to_owned();
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
            let taken = match &self.recheck {
                Some(recheck) => fifo::claim_checked(&mut *conn, q, recheck, true)
                    .await
                    .map(|rows| rows.and_then(|rows| rows.into_iter().next())),
                None => q.fetch_optional(&mut *conn).await,
            };
            match taken.map_err(Failed::new("take")) {
                Err(e) if e.is_transient() && tries < TRANSIENT_RETRIES => tries += 1,
                other => break other.map_err(|e| e.on(self.table.name())),
            }
        };
        lock.finished();
        row?.map(|row| crate::backend::claimed(row, Some(key)).map_err(self.err("take")))
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
        let table = self.table.name();
        let fence = Fence::Attempt(settle.attempt);
        let on_lock = async {
            let conn = lock.conn();
            let mut tries = 0;
            let first = loop {
                match run_settle(&self.settle, conn, true, settle, fence).await {
                    Err(e) if e.is_transient() && tries < TRANSIENT_RETRIES => tries += 1,
                    other => break other,
                }
            };
            lock.finished();
            first.map(|changed| changed == 1).map_err(|e| e.on(table))
        };
        settle_advisory(classify, table, settle.id, on_lock, || async {
            let mut conn = self
                .pool
                .acquire()
                .await
                .map_err(|e| Failed::new("acquire")(e).on(table))?;
            run_settle(&self.settle, &mut conn, true, settle, fence)
                .await
                .map(|changed| changed == 1)
                .map_err(|e| e.on(table))
        })
        .await
    }

    /// Unlocks and keeps the connection for the next try-lock (see `warm`); when the unlock
    /// fails, the connection is closed instead, which frees the key as well.
    async fn unlock(&self, lock: KeyLock) -> Result<()> {
        lock.unlock(&self.warm, self.table.name(), UNLOCK)
            .await
            .map_err(self.err("unlock"))
    }

    fn release_kept(&self) {
        self.warm.release();
    }

    fn kept(&self) -> usize {
        self.warm.len()
    }
}
