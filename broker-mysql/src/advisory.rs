//! Advisory mode on MySQL and MariaDB: `GET_LOCK(name, 0)` on a pool connection of its own per
//! key. The connection follows the delivery (the take and the settlement run on it) and
//! `RELEASE_LOCK` frees the key before it goes back to the pool. A key lock dropped without
//! unlocking closes its connection instead, so the server ends the session and frees the key:
//! a connection never returns to the pool holding a lock (`GET_LOCK` is re-entrant within a
//! session, so a pooled connection that still held a key would let this process take it twice).
//!
//! # Lock names
//! Keys belong to the database, not the table: a key is locked under `"<database>:<key>"`. MySQL
//! allows 64 characters in a lock name and converts it to utf8mb3; MariaDB allows 192 bytes. A
//! name longer than 64 characters, or holding a character outside the Basic Multilingual Plane
//! (four UTF-8 bytes, which utf8mb3 cannot hold), is replaced by the lowercase hex SHA-256 of
//! its UTF-8 bytes: 64 characters, the same in every process. Characters are counted as Rust
//! `char`s (Unicode scalar values), which is how MySQL counts utf8mb4 characters; every name
//! kept as is is then at most 64 characters of at most 3 bytes, within both servers' limits. A
//! kept name always holds a `:` and a hash never does, so the two never collide.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use broker_core::driver::{
    AdvisoryStrategy, Candidate, ClaimedRow, Fence, KeyWalk, LockStatement, Position,
    SessionKeyLock, Settle, TryLocked, WarmConnections, settle_advisory,
};
use broker_core::{KeyTemplate, Result, SqlxBrokerError, TableDescription};
use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, MySql, MySqlConnection, MySqlPool, Row};

use crate::backend::{Conn, claimed};
use crate::fifo::{self, Guard};
use crate::sql::{
    Args, P, SettleStatements, Sql, Statements, Stmt, begin_sql, classify, ident, run_settle,
    settle_named,
};

/// The longest lock name, in characters, that both servers take as it is.
pub const MAX_LOCK_NAME_CHARS: usize = 64;

