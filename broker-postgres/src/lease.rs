//! Lease mode on PostgreSQL: one statement claims. A CTE selects the claimable rows
//! `FOR UPDATE SKIP LOCKED` (-- needs SKIP LOCKED: PostgreSQL 9.5) with a `LIMIT`, an `UPDATE` of
//! those rows writes the expiry and counts the attempt, and `RETURNING` hands them back; the
//! statement commits at once. Settlements and renewals are fenced on the token (expiry and
//! attempt).

use std::sync::Arc;

use broker_core::driver::retry::LEASE_MARGIN_MS;
use broker_core::driver::{
    ClaimedRow, Fence, GroupCursor, LeaseStrategy, LeaseToken, Position, Settle, WarmConnections,
};
use broker_core::{Result, TableDescription};
use sqlx::{Connection, PgPool, Postgres, Row};

use crate::fifo;
use crate::sql::{
    Failed, Resume, SettleStatements, Statements, ident, on_pool, on_warm, query, retrying,
    run_settle, settle_named, settle_retrying, ts,
};
use crate::stats::StatsWatch;

/// How many times a FIFO claim runs when its second read finds a row that is no longer its
/// group's head (see `fifo::claim_checked`).
const FIFO_TRIES: usize = 3;

/// The lease strategy of one PostgreSQL table.
#[derive(Debug)]
pub struct PgLease {
    pool: PgPool,
    /// Whether statements are prepared under a name (see `sql::query`).
    prepared: bool,
    table: Arc<TableDescription>,
    claim: Arc<str>,
    /// The claim from a position on (see `Statements::resume_condition`); `None` where claims
    /// always read from the start.
    claim_from: Option<Resume>,
    /// FIFO tables: the guard prefix the claim binds.
    guard: Option<String>,
    /// FIFO tables: where the next claim starts its visit of the groups.
    cursor: GroupCursor,
    /// FIFO tables: the second read of the claim's transaction (see `fifo::claim_checked`).
    recheck: Option<Arc<str>>,
    renew: Arc<str>,
    settle: SettleStatements,
    /// The ack of many rows (see `Statements::lease_ack_many`).
    ack_many: Arc<str>,
    /// Connections kept from one claim or ack to the next.
    warm: WarmConnections<sqlx::pool::PoolConnection<Postgres>>,
    /// Analyzes the table when a burst left its statistics stale (see `stats`).
    stats: Arc<StatsWatch>,
}

impl PgLease {
    pub(crate) fn new(
        pool: PgPool,
        table: Arc<TableDescription>,
        locked_until: &str,
        columns: &[String],
        stats: Arc<StatsWatch>,
    ) -> Self {
        let s = Statements::new(&table, columns);
        let lu = ident(locked_until);
        // $1 now, $2 expiry, $3 limit; FIFO: $4 cursor, $5 guard prefix.
        let (picked, guard) = match table.group().filter(|_| table.fifo()) {
            Some(group) => (
                format!(
                    "{cand}, sqlx_broker_picked AS (SELECT q.{id} AS id FROM {t} AS q \
                     WHERE q.{id} IN (SELECT id FROM sqlx_broker_cand) AND {claimable} \
                     FOR UPDATE OF q SKIP LOCKED)",
                    cand = fifo::head_candidates(&s, &table, group, "$3::int8", "$4", "$5"),
                    id = s.id,
                    t = s.table,
                    claimable = s.claimable,
                ),
                Some(fifo::guard_prefix(&table)),
            ),
            None => (
                format!(
                    "sqlx_broker_picked AS (SELECT q.{id} AS id FROM {t} AS q WHERE {claimable} \
                     ORDER BY {order} LIMIT $3::int8 FOR UPDATE OF q SKIP LOCKED)",
                    id = s.id,
                    t = s.table,
                    claimable = s.claimable,
                    order = s.order,
                ),
                None,
            ),
        };
        // The UPDATE's RETURNING sees the counted attempt; the outer select hands the rows back
        // in claim order. `q.id = ANY(ARRAY(..))` lets every plan find the picked rows by the
        // primary key: without it, a generic plan made while the table was empty hash-joins them
        // with a scan of the whole table, and PostgreSQL keeps that plan until the table is
        // analyzed again, however large it grows meanwhile.
        let claim_with = |picked: &str| {
            format!(
                "WITH {recursive}{picked}, sqlx_broker_claimed AS (\
                 UPDATE {t} AS q SET {lu} = {expiry}, {a} = q.{a} + 1 FROM sqlx_broker_picked AS p \
                 WHERE q.{id} = ANY(ARRAY(SELECT id FROM sqlx_broker_picked)) AND q.{id} = p.id \
                 RETURNING {columns}) \
                 SELECT * FROM sqlx_broker_claimed ORDER BY {order_out}",
                t = s.table,
                expiry = ts("$2"),
                a = s.attempt,
                id = s.id,
                recursive = if guard.is_some() { "RECURSIVE " } else { "" },
                columns = s.claimed_columns(true),
                order_out = s.order_out,
            )
        };
        let claim = claim_with(&picked);
        // $1 now, $2 expiry, $3 limit, then the position.
        let claim_from = s.resume_condition(4).map(|from| {
            s.resume(claim_with(&format!(
                "sqlx_broker_picked AS (SELECT q.{id} AS id FROM {t} AS q WHERE {claimable}{from} \
                 ORDER BY {order} LIMIT $3::int8 FOR UPDATE OF q SKIP LOCKED)",
                id = s.id,
                t = s.table,
                claimable = s.claimable,
                order = s.order,
            )))
        });
        // $1 new expiry, $2 id, $3 and $4 the token. The row may hold the new expiry already:
        // a renewal run again after a lost reply finds its own first try landed.
        let renew = format!(
            "UPDATE {t} AS q SET {lu} = {expiry} WHERE q.{id} = $2::int8 AND q.{lu} IN ({token}, {expiry}) AND q.{a} = $4::int8",
            t = s.table,
            expiry = ts("$1"),
            id = s.id,
            token = ts("$3"),
            a = s.attempt,
        );
        let fence = format!(" AND q.{lu} = {} AND q.{} = $4::int8", ts("$3"), s.attempt);
        let settle = s.settle(&table, false, &fence);
        let ack_many = s.lease_ack_many(&table, locked_until).into();
        let recheck = guard
            .as_ref()
            .and_then(|_| fifo::no_longer_heads(&table))
            .map(Arc::from);
        Self {
            warm: WarmConnections::for_pool(&pool),
            stats,
            pool,
            prepared: true,
            table,
            claim: claim.into(),
            claim_from,
            recheck,
            guard,
            cursor: GroupCursor::default(),
            renew: renew.into(),
            settle,
            ack_many,
        }
    }

