//! Row lock mode on MySQL and MariaDB: a READ COMMITTED transaction takes one due row with
//! `FOR UPDATE SKIP LOCKED` and stays open while the handler runs; the settlement runs in it and
//! commits.
//!
//! The hot path is begin, the claim's select, the settlement's statement and commit. Only when
//! the handler first asks for the delivery's transaction does it set a savepoint: a retry or dead
//! letter rolls back to it — undoing what the handler wrote, while InnoDB keeps the claimed row
//! locked — then counts the attempt and commits. Every settlement releases the savepoint before
//! it changes the queue row. A crash, a killed connection or a dropped delivery rolls the whole
//! transaction back: the row is due again at once and no attempt is used.

use std::sync::Arc;

use broker_core::driver::{Action, RowLockClaim, RowLockStrategy, Settle};
use broker_core::{Result, SqlxBrokerError, TableDescription};
use sqlx::{MySql, MySqlPool, Transaction};

use crate::backend::claimed;
use crate::fifo::{self, Guard};
use crate::sql::{
    Args, P, RELEASE_WRITES, ROLLBACK_TO_WRITES, SettleStatements, Sql, Statements, Stmt,
    WRITES_SAVEPOINT, begin_sql, execute_plain, retrying,
};

/// How many group heads a FIFO claim reads to find one it can lock.
const FIFO_CANDIDATES: usize = 8;

/// The row lock strategy of one MySQL / MariaDB table.
#[derive(Debug)]
pub struct MySqlRowLock {
    pool: MySqlPool,
    table: Arc<TableDescription>,
    begin: Arc<str>,
    claim: Stmt,
    /// FIFO tables: the candidates (group heads in claim order, read without locks) and the
    /// take that locks one of them by id (see [`MySqlRowLock::claim_once`]).
    fifo: Option<(Stmt, Stmt)>,
    guard: Option<Stmt>,
    settle: SettleStatements,
}

impl MySqlRowLock {
    pub(crate) fn new(
        pool: MySqlPool,
        table: Arc<TableDescription>,
        group_index: Option<&str>,
    ) -> Self {
        let s = Statements::new(&table);
        // -- needs SKIP LOCKED: MySQL 8.0.1, MariaDB 10.6
        let claim = Sql::new(format!(
            "SELECT {} FROM {} WHERE ",
            s.select_list(false),
            s.table
        ))
        .append(&s.claimable)
        .push(&format!(
            " ORDER BY {} LIMIT 1 FOR UPDATE SKIP LOCKED",
            s.order
        ))
        .stmt("claim");
        let fifo = fifo::guard(&table, group_index).is_some().then(|| {
            let candidates = Sql::new(format!(
                "SELECT CAST({} AS SIGNED) FROM {} WHERE ",
                s.id, s.table
            ))
            .append(&s.claimable)
            .push(&format!(" ORDER BY {} LIMIT {FIFO_CANDIDATES}", s.order))
            .stmt("fifo candidates");
            let take = Sql::new(format!(
                "SELECT {} FROM {} WHERE {} = ",
                s.select_list(false),
                s.table,
                s.id
            ))
            .param(P::Id)
            .push(" AND ")
            .append(&s.claimable)
            .push(" FOR UPDATE SKIP LOCKED")
            .stmt("fifo take");
            (candidates, take)
        });
        let settle = s.settle(&table, &Sql::default(), true);
        Self {
            pool,
            begin: begin_sql(&table),
            claim,
            fifo,
            guard: fifo::guard(&table, group_index),
            settle,
            table,
        }
    }

    /// Every statement the strategy runs, by name, so prepare can check each one against the
    /// table.
    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![&self.claim];
        if let Some((candidates, take)) = &self.fifo {
            out.push(candidates);
            out.push(take);
        }
        out.extend(&self.guard);
        out.extend(self.settle.named());
        out.into_iter().map(Stmt::named).collect()
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }

    async fn claim_once(&self, now_ms: i64) -> Result<Option<RowLockClaim<MySql>>> {
        let name = self.table.name();
        let mut tx = self
            .pool
            .begin_with(sqlx::AssertSqlSafe(self.begin.clone()))
            .await
            .map_err(self.err("begin"))?;
        let args = Args {
            now_ms,
            ..Args::default()
        };
        let row = match &self.fifo {
            None => self
                .claim
                .bind(&args)
                .fetch_optional(&mut *tx)
                .await
                .map_err(self.err("claim"))?,
            Some((candidates, take)) => {
                // A locking read keeps every row it reads through a secondary index and then
                // rejects in its WHERE locked until the transaction ends (seen on MariaDB 10.11:
                // a claim that passed a group's second row on the way to another group's head
                // kept it locked, so the group could not move on while that delivery ran). The
                // head condition is such a check, so the candidates are read without locks and
                // one is locked by its id, the condition checked again under the lock.
                let ids: Vec<i64> = candidates
                    .bind(&args)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(self.err("fifo candidates"))?
                    .iter()
                    .map(|r| sqlx::Row::try_get(r, 0))
                    .collect::<Result<_, _>>()
                    .map_err(self.err("fifo candidates"))?;
                let mut taken = None;
                for id in ids {
                    let args = Args { id, ..args };
                    taken = take
                        .bind(&args)
                        .fetch_optional(&mut *tx)
                        .await
                        .map_err(self.err("fifo take"))?;
                    if taken.is_some() {
                        break;
                    }
                }
                taken
            }
        };
        let Some(row) = row else {
            tx.rollback().await.map_err(self.err("rollback"))?;
            return Ok(None);
        };
        let row = claimed(&self.table, row, None)?;
        if let Some(guard) = &self.guard
            && fifo::check(&mut tx, guard, name, &row.row, row.id).await? == Guard::Behind
        {
            tracing::debug!(
                table = name,
                id = row.id,
                "fifo guard: not the group's head now"
            );
            tx.rollback().await.map_err(self.err("rollback"))?;
            return Ok(None);
        }
        // MariaDB keeps the per-claim savepoint for now: without it, the stress run with killed
        // connections and crashed processes found rows delivered again after an ack that no
        // fault reached (3 runs of 3; with it, 0 of 2 here and of 4 before). Not understood yet
        // (see the notes of #10); `begin_writes` sets the same savepoint again, which replaces it.
        execute_plain(&mut tx, name, "savepoint", WRITES_SAVEPOINT).await?;
        Ok(Some((tx, row)))
    }
}

impl RowLockStrategy for MySqlRowLock {
    type Db = MySql;

    async fn claim(&self, now_ms: i64) -> Result<Option<RowLockClaim<MySql>>> {
        retrying(|| self.claim_once(now_ms)).await
    }

    async fn begin_writes(&self, tx: &mut Transaction<'static, MySql>) -> Result<()> {
        execute_plain(tx, self.table.name(), "savepoint", WRITES_SAVEPOINT).await
    }

    async fn settle(
        &self,
        mut tx: Transaction<'static, MySql>,
        settle: Settle,
        writes_began: bool,
    ) -> Result<()> {
        let name = self.table.name();
        if writes_began {
            if settle.action != Action::Ack {
                execute_plain(&mut tx, name, "rollback to savepoint", ROLLBACK_TO_WRITES).await?;
            }
            execute_plain(&mut tx, name, "release savepoint", RELEASE_WRITES).await?;
        }
        self.settle.run(&mut tx, name, settle, None, true).await?;
        tx.commit().await.map_err(self.err("commit"))
    }
}
