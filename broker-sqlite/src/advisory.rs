//! Advisory mode on SQLite: keys are held in this process (see [`crate::keys`]); the take counts
//! the attempt only while the row is still claimable.

use std::sync::Arc;

use broker_core::driver::{
    AdvisoryStrategy, Candidate, ClaimedRow, Fence, KeyWalk, Position, Settle,
    settle_advisory_on_pool,
};
use broker_core::{KeyTemplate, Result, SqlxBrokerError, TableDescription};
use sqlx::{Row, Sqlite, SqlitePool};

use crate::backend::{Warm, warm_conn, write_conn};
use crate::keys::{KeyLock, KeyTable};
use crate::sql::{
    SettleStatements, Statements, classify, ident, retrying, run_settle, settle_named,
};

/// The advisory strategy of one SQLite table.
#[derive(Debug)]
pub struct SqliteAdvisory {
    pool: SqlitePool,
    table: Arc<TableDescription>,
    keys: Arc<KeyTable>,
    template: KeyTemplate,
    candidates: String,
    /// The key walk from the first key, and from just after a key (see [`key_walk`]); `None`
    /// for a table without one.
    walk: Option<[String; 2]>,
    take: String,
    settle: SettleStatements,
    /// The connection of the last statement, kept for the next (see [`Warm`]).
    warm: Warm,
}

impl SqliteAdvisory {
    pub(crate) fn new(
        pool: SqlitePool,
        table: Arc<TableDescription>,
        template: &KeyTemplate,
        keys: Arc<KeyTable>,
    ) -> Self {
        let s = Statements::new(&table);
        let key_columns: Vec<String> = template
            .columns()
            .iter()
            .map(|c| format!("CAST({} AS TEXT)", ident(c)))
            .collect();
        // `+?2`, `+?3`: bound, a whole LIMIT or OFFSET would prepare the statement again on
        // every read (see the lease claim in `crate::lease`).
        let candidates = format!(
            "SELECT {id}, {keys} FROM {t} WHERE {claimable}{ungrouped} ORDER BY {order} LIMIT +?2 OFFSET +?3",
            id = s.id,
            keys = key_columns.join(", "),
            t = s.table,
            claimable = s.claimable,
            // On a FIFO table only rows without a group (the claim index holds only those;
            // grouped rows come through the walk of the groups).
            ungrouped = table
                .group()
                .filter(|_| table.fifo())
                .map(|g| format!(" AND {} IS NULL", ident(g)))
                .unwrap_or_default(),
            order = s.order,
        );
        let take = format!(
            "UPDATE {t} SET {a} = {a} + 1 WHERE {id} = ?2 AND {claimable} RETURNING {ret}",
            t = s.table,
            a = s.attempt,
            id = s.id,
            claimable = s.claimable,
            ret = s.claimed_columns(true),
        );
        let settle = s.settle(&table, &format!(" AND {} = ?3", s.attempt));
        let walk = table
            .key_walk_columns()
            .map(|cols| [false, true].map(|after| key_walk(&s, &table, &cols, after)));
        Self {
            warm: Warm::for_pool(&pool),
            pool,
            table,
            keys,
            template: template.clone(),
            candidates,
            walk,
            take,
            settle,
        }
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![
            ("candidates", self.candidates.as_str()),
            ("take", self.take.as_str()),
        ];
        if let Some([first, after]) = &self.walk {
            out.extend([
                ("key walk", first.as_str()),
                ("key walk after", after.as_str()),
            ]);
        }
        out.extend(settle_named(&self.settle));
        out
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }
}