    /// One try of a settlement: the rows it changed.
    async fn settle_once(&self, token: LeaseToken, settle: Settle) -> Result<u64, Failed> {
        let mut conn = self
            .warm
            .acquire(&self.pool)
            .await
            .map_err(Failed::new("acquire"))?;
        let changed = if self.prepared {
            run_settle(&self.settle, &mut conn, true, settle, Fence::Lease(token)).await
        } else {
            // Unnamed statements run inside a transaction (see `sql::on_pool`).
            async {
                let mut tx = conn.begin().await.map_err(Failed::new("begin"))?;
                let changed =
                    run_settle(&self.settle, &mut tx, false, settle, Fence::Lease(token)).await?;
                tx.commit().await.map_err(Failed::new("commit"))?;
                Ok(changed)
            }
            .await
        };
        match &changed {
            Ok(_) => self.warm.keep(conn),
            Err(_) => self.warm.release(),
        }
        changed
    }

    /// Sends every statement unnamed, for a transaction-mode pooler.
    pub(crate) fn unprepared(mut self) -> Self {
        self.prepared = false;
        self
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![
            ("claim", &*self.claim),
            ("renew", &*self.renew),
            ("ack many", &*self.ack_many),
        ];
        if let Some(from) = &self.claim_from {
            out.push(("claim from a position", &*from.sql));
        }
        if let Some(recheck) = &self.recheck {
            out.push(("fifo recheck", &**recheck));
        }
        out.extend(settle_named(&self.settle));
        out
    }
}

impl LeaseStrategy for PgLease {
    type Db = Postgres;

