//! Row lock mode on MySQL and MariaDB: a READ COMMITTED transaction takes one due row with
//! `FOR UPDATE SKIP LOCKED` and stays open while the handler runs; the settlement runs in it and
//! commits.
//!
//! The hot path is the claim window's read (outside the transaction, see [`crate::window`]),
//! begin, the take, the settlement's statement and commit. On a table without FIFO groups, a
//! settlement that keeps its connection for the next claim sends its commit, the next claim's
//! window read and that claim's begin as one multi-statement, so the next claim starts at its
//! take: three round trips per row (take, settlement, commit with read and begin) where the
//! hand-written loop sends four. Only when
//! the handler first asks for the delivery's transaction does it set a savepoint: a retry or dead
//! letter rolls back to it — undoing what the handler wrote, while InnoDB keeps the claimed row
//! locked — then counts the attempt and commits. Every settlement releases the savepoint before
//! it changes the queue row. A crash, a killed connection or a dropped delivery rolls the whole
//! transaction back: the row is due again at once and no attempt is used.

use std::sync::Arc;

use broker_core::driver::{
    Action, Fence, Position, RowLockClaim, RowLockStrategy, RowTransaction, Settle, WarmConnections,
};
use broker_core::{Result, SqlxBrokerError, TableDescription};
use sqlx::mysql::MySqlRow;
use sqlx::{MySql, MySqlPool, SqlSafeStr};

use crate::backend::{Conn, claimed};
use crate::fifo::{self, Guard};
use crate::sql::{
    RELEASE_WRITES, ROLLBACK_TO_WRITES, SettleStatements, Sql, Statements, Stmt, WRITES_SAVEPOINT,
    begin_sql, execute_plain, retrying, run_settle, settle_named,
};
use crate::window::{Candidates, PAGES, SPARE_TRIES, Spare, Window, commit_then};

/// The row lock strategy of one MySQL / MariaDB table.
#[derive(Debug)]
pub struct MySqlRowLock {
    pool: MySqlPool,
    table: Arc<TableDescription>,
    begin: Arc<str>,
    /// The claim: a window of ids read without locks, one of them locked through the primary
    /// key (see [`crate::window`]).
    window: Window,
    guard: Option<Stmt>,
    settle: SettleStatements,
    /// Connections of committed deliveries, kept for the next claim.
    warm: WarmConnections<Kept>,
    /// Settlements that keep their connection read the next window and begin (tables without
    /// FIFO groups).
    chain: bool,
    /// The rest of the last window, for the next claims of settlements that keep their
    /// connection (see [`Spare`]).
    spare: Spare,
}

/// What a settlement keeps for the next claim.
#[derive(Debug)]
enum Kept {
    /// A connection whose transaction committed.
    Idle(sqlx::pool::PoolConnection<MySql>),
    /// The next claim's transaction, begun by the settlement's commit statement, and the window
    /// that statement read just before it. It holds no row yet; dropped, it rolls back as its
    /// connection goes back to the pool.
    Begun(RowTransaction<MySql>, Candidates),
}

impl MySqlRowLock {
    pub(crate) fn new(
        pool: MySqlPool,
        table: Arc<TableDescription>,
        group_index: Option<&str>,
    ) -> Self {
        let s = Statements::new(&table);
        let settle = s.settle(&table, &Sql::default(), true, "");
        Self {
            warm: WarmConnections::for_pool(&pool),
            pool,
            begin: begin_sql(&table),
            window: Window::new(&table, &s),
            guard: fifo::guard(&table, group_index),
            settle,
            chain: !table.fifo(),
            spare: Spare::default(),
            table,
        }
    }