/// The key walk of an advisory table (see [`AdvisoryStrategy::walk_keys`]): a recursive
/// statement whose every step probes the key index (the key columns, id; over unfinished rows;
/// on a FIFO table the group index) for the first row of the next key or group, at most once
/// per column, from the first or (`after`) from just after the one bound from `?3` on, up to
/// `?2`; for each, its columns as text, its candidate (the key's first claimable row by id, or
/// the group's head when it is due and free; NULL for none) and the template columns of the
/// row walked to. Keys with a NULL column are not visited. A step names the row it stopped on by id, because a SQLite scalar subquery yields
/// one column; the bounded walk is then joined back to read the key.
fn key_walk(s: &Statements, t: &TableDescription, columns: &[&str], after: bool) -> String {
    let (tbl, id) = (&s.table, &s.id);
    let cols: Vec<String> = columns.iter().map(|c| ident(c)).collect();
    let tuple = |alias: &str| {
        let list: Vec<String> = cols.iter().map(|c| format!("{alias}.{c}")).collect();
        format!("({})", list.join(", "))
    };
    let order_n: Vec<String> = cols.iter().map(|c| format!("n.{c}")).collect();
    let order_n = format!("{}, n.{id}", order_n.join(", "));
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
        let params: Vec<String> = (0..cols.len()).map(|i| format!("?{}", i + 3)).collect();
        format!(" AND {} > ({})", tuple("n"), params.join(", "))
    } else {
        String::new()
    };
    // The next key after row p's: SQLite 3.51 reads `(n.a, n.b) > (p.a, p.b)` with p a
    // column of the same step as the range `n.a >= p.a` only, passing every row of p's key
    // (0.7 ms a step past 10,000 rows), so each column gets a seek of its own, the last column
    // first: same earlier columns and a greater one here.
    let seeks: Vec<String> = (0..cols.len())
        .rev()
        .map(|i| {
            let mut conds: Vec<String> =
                cols[..i].iter().map(|c| format!("n.{c} = p.{c}")).collect();
            conds.push(format!("n.{c} > p.{c}", c = cols[i]));
            format!(
                "(SELECT n.{id} FROM {tbl} AS n WHERE {}{unf_n} ORDER BY {order_n} LIMIT 1)",
                conds.join(" AND ")
            )
        })
        .collect();
    let next = if seeks.len() == 1 {
        seeks[0].clone()
    } else {
        format!("COALESCE({})", seeks.join(", "))
    };
    // A key's first claimable row; a group's head (the walk's row: the first unfinished one
    // of the group in the group index) only when it is due and free.
    let probe = if t.fifo() {
        format!(
            "(SELECT CASE WHEN {} THEN h.{id} END FROM {tbl} AS h WHERE h.{id} = p.{id})",
            s.claimable_row
        )
    } else {
        let same_key: Vec<String> = cols.iter().map(|c| format!("h.{c} = p.{c}")).collect();
        format!(
            "(SELECT h.{id} FROM {tbl} AS h WHERE {} AND {} ORDER BY h.{id} LIMIT 1)",
            same_key.join(" AND "),
            s.claimable
        )
    };
    let mut read: Vec<String> = cols
        .iter()
        .map(|c| format!("CAST(p.{c} AS TEXT)"))
        .collect();
    read.push(probe);
    // The key is rendered from the row's own template columns.
    if let Some(template) = t.advisory_lock() {
        read.extend(
            template
                .columns()
                .iter()
                .map(|c| format!("CAST(p.{} AS TEXT)", ident(c))),
        );
    }
    // CROSS JOIN keeps the walk the outer loop: SQLite 3.51 otherwise scanned the whole key
    // index and looked each row up in the walk (7.8 ms against 0.7 ms).
    format!(
        "WITH RECURSIVE sqlx_broker_keys (id, n) AS (\
         SELECT (SELECT n.{id} FROM {tbl} AS n WHERE 1 = 1{not_null}{unf_n}{start} ORDER BY {order_n} LIMIT 1), 1 \
         UNION ALL SELECT (SELECT {next} FROM {tbl} AS p WHERE p.{id} = w.id), w.n + 1 \
         FROM sqlx_broker_keys AS w WHERE w.id IS NOT NULL AND w.n < ?2) \
         SELECT {read} FROM sqlx_broker_keys AS w CROSS JOIN {tbl} AS p ON p.{id} = w.id ORDER BY w.n",
        read = read.join(", "),
    )
}