    /// Claims up to `limit` rows in one statement, in claim order.
    ///
    /// # Cancel safety
    /// Not cancel safe: a claim cut short may have committed, and its rows then wait for their
    /// lease to run out.
    async fn claim(
        &self,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
        position: Option<Position>,
    ) -> Result<Vec<ClaimedRow<Postgres>>> {
        let began = std::time::Instant::now();
        let from = self.guard.as_ref().map(|_| self.cursor.get());
        let mut tries = 0;
        let rows = loop {
            tries += 1;
            let rows = retrying(|| async {
                let limit = i64::try_from(limit).unwrap_or(i64::MAX);
                let bind = |q: sqlx::query::Query<'static, Postgres, _>| {
                    q.bind(now_ms).bind(expires_ms).bind(limit)
                };
                let mut q = match (&self.claim_from, position) {
                    (Some(resume), Some(at)) => resume.query(self.prepared, at, bind),
                    _ => bind(query(&self.claim, self.prepared)),
                };
                if let (Some(prefix), Some(from)) = (&self.guard, &from) {
                    q = q.bind(from.clone()).bind(prefix.clone());
                }
                match &self.recheck {
                    Some(recheck) => {
                        let mut conn = self
                            .warm
                            .acquire(&self.pool)
                            .await
                            .map_err(Failed::new("claim"))?;
                        let out = fifo::claim_checked(&mut conn, q, recheck, self.prepared).await;
                        self.warm.keep_if(conn, out.is_ok());
                        out.map_err(Failed::new("claim"))
                    }
                    None => on_warm(&self.warm, &self.pool, self.prepared, |c| {
                        Box::pin(q.fetch_all(c))
                    })
                    .await
                    .map(Some)
                    .map_err(Failed::new("claim")),
                }
            })
            .await
            .map_err(|e| e.on(self.table.name()))?;
            match rows {
                Some(rows) => break rows,
                // A FIFO claim rolled back: a row with a lower id committed inside its window
                // (see `fifo::claim_checked`). Each try is a fresh statement, so only a commit
                // inside the window of every try would end it empty-handed.
                None if tries < FIFO_TRIES => {}
                None => break Vec::new(),
            }
        };
        // A claim that found fewer rows than it asked for: the table looks drained, and kept
        // connections go back to the pool (so do those of acks until a claim fills again).
        self.warm.claimed(rows.len() == limit);
        self.stats.claimed(rows.len(), began.elapsed());
        if let (Some(from), Some(group)) = (&from, self.table.group()) {
            let took = rows
                .iter()
                .map(|row| row.try_get::<Option<String>, _>(group))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| Failed::new("claim")(e).on(self.table.name()))?;
            self.cursor
                .advance(from.as_deref(), took.iter().flatten().map(String::as_str));
        }
        rows.into_iter()
            .map(|row| {
                crate::backend::claimed(row, None)
                    .map_err(|e| Failed::new("claim")(e).on(self.table.name()))
            })
            .collect()
    }

    /// # Cancel safety
    /// A cancelled renewal leaves the old or the new expiry; the delivery keeps the old token.
    async fn renew(&self, id: i64, token: LeaseToken, expires_ms: i64) -> Result<bool> {
        let done = settle_retrying(token.expires_ms - LEASE_MARGIN_MS, || async {
            let q = query(&self.renew, self.prepared)
                .bind(expires_ms)
                .bind(id)
                .bind(token.expires_ms)
                .bind(token.attempt);
            on_pool(&self.pool, self.prepared, |c| Box::pin(q.execute(c)))
                .await
                .map_err(Failed::new("renew"))
        })
        .await
        .map_err(|e| e.on(self.table.name()))?;
        Ok(done.rows_affected() == 1)
    }

    /// # Cancel safety
    /// Not cancel safe: a cancelled settlement may or may not have landed.
    async fn settle(&self, token: LeaseToken, settle: Settle) -> Result<bool> {
        // Fenced on the token, so a try after one whose connection failed mid-statement changes
        // nothing twice.
        let changed = settle_retrying(token.expires_ms - LEASE_MARGIN_MS, || {
            self.settle_once(token, settle)
        })
        .await
        .map_err(|e| e.on(self.table.name()))?;
        Ok(changed == 1)
    }

    /// One `DELETE .. USING UNNEST(..) .. RETURNING` (an `UPDATE` where the table keeps acked
    /// rows), fenced per row on its token.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled ack may or may not have landed.
    async fn ack_many(&self, acks: &[(i64, LeaseToken)], now_ms: i64) -> Result<Option<Vec<i64>>> {
        let ids: Vec<i64> = acks.iter().map(|(id, _)| *id).collect();
        let expiries: Vec<i64> = acks.iter().map(|(_, t)| t.expires_ms).collect();
        let attempts: Vec<i64> = acks.iter().map(|(_, t)| t.attempt).collect();
        // One try: the engine acks each row alone, with retries, when this fails.
        if let [(id, token)] = acks {
            // One row: the per-row ack, whose plan is a plain primary-key lookup.
            let settle = Settle::lease_ack(*id, *token, now_ms);
            let acked = self
                .settle_once(*token, settle)
                .await
                .map_err(|e| e.on(self.table.name()))?;
            return Ok(Some((acked == 1).then_some(*id).into_iter().collect()));
        }
        let q = query(&self.ack_many, self.prepared)
            .bind(&ids)
            .bind(&expiries)
            .bind(&attempts)
            .bind(now_ms);
        let acked = on_warm(&self.warm, &self.pool, self.prepared, |c| {
            Box::pin(q.fetch_all(c))
        })
        .await
        .map_err(|e| Failed::new("ack many")(e).on(self.table.name()))?;
        acked
            .iter()
            .map(|row| {
                row.try_get::<i64, _>(0)
                    .map_err(|e| Failed::new("ack many")(e).on(self.table.name()))
            })
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
