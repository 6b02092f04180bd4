//! Row lock mode: the claim opens a transaction, takes one due row with
//! `FOR UPDATE SKIP LOCKED` (-- needs SKIP LOCKED: PostgreSQL 9.5), and hands the transaction
//! out open; the settlement runs in it and commits.
//!
//! The hot path is the four statements a hand-written loop runs: begin, the claim's select, the
//! settlement's statement, commit. A savepoint is taken only when the handler first asks for
//! the delivery's transaction: it marks where the handler's own writes begin, so a retry or dead
//! letter rolls back to it (undoing those writes, keeping the row lock and the FIFO guard, which
//! were taken before it). Every settlement releases the savepoint before it changes the queue
//! row: a row that its transaction locked and a subtransaction then changes gets a MultiXact
//! (its locker and its updater both recorded), which cut a row lock loop to less than half its
//! speed. A crash rolls back everything, the count included, so it uses no attempt.

use std::sync::Arc;

use broker_core::driver::{
    Action, Fence, GroupCursor, KeptForClaim, Position, RowLockClaim, RowLockStrategy,
    RowTransaction, Settle, WarmConnections,
};
use broker_core::{IsolationLevel, Result, TableDescription};
use sqlx::{Executor, PgPool, Postgres, Row, SqlStr};

use crate::fifo;
use crate::sql::{
    Failed, Resume, SettleStatements, Statements, query, retrying, run_settle, settle_named,
};
use crate::stats::StatsWatch;

const SAVEPOINT: &str = "SAVEPOINT sqlx_broker_writes";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT sqlx_broker_writes";
const RELEASE_SAVEPOINT: &str = "RELEASE SAVEPOINT sqlx_broker_writes";

/// The row lock strategy of one PostgreSQL table.
#[derive(Debug)]
pub struct PgRowLock {
    pool: PgPool,
    /// Whether statements are prepared under a name (see `sql::query`).
    prepared: bool,
    table: Arc<TableDescription>,
    begin: Option<&'static str>,
    claim: Arc<str>,
    /// The claim from a position on (see `Statements::resume_condition`); `None` where claims
    /// always read from the start.
    claim_from: Option<Resume>,
    /// FIFO tables: the guard prefix the claim binds.
    guard: Option<String>,
    /// FIFO tables: where the next claim starts its visit of the groups.
    cursor: GroupCursor,
    settle: SettleStatements,
    /// Connections of committed deliveries, kept for the next claim: with `chain`, each with
    /// the next transaction already begun.
    warm: WarmConnections<KeptForClaim<Postgres>>,
    /// Settlements that keep their connection commit with `COMMIT AND CHAIN` (PostgreSQL 12+,
    /// not behind a transaction-mode pooler, where an open transaction would pin a server
    /// connection while it waits).
    chain: bool,
    /// Analyzes the table when a burst left its statistics stale (see `stats`).
    stats: Arc<StatsWatch>,
}

/// Commits and begins the next transaction, with the same isolation level, in one statement.
const COMMIT_AND_CHAIN: &str = "COMMIT AND CHAIN";

impl PgRowLock {
    pub(crate) fn new(
        pool: PgPool,
        table: Arc<TableDescription>,
        columns: &[String],
        stats: Arc<StatsWatch>,
    ) -> Self {
        let s = Statements::new(&table, columns);
        let columns = s.claimed_columns(false);
        // $1 now, then the position.
        let claim_from = s.resume_condition(2).map(|from| {
            s.resume(format!(
                "SELECT {columns} FROM {t} AS q WHERE {claimable}{from} ORDER BY {order} LIMIT 1 \
                 FOR UPDATE OF q SKIP LOCKED",
                t = s.table,
                claimable = s.claimable,
                order = s.order,
            ))
        });
        let (claim, guard) = match table.group().filter(|_| table.fifo()) {
            // $1 now, $2 cursor, $3 guard prefix.
            Some(group) => (
                format!(
                    "WITH RECURSIVE {cand} SELECT {columns} FROM {t} AS q \
                     WHERE q.{id} IN (SELECT id FROM sqlx_broker_cand) AND {claimable} \
                     FOR UPDATE OF q SKIP LOCKED",
                    cand = fifo::head_candidates(&s, &table, group, "1", "$2", "$3"),
                    t = s.table,
                    id = s.id,
                    claimable = s.claimable,
                ),
                Some(fifo::guard_prefix(&table)),
            ),
            // $1 now.
            None => (
                format!(
                    "SELECT {columns} FROM {t} AS q WHERE {claimable} ORDER BY {order} LIMIT 1 \
                     FOR UPDATE OF q SKIP LOCKED",
                    t = s.table,
                    claimable = s.claimable,
                    order = s.order,
                ),
                None,
            ),
        };
        let begin = table.isolation().map(|level| match level {
            IsolationLevel::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            IsolationLevel::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            IsolationLevel::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        });
        let settle = s.settle(&table, true, "");
        Self {
            warm: WarmConnections::for_pool(&pool),
            stats,
            pool,
            prepared: true,
            table,
            begin,
            claim: claim.into(),
            claim_from,
            guard,
            cursor: GroupCursor::default(),
            settle,
            chain: false,
        }
    }

    /// Commits kept connections' transactions with `COMMIT AND CHAIN` (see `chain`).
    pub(crate) fn chained(mut self) -> Self {
        self.chain = true;
        self
    }

    /// Sends every statement unnamed, for a transaction-mode pooler.
    pub(crate) fn unprepared(mut self) -> Self {
        self.prepared = false;
        self
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![("claim", &*self.claim)];
        if let Some(from) = &self.claim_from {
            out.push(("claim from a position", &*from.sql));
        }
        out.extend(settle_named(&self.settle));
        out
    }