    /// Every statement the strategy runs, by name, so prepare can check each one against the
    /// table.
    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = self.window.statements().to_vec();
        out.extend(&self.guard);
        out.extend(settle_named(&self.settle));
        out.into_iter().map(Stmt::named).collect()
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }

    /// Reads windows of candidates until one row is locked, none is left, or [`PAGES`] windows
    /// held only rows in work. Each window is read outside the transaction (see
    /// [`crate::window`]), so a window that gave nothing ends its transaction before the next.
    async fn claim_once(&self, now_ms: i64) -> Result<Option<RowLockClaim<MySql>>> {
        let mut page = self.window.first_page();
        let mut kept = self.warm.take();
        let mut tries = 0;
        // The kept transaction's take, its tries with more spare ids, then the windows.
        for _ in 0..1 + SPARE_TRIES + PAGES {
            let (mut tx, window) = match kept.take() {
                // The last settlement read this window and began the transaction.
                Some(Kept::Begun(tx, window)) => (tx, window),
                idle => {
                    let conn = match idle {
                        Some(Kept::Idle(conn)) => conn,
                        _ => self.pool.acquire().await.map_err(self.err("acquire"))?,
                    };
                    let mut conn = Conn::guard(conn);
                    // An error leaves `conn` armed, so it is closed (see `Window::read`).
                    let window = self
                        .window
                        .read(&mut conn, self.table.name(), now_ms, &page)
                        .await?;
                    if window.is_empty() {
                        conn.finish();
                        self.window.claimed(&window, []);
                        if window.more() {
                            // FIFO: the groups walked had no claimable head; walk on.
                            page = window.next_page(&page);
                            continue;
                        }
                        return Ok(None);
                    }
                    let tx = RowTransaction::begin(
                        conn.into_inner(),
                        Some(sqlx::AssertSqlSafe(self.begin.clone()).into_sql_str()),
                    )
                    .await
                    .map_err(self.err("begin"))?;
                    (tx, window)
                }
            };
            let taken = self
                .window
                .take(window.run(), 1, now_ms)
                .fetch_optional(&mut *tx)
                .await
                .map_err(self.err("claim take"))?;
            self.window.claimed(&window, taken.iter());
            match taken {
                Some(row) => return self.hold(tx, row, &window).await,
                None if window.is_spare() => {
                    // Spare ids that a claim reading a window took: the next ones, in the same
                    // transaction, a few times; then a window.
                    if tries < SPARE_TRIES
                        && let Some(next) = self.spare.share(1)
                    {
                        tries += 1;
                        kept = Some(Kept::Begun(tx, next));
                        continue;
                    }
                    let conn = tx.rollback().await.map_err(self.err("rollback"))?;
                    kept = Some(Kept::Idle(conn));
                }
                None => {
                    tx.rollback().await.map_err(self.err("rollback"))?;
                    if !window.more() {
                        return Ok(None);
                    }
                    page = window.next_page(&page);
                }
            }
        }
        Ok(None)
    }

    /// Commits a settled delivery's transaction and, in the same round trip, reads the next
    /// claim's window and begins its transaction (see [`Window::commit_and_read`]), keeping
    /// both for that claim. A window that found nothing ends the new transaction at once.
    async fn commit_and_read(&self, mut tx: RowTransaction<MySql>) -> Result<()> {
        let name = self.table.name();
        if let Some(window) = self.spare.share(1) {
            // The rest of a recent window serves the next claim: commit and begin, no read.
            let begun = match commit_then(&mut tx, &self.begin).await {
                Ok(begun) => begun,
                Err(e) => {
                    tx.close_on_drop();
                    return Err(self.err("commit")(e));
                }
            };
            match begun {
                Ok(_) => self.warm.keep(Kept::Begun(tx, window)),
                Err(e) => {
                    // The settlement committed; only the next claim's begin failed.
                    tracing::debug!(table = name, error = %e, "the begin after a commit failed; closing its connection");
                    self.spare.clear();
                    tx.close_on_drop();
                }
            }
            return Ok(());
        }
        let read = match self
            .window
            .commit_and_read(&mut tx, broker_core::driver::clock::now_ms(), &self.begin)
            .await
        {
            Ok(read) => read,
            Err(e) => {
                tx.close_on_drop();
                return Err(self.err("commit")(e));
            }
        };
        match read {
            Ok(window) if !window.is_empty() => self.warm.keep(Kept::Begun(tx, window)),
            Ok(_) => {
                if let Ok(conn) = tx.rollback().await {
                    self.warm.keep(Kept::Idle(conn));
                }
            }
            Err(e) => {
                // The settlement committed; only the next claim's read failed.
                tracing::debug!(table = name, error = %e, "the window read after a commit failed; closing its connection");
                tx.close_on_drop();
            }
        }
        Ok(())
    }

    /// Keeps the rest of `window` (tables without FIFO groups), checks a locked row's group
    /// (FIFO) and hands the delivery out.
    async fn hold(
        &self,
        mut tx: RowTransaction<MySql>,
        row: MySqlRow,
        window: &Candidates,
    ) -> Result<Option<RowLockClaim<MySql>>> {
        let name = self.table.name();
        let row = claimed(&self.table, row, None)?;
        if self.chain {
            // The rest of the window, for the next claims (see `Spare`).
            self.spare.keep_after(window, row.id);
        }
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
        Ok(Some((tx, row)))
    }
}

impl RowLockStrategy for MySqlRowLock {
    type Db = MySql;

    async fn claim(
        &self,
        now_ms: i64,
        _from: Option<Position>,
    ) -> Result<Option<RowLockClaim<MySql>>> {
        retrying(|| async {
            let claimed = self.claim_once(now_ms).await;
            match &claimed {
                Ok(found) => self.warm.claimed(found.is_some()),
                // The server may have dropped every kept connection; the retry takes tested
                // ones.
                Err(_) => self.warm.release(),
            }
            claimed
        })
        .await
    }

    async fn begin_writes(&self, tx: &mut RowTransaction<MySql>) -> Result<()> {
        execute_plain(tx, self.table.name(), "savepoint", WRITES_SAVEPOINT).await
    }

    async fn settle(
        &self,
        mut tx: RowTransaction<MySql>,
        settle: Settle,
        writes_began: bool,
        keep_connection: bool,
    ) -> Result<()> {
        let name = self.table.name();
        if writes_began {
            if settle.action != Action::Ack {
                execute_plain(&mut tx, name, "rollback to savepoint", ROLLBACK_TO_WRITES).await?;
            }
            execute_plain(&mut tx, name, "release savepoint", RELEASE_WRITES).await?;
        }
        run_settle(&self.settle, &mut tx, name, settle, Fence::None, true).await?;
        if keep_connection && self.chain && self.warm.would_keep() {
            return self.commit_and_read(tx).await;
        }
        let conn = tx.commit().await.map_err(self.err("commit"))?;
        if keep_connection {
            self.warm.keep(Kept::Idle(conn));
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
