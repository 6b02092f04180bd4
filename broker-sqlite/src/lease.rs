//! Lease mode on SQLite: one `UPDATE .. RETURNING` claims, writing the expiry and counting the
//! attempt; settlements and renewals are fenced on the token (expiry and attempt).

use std::sync::Arc;

use broker_core::driver::retry::LEASE_MARGIN_MS;
use broker_core::driver::{
    ClaimedRow, Fence, GroupCursor, LeaseStrategy, LeaseToken, Position, Settle,
};
use broker_core::{Result, SqlxBrokerError, TableDescription};
use sqlx::{Row, Sqlite, SqlitePool};

use crate::backend::{Warm, write_conn};
use crate::keys::KeyTable;
use crate::sql::{
    SettleStatements, Statements, ident, retrying, run_settle, settle_named, settle_retrying,
};

/// The lease strategy of one SQLite table.
#[derive(Debug)]
pub struct SqliteLease {
    pool: SqlitePool,
    table: Arc<TableDescription>,
    /// The file's shared state: writes take turns through it.
    file: Arc<KeyTable>,
    claim: String,
    /// FIFO tables: where the next claim starts its visit of the groups.
    cursor: Option<GroupCursor>,
    renew: String,
    settle: SettleStatements,
    /// The ack of many rows up to its id lists (see [`SqliteLease::ack_many_sql`]).
    ack_many_head: String,
    /// What the ack of many rows returns, and the row value its fence compares.
    ack_many_row: (String, String),
    /// The ack of two rows, for prepare's check.
    ack_two: String,
    /// The connection of the last claim or ack, kept for the next (see [`Warm`]).
    warm: Warm,
}

impl SqliteLease {
    pub(crate) fn new(
        pool: SqlitePool,
        table: Arc<TableDescription>,
        locked_until: &str,
        file: Arc<KeyTable>,
    ) -> Self {
        let s = Statements::new(&table);
        let lu = ident(locked_until);
        // Rows come back from RETURNING in no particular order; the engine does not rely on it.
        // $1 now, $2 expiry, $3 limit; FIFO: $4 the group cursor. The limit is written `+?3`, an
        // expression, not a bare parameter: SQLite 3.51 (the one sqlx bundles; not 3.40) lets
        // the planner read a parameter that is a whole `LIMIT` and then marks the statement to
        // be prepared again whenever that parameter is bound, so every claim through the cached
        // statement prepared it again (the FIFO walk 116 µs a claim against 5 µs with `+?3`,
        // measured in Python's sqlite3 on SQLite 3.51.3).
        let picked = match table.group().filter(|_| table.fifo()) {
            Some(group) => crate::fifo::head_candidates(&s, &table, group, "+?3", "?4"),
            None => format!(
                "SELECT {id} FROM {t} WHERE {claimable} ORDER BY {order} LIMIT +?3",
                t = s.table,
                id = s.id,
                claimable = s.claimable,
                order = s.order,
            ),
        };
        let cursor = table
            .group()
            .filter(|_| table.fifo())
            .map(|_| GroupCursor::default());
        let claim = format!(
            "UPDATE {t} SET {lu} = ?2, {a} = {a} + 1 WHERE {id} IN ({picked}) RETURNING {ret}",
            t = s.table,
            a = s.attempt,
            id = s.id,
            ret = s.claimed_columns(true),
        );
        // The row may hold the new expiry already: a renewal run again after a lost reply finds
        // its own first try landed.
        let renew = format!(
            "UPDATE {t} SET {lu} = ?1 WHERE {id} = ?2 AND {lu} IN (?3, ?1) AND {a} = ?4",
            t = s.table,
            id = s.id,
            a = s.attempt,
        );
        let fence = format!(" AND {lu} = ?3 AND {} = ?4", s.attempt);
        let settle = s.settle(&table, &fence);
        let ack_many_head = match table.processed_at() {
            Some(c) => format!(
                "UPDATE {t} SET {} = ?1, {lu} = NULL WHERE ",
                ident(c),
                t = s.table
            ),
            None => format!("DELETE FROM {t} WHERE ?1 IS NOT NULL AND ", t = s.table),
        };
        let ack_many_row = (s.id.clone(), format!("({}, {lu}, {})", s.id, s.attempt));
        let mut lease = Self {
            warm: Warm::for_pool(&pool),
            pool,
            table,
            file,
            claim,
            cursor,
            renew,
            settle,
            ack_many_head,
            ack_many_row,
            ack_two: String::new(),
        };
        lease.ack_two = lease.ack_many_sql(2);
        lease
    }