/// The name a key is locked under in `database`: `"<database>:<key>"`, or its SHA-256 in hex
/// when that is longer than 64 characters or holds a character outside the Basic Multilingual
/// Plane (see the [module docs](crate#advisory-lock-names)).
///
/// ```
/// assert_eq!(broker_mysql::lock_name("shop", "account-7"), "shop:account-7");
/// assert_eq!(broker_mysql::lock_name("shop", &"x".repeat(100)).len(), 64);
/// ```
pub fn lock_name(database: &str, key: &str) -> String {
    let name = format!("{database}:{key}");
    let fits =
        name.chars().count() <= MAX_LOCK_NAME_CHARS && name.chars().all(|c| u32::from(c) <= 0xFFFF);
    if fits {
        return name;
    }
    Sha256::digest(name.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// How many lock names one pre-filter statement probes (unused slots bind NULL), so the statement
/// text never changes and stays prepared.
const PROBES: usize = 16;

/// Takes a key's lock name without waiting: 1 when taken, 0 when another session holds it,
/// NULL on an error inside `GET_LOCK`.
const GET_LOCK: LockStatement<Option<i64>> = LockStatement {
    sql: "SELECT CAST(GET_LOCK(?, 0) AS SIGNED)",
    read: returned_one,
};
/// Frees a lock name: 1 when this session held it (0: another session does; NULL: nobody).
const RELEASE_LOCK: LockStatement<Option<i64>> = LockStatement {
    sql: "SELECT CAST(RELEASE_LOCK(?) AS SIGNED)",
    read: returned_one,
};

/// Whether a lock function returned 1; `None` for NULL.
fn returned_one(got: Option<i64>) -> Option<bool> {
    got.map(|got| got == 1)
}

/// A held key: a pool connection of its own that holds `GET_LOCK` on the key's lock name
/// ([`lock_name`]). Dropping it without unlocking closes the connection (the session ends and
/// the server frees the key); it never goes back to the pool holding the lock.
type KeyLock = SessionKeyLock<MySql>;

/// How a row is taken under its key.
#[derive(Debug)]
enum Take {
    /// Read the row where it is still claimable, then count the attempt (under the same
    /// condition). Reading first means a read that fails (a renamed column, a value that does
    /// not convert) changes nothing: the take's update autocommits, so counting first spent an
    /// attempt for every failed read and dead-lettered rows whose handler never ran.
    Update { update: Stmt, read: Stmt },
    /// FIFO tables: in one transaction, re-read the row under a lock (with the head condition),
    /// run the group guard, count the attempt. MySQL refuses the head subquery inside an
    /// `UPDATE` of the same table (error 1093).
    Locked {
        begin: Arc<str>,
        read: Stmt,
        guard: Stmt,
        count: Stmt,
    },
}

/// The advisory strategy of one MySQL / MariaDB table.
#[derive(Debug)]
pub struct MySqlAdvisory {
    pool: MySqlPool,
    table: Arc<TableDescription>,
    database: String,
    template: KeyTemplate,
    candidates: Stmt,
    /// The key walk from the first key, and from just after a key (see [`key_walk`]); `None`
    /// for a table without one.
    walk: Option<[Stmt; 2]>,
    probe: Arc<str>,
    take: Take,
    settle: SettleStatements,
    /// Connections whose key was released (or whose `GET_LOCK` found the key held), kept for
    /// the next candidate read or `GET_LOCK`: a pool acquire tests the connection with a round
    /// trip of its own, one more per row than a hand-written loop that keeps its connection.
    warm: WarmConnections<PoolConnection<MySql>>,
}

impl MySqlAdvisory {
    pub(crate) fn new(
        pool: MySqlPool,
        table: Arc<TableDescription>,
        template: &KeyTemplate,
        database: String,
        group_index: Option<&str>,
    ) -> Self {
        let s = Statements::new(&table);
        let key_columns: Vec<String> = template
            .columns()
            .iter()
            .map(|c| format!("CAST({}.{} AS CHAR)", s.table, ident(c)))
            .collect();
        let candidates = Sql::new(format!(
            "SELECT CAST({} AS SIGNED), {} FROM {} WHERE ",
            s.id,
            key_columns.join(", "),
            s.table
        ))
        .append(&s.claimable)
        // On a FIFO table only rows without a group (the claim index leads with the group;
        // grouped rows come through the walk of the groups).
        .push(
            &table
                .group()
                .filter(|_| table.fifo())
                .map(|g| format!(" AND {}.{} IS NULL", s.table, ident(g)))
                .unwrap_or_default(),
        )
        .push(&format!(" ORDER BY {} LIMIT ", s.order))
        .param(P::Limit)
        .push(" OFFSET ")
        .param(P::Skip)
        .stmt("candidates");
        let walk = table
            .key_walk_columns()
            .map(|cols| [false, true].map(|after| key_walk(&s, &table, &cols, after)));
        let probe = format!(
            "SELECT {}",
            vec!["CAST(IS_FREE_LOCK(?) AS SIGNED)"; PROBES].join(", ")
        )
        .into();
        let by_id = Sql::new(format!(" WHERE {} = ", s.id)).param(P::Id);
        // The row as a claim hands it out, if it is still claimable.
        let read = Sql::new(format!(
            "SELECT {} FROM {}",
            s.claimed_columns(false),
            s.table
        ))
        .append(&by_id)
        .push(" AND ")
        .append(&s.claimable);
        let take = match fifo::guard(&table, group_index) {
            None => Take::Update {
                update: Sql::new(format!(
                    "UPDATE {t} SET {a} = {a} + 1",
                    t = s.table,
                    a = s.attempt
                ))
                .append(&by_id)
                .push(" AND ")
                .append(&s.claimable)
                .stmt("take"),
                read: read.stmt("take read"),
            },
            Some(guard) => Take::Locked {
                begin: begin_sql(&table),
                // -- needs NOWAIT: MySQL 8.0.1, MariaDB 10.3
                read: read.push(" FOR UPDATE NOWAIT").stmt("take"),
                guard,
                count: Sql::new(format!(
                    "UPDATE {t} SET {a} = {a} + 1",
                    t = s.table,
                    a = s.attempt
                ))
                .append(&by_id)
                .stmt("take count"),
            },
        };
        // The key lock keeps other claims out; the fence on the attempt the take wrote keeps out a
        // settlement from a delivery whose key went away under it (its connection was killed, or
        // a dropped future's statement landed late) after the row was taken again.
        let fence = Sql::new(format!(" AND {} = ", s.attempt)).param(P::HeldAttempt);
        let settle = s.settle(&table, &fence, false, "");
        Self {
            warm: WarmConnections::for_pool(&pool),
            pool,
            table,
            database,
            template: template.clone(),
            candidates,
            walk,
            probe,
            take,
            settle,
        }
    }

    /// A kept connection (see `warm`), else one from the pool.
    async fn conn(&self) -> Result<Conn> {
        Conn::from_warm(&self.warm, &self.pool, self.table.name()).await
    }

    /// Keeps `conn` for the next statement when `out` went well (see [`Conn::done_into`]).
    fn done<T>(&self, conn: Conn, out: &Result<T>) {
        conn.done_into(&self.warm, out.is_ok());
    }

    /// Every statement the strategy runs, by name, so prepare can check each one against the
    /// table.
    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![&self.candidates];
        out.extend(self.walk.iter().flatten());
        match &self.take {
            Take::Update { update, read } => out.extend([update, read]),
            Take::Locked {
                read, guard, count, ..
            } => out.extend([read, guard, count]),
        }
        out.extend(settle_named(&self.settle));
        out.into_iter().map(Stmt::named).collect()
    }

    fn err(&self, name: &'static str) -> impl Fn(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }

    /// One window of candidates after `skip`, those whose keys another session holds marked
    /// held.
    async fn candidates_on(
        &self,
        conn: &mut MySqlConnection,
        limit: usize,
        skip: usize,
        now_ms: i64,
    ) -> Result<Vec<Candidate>> {
        let args = Args {
            now_ms,
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            skip: i64::try_from(skip).unwrap_or(i64::MAX),
            ..Args::default()
        };
        let rows = self
            .candidates
            .bind(&args)
            .fetch_all(&mut *conn)
            .await
            .map_err(self.err("candidates"))?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.try_get(0).map_err(self.err("candidates"))?;
            let values = (1..row.len())
                .map(|i| row.try_get::<Option<String>, _>(i))
                .collect::<Result<Vec<_>, _>>()
                .map_err(self.err("candidates"))?;
            out.push(Candidate {
                id,
                key: self.template.render(&values),
                held: false,
                due_ms: None,
            });
        }
        self.mark_held(conn, &mut out).await?;
        Ok(out)
    }

    /// Marks the candidates whose keys another session holds, in one statement per 16 keys,
    /// so that each does not spend a pool connection on a GET_LOCK that fails. A key freed or
    /// taken in between is caught by the GET_LOCK itself.
    async fn mark_held(&self, conn: &mut MySqlConnection, out: &mut [Candidate]) -> Result<()> {
        let mut names: HashMap<&str, String> = HashMap::new();
        for c in out.iter() {
            names
                .entry(c.key.as_str())
                .or_insert_with(|| lock_name(&self.database, &c.key));
        }
        let names: Vec<(&str, String)> = names.into_iter().collect();
        let mut held: HashSet<String> = HashSet::new();
        for chunk in names.chunks(PROBES) {
            let mut q = sqlx::query(sqlx::AssertSqlSafe(self.probe.clone()));
            for i in 0..PROBES {
                q = q.bind(chunk.get(i).map(|(_, name)| name.as_str()));
            }
            let row = q
                .fetch_one(&mut *conn)
                .await
                .map_err(self.err("key probe"))?;
            for (i, (key, _)) in chunk.iter().enumerate() {
                let free: Option<i64> = row.try_get(i).map_err(self.err("key probe"))?;
                if free == Some(0) {
                    held.insert((*key).to_owned());
                }
            }
        }
        for c in out.iter_mut() {
            c.held = held.contains(&c.key);
        }
        Ok(())
    }

    async fn walk_keys_on(
        &self,
        conn: &mut MySqlConnection,
        after: Option<&[String]>,
        limit: usize,
        now_ms: i64,
    ) -> Result<KeyWalk> {
        let Some([first, later]) = &self.walk else {
            return Ok(KeyWalk::default());
        };
        let (stmt, key_after) = match after {
            Some(a) => (later, a),
            None => (first, &[][..]),
        };
        let args = Args {
            now_ms,
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            key_after,
            ..Args::default()
        };
        let rows = stmt
            .bind(&args)
            .fetch_all(&mut *conn)
            .await
            .map_err(self.err("key walk"))?;
        let n = self.table.key_walk_columns().map_or(0, |c| c.len());
        let mut walk = KeyWalk::read(&rows, n, &self.template).map_err(self.err("key walk"))?;
        self.mark_held(conn, &mut walk.candidates).await?;
        Ok(walk)
    }

    async fn take_on(
        &self,
        conn: &mut MySqlConnection,
        key: String,
        id: i64,
        now_ms: i64,
    ) -> Result<Option<ClaimedRow<MySql>>> {
        let name = self.table.name();
        let args = Args {
            id,
            now_ms,
            ..Args::default()
        };
        match &self.take {
            Take::Update { update, read } => {
                let Some(row) = read
                    .bind(&args)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(self.err(read.name))?
                else {
                    return Ok(None);
                };
                let row = claimed(&self.table, row, Some(key))?;
                // The key lock keeps every other taker off the row, so the row read is the row
                // counted; the condition repeats in case a settlement landed in between.
                let done = update
                    .bind(&args)
                    .execute(&mut *conn)
                    .await
                    .map_err(self.err(update.name))?;
                Ok((done.rows_affected() == 1).then_some(row))
            }
            Take::Locked {
                begin,
                read,
                guard,
                count,
            } => {
                let mut tx = conn
                    .begin_with(sqlx::AssertSqlSafe(begin.clone()))
                    .await
                    .map_err(self.err("begin"))?;
                let row = match read.bind(&args).fetch_optional(&mut *tx).await {
                    Ok(Some(row)) => claimed(&self.table, row, Some(key))?,
                    Ok(None) => {
                        tx.rollback().await.map_err(self.err("rollback"))?;
                        return Ok(None);
                    }
                    Err(e) if fifo::is_busy(&e) => {
                        tx.rollback().await.map_err(self.err("rollback"))?;
                        return Ok(None);
                    }
                    Err(e) => return Err(self.err(read.name)(e)),
                };
                if fifo::check(&mut tx, guard, name, &row.row, id).await? == Guard::Behind {
                    tracing::debug!(table = name, id, "fifo guard: not the group's head now");
                    tx.rollback().await.map_err(self.err("rollback"))?;
                    return Ok(None);
                }
                count
                    .bind(&args)
                    .execute(&mut *tx)
                    .await
                    .map_err(self.err(count.name))?;
                tx.commit().await.map_err(self.err("commit"))?;
                Ok(Some(row))
            }
        }
    }
}

/// The key walk of an advisory table (see [`AdvisoryStrategy::walk_keys`]): the next keys after
/// the bound one (or from the first), at most `LIMIT` of them, read as a loose index scan of the
/// key index (`GROUP BY` over its leading columns: one probe per key, however many rows it
/// holds), and for each its first claimable row by id through the same index. Keys with a NULL
/// column are not visited. "After" is written out column by column (`c1 > ? OR (c1 = ? AND c2 >
/// ?)`), which both servers read as ranges of the index. There are no partial indexes here, so
/// a table that keeps its acked rows (`processed_at`) passes keys whose rows are all finished.
/// The key template's columns of `t`, each read as text from the table (or alias) `from`, in
/// template order: what the core renders the key from.
fn template_as_text(t: &TableDescription, from: &str) -> Vec<String> {
    t.advisory_lock()
        .map(|k| k.columns())
        .unwrap_or_default()
        .iter()
        .map(|c| format!("CAST({from}.{} AS CHAR)", ident(c)))
        .collect()
}

fn key_walk(s: &Statements, t: &TableDescription, columns: &[&str], after: bool) -> Stmt {
    let cols: Vec<String> = columns.iter().map(|c| ident(c)).collect();
    let fifo = t.fifo();
    let listed = |alias: &str| {
        cols.iter()
            .map(|c| format!("{alias}.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // A FIFO table walks the group index (group, unfinished columns, id) and reads each
    // group's head as its least unfinished id.
    let mut conditions: Vec<String> = cols.iter().map(|c| format!("n.{c} IS NOT NULL")).collect();
    if fifo {
        conditions.extend(
            t.unfinished_columns()
                .into_iter()
                .map(|c| format!("n.{} IS NULL", ident(c))),
        );
    }
    let mut inner = Sql::new(format!(
        "SELECT {}{} FROM {} AS n WHERE {}",
        listed("n"),
        if fifo {
            format!(", MIN(n.{}) AS sqlx_broker_head", ident(t.id()))
        } else {
            String::new()
        },
        s.table,
        conditions.join(" AND ")
    ));
    if after {
        inner = inner.push(" AND (");
        for (i, c) in cols.iter().enumerate() {
            if i > 0 {
                inner = inner.push(" OR ");
            }
            inner = inner.push("(");
            for (j, earlier) in cols[..i].iter().enumerate() {
                inner = inner
                    .push(&format!("n.{earlier} = "))
                    .param(P::KeyAfter(j))
                    .push(" AND ");
            }
            inner = inner
                .push(&format!("n.{c} > "))
                .param(P::KeyAfter(i))
                .push(")");
        }
        inner = inner.push(")");
    }
    let inner = inner
        .push(&format!(
            " GROUP BY {g} ORDER BY {g} LIMIT ",
            g = listed("n")
        ))
        .param(P::Limit);
    let read: Vec<String> = cols
        .iter()
        .map(|c| format!("CAST(w.{c} AS CHAR)"))
        .collect();
    // The key is rendered from the template columns of the row the candidate is in.
    let template = template_as_text(t, &s.table);
    if fifo {
        // The head is the candidate when it is due and free.
        return Sql::new(format!("SELECT {}, CASE WHEN ", read.join(", ")))
            .append(&s.claimable_row)
            .push(&format!(
                " THEN CAST({} AS SIGNED) END, {} FROM (",
                s.id,
                template.join(", ")
            ))
            .append(&inner)
            .push(&format!(
                ") AS w STRAIGHT_JOIN {t} ON {id} = w.sqlx_broker_head ORDER BY {}",
                listed("w"),
                t = s.table,
                id = s.id
            ))
            .stmt(if after { "key walk after" } else { "key walk" });
    }
    let same_key: Vec<String> = cols
        .iter()
        .map(|c| format!("{}.{c} = w.{c}", s.table))
        .collect();
    let first_row = template_as_text(t, "w");
    Sql::new(format!(
        "SELECT {}, (SELECT CAST({} AS SIGNED) FROM {} WHERE {} AND ",
        read.join(", "),
        s.id,
        s.table,
        same_key.join(" AND ")
    ))
    .append(&s.claimable)
    .push(&format!(
        " ORDER BY {} LIMIT 1), {} FROM (",
        s.id,
        first_row.join(", ")
    ))
    .append(&inner)
    .push(&format!(") AS w ORDER BY {}", listed("w")))
    .stmt(if after { "key walk after" } else { "key walk" })
}

impl AdvisoryStrategy for MySqlAdvisory {
    type Db = MySql;
    type KeyLock = KeyLock;

    async fn candidates(
        &self,
        limit: usize,
        skip: usize,
        now_ms: i64,
        _from: Option<Position>,
    ) -> Result<Vec<Candidate>> {
        let mut conn = self.conn().await?;
        let out = self.candidates_on(&mut conn, limit, skip, now_ms).await;
        self.done(conn, &out);
        if let (Ok(rows), 0) = (&out, skip) {
            // Nothing due: kept connections go back to the pool until a read finds rows.
            self.warm.claimed(!rows.is_empty());
        }
        out
    }

    async fn walk_keys(
        &self,
        after: Option<&[String]>,
        limit: usize,
        now_ms: i64,
    ) -> Result<KeyWalk> {
        let mut conn = self.conn().await?;
        let out = self.walk_keys_on(&mut conn, after, limit, now_ms).await;
        self.done(conn, &out);
        out
    }

    async fn try_lock(&self, key: &str) -> Result<Option<KeyLock>> {
        let name = lock_name(&self.database, key);
        let conn = self.conn().await?.into_inner();
        let got = SessionKeyLock::try_on(conn, &self.warm, key.to_owned(), name.clone(), GET_LOCK)
            .await
            .map_err(self.err("lock"))?;
        match got {
            TryLocked::Locked(lock) => Ok(Some(lock)),
            TryLocked::Held => Ok(None),
            // NULL: an error inside GET_LOCK; the session may hold nothing useful.
            TryLocked::Unknown => Err(SqlxBrokerError::Invariant {
                table: self.table.name().to_owned(),
                statement: "lock",
                what: format!("GET_LOCK({name:?}) returned NULL"),
            }),
        }
    }

    async fn take(
        &self,
        lock: &mut KeyLock,
        id: i64,
        now_ms: i64,
    ) -> Result<Option<ClaimedRow<MySql>>> {
        let key = lock.key().to_owned();
        let out = self.take_on(lock.conn(), key, id, now_ms).await;
        lock.finished();
        out
    }

    async fn settle(&self, lock: &mut KeyLock, settle: Settle) -> Result<()> {
        let table = self.table.name();
        let fence = Fence::Attempt(settle.attempt);
        let on_lock = async {
            let out = run_settle(&self.settle, lock.conn(), table, settle, fence, false).await;
            lock.finished();
            out
        };
        settle_advisory(classify, table, settle.id, on_lock, || async {
            let mut conn = Conn::acquire(&self.pool, table).await?;
            let out = run_settle(&self.settle, &mut conn, table, settle, fence, false).await;
            conn.finish();
            out
        })
        .await
    }

    async fn unlock(&self, lock: KeyLock) -> Result<()> {
        let key = lock.key().to_owned();
        let released = lock
            .unlock(&self.warm, self.table.name(), RELEASE_LOCK)
            .await;
        if let Err(e) = released {
            // The connection is closed, so the session cannot keep the key: report it without
            // failing the settlement that came before.
            tracing::warn!(
                table = self.table.name(),
                key,
                error = %e,
                "RELEASE_LOCK failed; closing its connection instead"
            );
        }
        Ok(())
    }

    fn release_kept(&self) {
        self.warm.release();
    }

    fn kept(&self) -> usize {
        self.warm.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_name_of_exactly_64_characters_is_kept() {
        let key = "k".repeat(64 - "db:".len());
        let name = lock_name("db", &key);
        assert_eq!(name, format!("db:{key}"));
        assert_eq!(name.chars().count(), 64);
    }

    #[test]
    fn a_lock_name_of_65_characters_is_hashed() {
        let key = "k".repeat(65 - "db:".len());
        let name = lock_name("db", &key);
        assert_eq!(name.len(), 64);
        assert!(
            name.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert!(!name.contains(':'));
        // SHA-256 of the UTF-8 bytes, as `SELECT SHA2(name, 256)` computes it.
        let expected: String = Sha256::digest(format!("db:{key}").as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(name, expected);
        assert_eq!(lock_name("db", &key), name, "the same in every call");
    }

    #[test]
    fn multi_byte_characters_count_as_characters_not_bytes() {
        // 64 characters of two and three bytes each: 191 bytes, still kept.
        let key = format!("{}{}", "é".repeat(30), "€".repeat(31));
        let name = lock_name("db", &key);
        assert_eq!(name.chars().count(), 64);
        assert_eq!(name, format!("db:{key}"));
        // One more character is over the limit.
        assert_eq!(lock_name("db", &format!("{key}é")).len(), 64);
        assert!(!lock_name("db", &format!("{key}é")).contains(':'));
    }

    #[test]
    fn a_character_outside_the_bmp_is_hashed_even_in_a_short_name() {
        let name = lock_name("db", "party-🎉");
        assert_eq!(name.len(), 64);
        assert!(!name.contains(':'));
        assert_eq!(lock_name("db", "party-é"), "db:party-é");
    }

    #[test]
    fn keys_belong_to_the_database() {
        assert_ne!(lock_name("a", "k"), lock_name("b", "k"));
    }
}