    async fn try_claim(
        &self,
        now_ms: i64,
        from: Option<Position>,
    ) -> Result<Option<RowLockClaim<Postgres>>, Failed> {
        let began = std::time::Instant::now();
        let claimed = self.claim_on_warm(now_ms, from).await;
        match &claimed {
            Ok(found) => {
                self.warm.claimed(found.is_some());
                self.stats
                    .claimed(usize::from(found.is_some()), began.elapsed());
            }
            // The server may have dropped every kept connection; the retry takes tested ones.
            Err(_) => self.warm.release(),
        }
        claimed
    }

    async fn claim_on_warm(
        &self,
        now_ms: i64,
        position: Option<Position>,
    ) -> Result<Option<RowLockClaim<Postgres>>, Failed> {
        let kept = match self.warm.take() {
            Some(kept) => kept,
            None => KeptForClaim::Idle(
                self.pool
                    .acquire()
                    .await
                    .map_err(Failed::new("claim acquire"))?,
            ),
        };
        let mut tx = RowTransaction::resume(kept, self.begin.map(SqlStr::from_static))
            .await
            .map_err(Failed::new("claim begin"))?;
        let mut q = match (&self.claim_from, position) {
            (Some(resume), Some(at)) => resume.query(self.prepared, at, |q| q.bind(now_ms)),
            _ => query(&self.claim, self.prepared).bind(now_ms),
        };
        let from = self.guard.as_ref().map(|_| self.cursor.get());
        if let (Some(prefix), Some(from)) = (&self.guard, &from) {
            q = q.bind(from.clone()).bind(prefix.clone());
        }
        let row = q
            .fetch_optional(&mut *tx)
            .await
            .map_err(Failed::new("claim"))?;
        let Some(row) = row else {
            // Back to the pool: the table looks drained.
            tx.rollback().await.map_err(Failed::new("claim rollback"))?;
            return Ok(None);
        };
        if let (Some(from), Some(group)) = (&from, self.table.group()) {
            let took: Option<String> = row.try_get(group).map_err(Failed::new("claim"))?;
            self.cursor.advance(from.as_deref(), took.as_deref());
        }
        let claimed = crate::backend::claimed(row, None).map_err(Failed::new("claim"))?;
        Ok(Some((tx, claimed)))
    }
}

impl RowLockStrategy for PgRowLock {
    type Db = Postgres;

    /// Opens a transaction (at the table's isolation level, if it sets one) and takes one due
    /// row with `FOR UPDATE SKIP LOCKED`; on a FIFO table only a group head whose guard is free.
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped claim may leave its connection mid-statement (sqlx then tests
    /// the connection before reusing it, and the open transaction rolls back).
    async fn claim(
        &self,
        now_ms: i64,
        from: Option<Position>,
    ) -> Result<Option<RowLockClaim<Postgres>>> {
        // A failed claim's transaction rolls back as it drops, so trying again is safe.
        retrying(|| self.try_claim(now_ms, from))
            .await
            .map_err(|e| e.on(self.table.name()))
    }

    /// Sets the savepoint the handler's writes roll back to on a retry or dead letter.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled call may leave the connection mid-statement.
    async fn begin_writes(&self, tx: &mut RowTransaction<Postgres>) -> Result<()> {
        (**tx)
            .execute(SAVEPOINT)
            .await
            .map(drop)
            .map_err(|e| Failed::new("savepoint")(e).on(self.table.name()))
    }

    /// Runs the settlement in the claim's transaction and commits it. Where the handler's writes
    /// began, a retry or dead letter first rolls back to their savepoint (the row stays locked),
    /// and every settlement releases it before changing the row, so the change is the top
    /// transaction's own. The attempt is counted in the statement that puts the row back.
    ///
    /// A transient error in the settlement's statement (a serialization failure at SERIALIZABLE)
    /// is returned: the transaction rolls back, so the row is due again at once with the attempt
    /// not counted, as after a crash.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled settlement drops the transaction, which rolls back (the row
    /// is due again, its attempt not counted).
    async fn settle(
        &self,
        mut tx: RowTransaction<Postgres>,
        settle: Settle,
        writes_began: bool,
        keep_connection: bool,
    ) -> Result<()> {
        let name = self.table.name();
        if writes_began {
            if settle.action != Action::Ack {
                (*tx)
                    .execute(ROLLBACK_TO_SAVEPOINT)
                    .await
                    .map_err(|e| Failed::new("rollback to savepoint")(e).on(name))?;
            }
            (*tx)
                .execute(RELEASE_SAVEPOINT)
                .await
                .map_err(|e| Failed::new("release savepoint")(e).on(name))?;
        }
        run_settle(&self.settle, &mut tx, self.prepared, settle, Fence::None)
            .await
            .map_err(|e| e.on(name))?;
        if keep_connection && self.chain && self.warm.would_keep() {
            // The next claim's transaction begins here: it holds nothing until that claim's
            // select, and rolls back on its way to the pool if no claim takes it.
            (*tx)
                .execute(COMMIT_AND_CHAIN)
                .await
                .map_err(|e| Failed::new("commit")(e).on(name))?;
            self.warm.keep(KeptForClaim::Begun(tx));
            return Ok(());
        }
        let conn = tx
            .commit()
            .await
            .map_err(|e| Failed::new("commit")(e).on(name))?;
        if keep_connection {
            self.warm.keep(KeptForClaim::Idle(conn));
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