    /// The lease ack of `n` rows in one statement, each fenced on its own token: `?1` the time
    /// an ack writes, then each row's id, expiry and attempt. The id list finds the rows
    /// through the primary key; the row values fence each one. Returns the ids it acked.
    fn ack_many_sql(&self, n: usize) -> String {
        let (id, fenced) = &self.ack_many_row;
        let first = |i: usize| 2 + 3 * i;
        let ids: Vec<String> = (0..n).map(|i| format!("?{}", first(i))).collect();
        let tokens: Vec<String> = (0..n)
            .map(|i| {
                let p = first(i);
                format!("(?{p}, ?{}, ?{})", p + 1, p + 2)
            })
            .collect();
        format!(
            "{}{id} IN ({}) AND {fenced} IN (VALUES {}) RETURNING {id}",
            self.ack_many_head,
            ids.join(", "),
            tokens.join(", ")
        )
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![
            ("claim", self.claim.as_str()),
            ("renew", self.renew.as_str()),
            ("ack many", self.ack_two.as_str()),
        ];
        out.extend(settle_named(&self.settle));
        out
    }

    /// One try of a settlement, fenced on the lease token; returns the rows it changed.
    async fn settle_once(&self, token: LeaseToken, settle: Settle) -> Result<u64> {
        run_settle(
            &self.settle,
            &self.warm,
            &self.pool,
            &self.file,
            self.table.name(),
            settle,
            Fence::Lease(token),
        )
        .await
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }
}

impl LeaseStrategy for SqliteLease {
    type Db = Sqlite;

    // Reads from the start: SQLite removes a deleted row's index entries in its delete, so no
    // dead entries pile up ahead of the claim.
    async fn claim(
        &self,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
        _from: Option<Position>,
    ) -> Result<Vec<ClaimedRow<Sqlite>>> {
        let from = self.cursor.as_ref().map(GroupCursor::get);
        let rows = retrying(|| async {
            let mut q = sqlx::query(sqlx::AssertSqlSafe(self.claim.clone()))
                .bind(now_ms)
                .bind(expires_ms)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX));
            if let Some(from) = &from {
                q = q.bind(from.clone());
            }
            let (mut conn, turn) =
                write_conn(&self.warm, &self.pool, &self.file, self.table.name()).await?;
            let rows = q.fetch_all(&mut *conn).await;
            drop(turn);
            self.warm.keep_if(conn, rows.is_ok());
            rows.map_err(self.err("claim"))
        })
        .await?;
        // Fewer rows than asked for: the table looks drained, and kept connections go back to
        // the pool (so do those of acks until a claim fills again).
        self.warm.claimed(rows.len() == limit);
        if let (Some(cursor), Some(from), Some(group)) = (&self.cursor, &from, self.table.group()) {
            let took = rows
                .iter()
                .map(|row| row.try_get::<Option<String>, _>(group))
                .collect::<Result<Vec<_>, _>>()
                .map_err(self.err("claim"))?;
            cursor.advance(from.as_deref(), took.iter().flatten().map(String::as_str));
        }
        rows.into_iter()
            .map(|row| crate::backend::claimed(&self.table, row, None))
            .collect()
    }

    async fn renew(&self, id: i64, token: LeaseToken, expires_ms: i64) -> Result<bool> {
        let done = settle_retrying(token.expires_ms - LEASE_MARGIN_MS, || async {
            let mut conn = self.pool.acquire().await.map_err(self.err("acquire"))?;
            let _turn = self.file.write_turn().await;
            sqlx::query(sqlx::AssertSqlSafe(self.renew.clone()))
                .bind(expires_ms)
                .bind(id)
                .bind(token.expires_ms)
                .bind(token.attempt)
                .execute(&mut *conn)
                .await
                .map_err(self.err("renew"))
        })
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn settle(&self, token: LeaseToken, settle: Settle) -> Result<bool> {
        let changed = settle_retrying(token.expires_ms - LEASE_MARGIN_MS, || {
            self.settle_once(token, settle)
        })
        .await?;
        Ok(changed == 1)
    }

    /// One `DELETE .. RETURNING` (an `UPDATE` where the table keeps acked rows) in one write
    /// turn; one row goes as the per-row ack.
    async fn ack_many(&self, acks: &[(i64, LeaseToken)], now_ms: i64) -> Result<Option<Vec<i64>>> {
        // One try: the engine acks each row alone, with retries, when this fails.
        if let [(id, token)] = acks {
            let settle = Settle::lease_ack(*id, *token, now_ms);
            let acked = self.settle_once(*token, settle).await? == 1;
            return Ok(Some(acked.then_some(*id).into_iter().collect()));
        }
        let mut q = sqlx::query(sqlx::AssertSqlSafe(self.ack_many_sql(acks.len()))).bind(now_ms);
        for (id, token) in acks {
            q = q.bind(*id).bind(token.expires_ms).bind(token.attempt);
        }
        let (mut conn, turn) =
            write_conn(&self.warm, &self.pool, &self.file, self.table.name()).await?;
        let rows = q.fetch_all(&mut *conn).await;
        drop(turn);
        self.warm.keep_if(conn, rows.is_ok());
        let rows = rows.map_err(self.err("ack many"))?;
        rows.iter()
            .map(|r| r.try_get::<i64, _>(0).map_err(self.err("ack many")))
            .collect::<Result<Vec<i64>>>()
            .map(Some)
    }

    fn release_kept(&self) {
        self.warm.release();
    }

    fn kept(&self) -> usize {
        self.warm.len()
    }
}