impl AdvisoryStrategy for SqliteAdvisory {
    type Db = Sqlite;
    type KeyLock = KeyLock;

    async fn candidates(
        &self,
        limit: usize,
        skip: usize,
        now_ms: i64,
        _from: Option<Position>,
    ) -> Result<Vec<Candidate>> {
        let rows = retrying(|| async {
            let q = sqlx::query(sqlx::AssertSqlSafe(self.candidates.clone()))
                .bind(now_ms)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .bind(i64::try_from(skip).unwrap_or(i64::MAX));
            let mut conn = warm_conn(&self.warm, &self.pool, self.table.name()).await?;
            let rows = q.fetch_all(&mut *conn).await;
            self.warm.keep_if(conn, rows.is_ok());
            rows.map_err(self.err("candidates"))
        })
        .await?;
        if skip == 0 {
            // Nothing due: kept connections go back to the pool until a read finds rows.
            self.warm.claimed(!rows.is_empty());
        }
        rows.iter()
            .map(|row| {
                let id: i64 = row.try_get(0).map_err(self.err("candidates"))?;
                let values = (1..row.len())
                    .map(|i| row.try_get::<Option<String>, _>(i))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(self.err("candidates"))?;
                Ok(Candidate {
                    id,
                    key: self.template.render(&values),
                    held: false,
                    due_ms: None,
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
            let mut q = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .bind(now_ms)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX));
            for v in after.unwrap_or_default() {
                q = q.bind(v.as_str());
            }
            let mut conn = warm_conn(&self.warm, &self.pool, self.table.name()).await?;
            let rows = q.fetch_all(&mut *conn).await;
            self.warm.keep_if(conn, rows.is_ok());
            rows.map_err(self.err("key walk"))
        })
        .await?;
        let n = self.table.key_walk_columns().map_or(0, |c| c.len());
        KeyWalk::read(&rows, n, &self.template).map_err(self.err("key walk"))
    }

    async fn try_lock(&self, key: &str) -> Result<Option<KeyLock>> {
        Ok(self.keys.try_lock(key))
    }

    async fn take(
        &self,
        lock: &mut KeyLock,
        id: i64,
        now_ms: i64,
    ) -> Result<Option<ClaimedRow<Sqlite>>> {
        let row = retrying(|| async {
            let q = sqlx::query(sqlx::AssertSqlSafe(self.take.clone()))
                .bind(now_ms)
                .bind(id);
            let (mut conn, turn) =
                write_conn(&self.warm, &self.pool, &self.keys, self.table.name()).await?;
            let row = q.fetch_optional(&mut *conn).await;
            drop(turn);
            self.warm.keep_if(conn, row.is_ok());
            row.map_err(self.err("take"))
        })
        .await?;
        row.map(|row| crate::backend::claimed(&self.table, row, Some(lock.key().to_owned())))
            .transpose()
    }

    async fn settle(&self, _lock: &mut KeyLock, settle: Settle) -> Result<()> {
        // The key is held in this process until the delivery unlocks it, so no other claim can
        // take the row meanwhile; the deadline only bounds how long a lost database file is
        // waited for (as on the other backends).
        let table = self.table.name();
        settle_advisory_on_pool(classify, table, settle.id, || async {
            let changed = run_settle(
                &self.settle,
                &self.warm,
                &self.pool,
                &self.keys,
                table,
                settle,
                Fence::Attempt(settle.attempt),
            )
            .await?;
            Ok(changed == 1)
        })
        .await
    }

    async fn unlock(&self, lock: KeyLock) -> Result<()> {
        drop(lock);
        Ok(())
    }

    fn release_kept(&self) {
        self.warm.release();
    }

    fn kept(&self) -> usize {
        self.warm.len()
    }
}
