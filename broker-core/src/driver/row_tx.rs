//! The transaction a row lock delivery holds, on a pooled connection that the strategy keeps
//! for its next claim once the transaction has committed.
//!
//! A sqlx [`Transaction`](sqlx::Transaction) that owns its pooled connection gives the
//! connection back to the pool when it ends, and a pooled connection costs a round trip each
//! way: sqlx pings it when it goes back and, by default, again before it is handed out. A
//! hand-written loop that keeps one connection runs four statements per row (begin, select,
//! delete, commit); a claim that took its connection from the pool each time ran six. So a
//! [`RowTransaction`] begins, commits and rolls back through the database's
//! `TransactionManager`, exactly as sqlx's own transaction does, and hands the connection back
//! to its owner when it commits; [`WarmConnections`] keeps those connections between a
//! settlement and the next claim, and gives them back to the pool once the table looks
//! drained.
//!
//! Where the database can (`COMMIT AND CHAIN` on PostgreSQL 12+ and the MySQL family), a row
//! lock settlement that keeps its connection commits and begins the next transaction in one
//! statement, and keeps the open transaction ([`KeptForClaim::Begun`]): the next claim then
//! runs its select at once, three statements per row where the hand-written loop sends four.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, SqlStr};
use sqlx_core::transaction::TransactionManager;

/// The open transaction of a row lock delivery. It dereferences to the connection, so
/// `&mut **tx` (through a [`TxGuard`](crate::TxGuard) or the `&mut RowTransaction` that
/// [`Delivery::transaction`](crate::Delivery::transaction) gives) is an executor; a nested
/// `begin` on that connection makes a savepoint, as in any sqlx transaction.
///
/// Dropped while open, it rolls back (the rollback is sent before the connection is used
/// again), as a sqlx transaction does.
pub struct RowTransaction<DB: Database> {
    /// `None` once committed or rolled back.
    conn: Option<PoolConnection<DB>>,
}

impl<DB: Database> std::fmt::Debug for RowTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowTransaction")
            .field("open", &self.conn.is_some())
            .finish()
    }
}

impl<DB: Database> RowTransaction<DB> {
    /// Begins a transaction on `conn`, with `statement` in place of `BEGIN` if given (e.g. one
    /// that sets the isolation level). For backends.
    ///
    /// # Errors
    /// The begin statement failed; the connection is dropped (back to the pool, which tests
    /// it).
    pub async fn begin(
        mut conn: PoolConnection<DB>,
        statement: Option<SqlStr>,
    ) -> Result<Self, sqlx::Error> {
        DB::TransactionManager::begin(&mut conn, statement).await?;
        Ok(Self { conn: Some(conn) })
    }

    /// Continues on what a settlement kept: an open transaction as it is, a connection with a
    /// new transaction (`statement` as in [`begin`](Self::begin)). For backends.
    ///
    /// # Errors
    /// The begin statement failed; the connection is dropped (back to the pool, which tests
    /// it).
    pub async fn resume(
        kept: KeptForClaim<DB>,
        statement: Option<SqlStr>,
    ) -> Result<Self, sqlx::Error> {
        match kept {
            KeptForClaim::Begun(tx) => Ok(tx),
            KeptForClaim::Idle(conn) => Self::begin(conn, statement).await,
        }
    }

    /// Commits and hands the connection back. For backends.
    ///
    /// # Errors
    /// The commit failed; the transaction is then rolled back as it drops.
    pub async fn commit(mut self) -> Result<PoolConnection<DB>, sqlx::Error> {
        let conn = self.conn_mut();
        DB::TransactionManager::commit(conn).await?;
        Ok(self
            .conn
            .take()
            .expect("an open transaction has its connection"))
    }

    /// Rolls back and hands the connection back. For backends.
    ///
    /// # Errors
    /// The rollback failed (the connection is then dropped, and the pool tests it).
    pub async fn rollback(mut self) -> Result<PoolConnection<DB>, sqlx::Error> {
        let conn = self.conn_mut();
        DB::TransactionManager::rollback(conn).await?;
        Ok(self
            .conn
            .take()
            .expect("an open transaction has its connection"))
    }

    /// Closes the connection when this drops, instead of giving it back to the pool: a
    /// statement failed and may have left session state behind that the pool must not hand on.
    /// For backends.
    pub fn close_on_drop(&mut self) {
        self.conn_mut().close_on_drop();
    }

    fn conn_mut(&mut self) -> &mut PoolConnection<DB> {
        self.conn
            .as_mut()
            .expect("an open transaction has its connection")
    }
}

impl<DB: Database> Deref for RowTransaction<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &Self::Target {
        self.conn
            .as_ref()
            .expect("an open transaction has its connection")
    }
}

impl<DB: Database> DerefMut for RowTransaction<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.conn_mut()
    }
}

impl<DB: Database> Drop for RowTransaction<DB> {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            // Queued on the connection: sent before its next statement, or by the pool's test
            // as the connection goes back.
            DB::TransactionManager::start_rollback(conn);
        }
    }
}

/// What a row lock strategy keeps between a settlement and its next claim.
#[derive(Debug)]
pub enum KeptForClaim<DB: Database> {
    /// A connection whose transaction committed.
    Idle(PoolConnection<DB>),
    /// The next transaction, begun by the settlement's `COMMIT AND CHAIN`: it holds no row
    /// and no snapshot yet. Dropped, it rolls back on its way to the pool (the pool's test of
    /// the connection sends the rollback).
    Begun(RowTransaction<DB>),
}

/// How long a kept connection may wait for the next claim before it goes back to the pool.
const KEEP_FOR: Duration = Duration::from_millis(250);

/// At most this many connections are kept.
const KEEP_AT_MOST: usize = 64;

/// Connections a strategy keeps between one statement and the next (row lock: between a
/// settlement and the next claim; lease: between claims and acks), so a busy table's
/// statements skip the pool (and its tests) as a hand-written loop does. They go back to the
/// pool when a claim finds nothing (the table looks drained: what settles afterwards goes
/// straight back), when a statement fails (the server may have dropped them all), when they
/// wait longer than a quarter second (a clean-up task looks every quarter second while any is
/// kept), and when a subscription stops.
///
/// Made [`for_pool`](Self::for_pool), a connection is not kept while that pool has none to
/// spare (every connection it may open is open and out): the pool is shared by the broker's
/// subscriptions and the service, and a connection kept for this table's next statement is
/// one another table's statement waits for, a quarter second at a time.
#[derive(Debug)]
pub struct WarmConnections<C> {
    state: Arc<Mutex<Warm<C>>>,
    pool: Option<PoolFull>,
}

/// Whether a pool has no connection to spare now.
#[derive(Clone)]
struct PoolFull(Arc<dyn Fn() -> bool + Send + Sync>);

impl std::fmt::Debug for PoolFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolFull")
    }
}

#[derive(Debug)]
struct Warm<C> {
    idle: Vec<(C, Instant)>,
    /// The last claim found nothing.
    drained: bool,
    /// A clean-up task runs.
    sweeping: bool,
}

impl<C> Default for WarmConnections<C> {
    fn default() -> Self {
        Self {
            state: Arc::new(Mutex::new(Warm {
                idle: Vec::new(),
                drained: false,
                sweeping: false,
            })),
            pool: None,
        }
    }
}

impl<C> WarmConnections<C> {
    /// Connections of `pool`, kept only while it has one to spare: an idle connection, or
    /// room to open one.
    pub fn for_pool<DB: Database>(pool: &Pool<DB>) -> Self {
        let pool = pool.clone();
        Self {
            pool: Some(PoolFull(Arc::new(move || {
                pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections()
            }))),
            ..Self::default()
        }
    }

    /// Whether the pool has no connection to spare now (never, for connections not made
    /// [`for_pool`](Self::for_pool)).
    fn pool_full(&self) -> bool {
        self.pool.as_ref().is_some_and(|full| (full.0)())
    }
}

impl<DB: Database> WarmConnections<PoolConnection<DB>> {
    /// The connection kept last, or one from `pool` (waited for only until a fenced
    /// settlement's deadline, inside one: see [`retry::acquire`](super::retry::acquire)).
    ///
    /// # Errors
    /// The pool's acquire failed.
    pub async fn acquire(&self, pool: &Pool<DB>) -> Result<PoolConnection<DB>, sqlx::Error> {
        match self.take() {
            Some(conn) => Ok(conn),
            None => super::retry::acquire(pool).await,
        }
    }
}

impl<C: Send + 'static> WarmConnections<C> {
    /// The connection kept last, if one is.
    pub fn take(&self) -> Option<C> {
        let (kept, stale) = {
            let mut w = self.lock();
            let stale = w.stale();
            (w.idle.pop().map(|(c, _)| c), stale)
        };
        drop(stale);
        kept
    }

    /// Whether [`keep`](Self::keep) would keep a connection now (it may still not, if a claim
    /// finds the table drained meanwhile).
    pub fn would_keep(&self) -> bool {
        let w = self.lock();
        !w.drained
            && w.idle.len() < KEEP_AT_MOST
            && tokio::runtime::Handle::try_current().is_ok()
            && !self.pool_full()
    }

    /// Keeps a connection whose statement (or transaction) ended well, for the next one;
    /// unless the table looked drained at the last claim, the pool has no connection to spare
    /// (see [`for_pool`](Self::for_pool)), or there is no runtime to give it back later.
    pub fn keep(&self, conn: C) {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let spare = !self.pool_full();
        let (give_back, sweep) = {
            let mut w = self.lock();
            let mut stale = w.stale();
            let mut sweep = false;
            match &runtime {
                Some(_) if spare && !w.drained && w.idle.len() < KEEP_AT_MOST => {
                    w.idle.push((conn, Instant::now()));
                    sweep = !w.sweeping;
                    w.sweeping = true;
                }
                _ => stale.push(conn),
            }
            (stale, sweep)
        };
        drop(give_back);
        if let (true, Some(runtime)) = (sweep, runtime) {
            let state = Arc::downgrade(&self.state);
            runtime.spawn(async move {
                loop {
                    tokio::time::sleep(KEEP_FOR).await;
                    let Some(state) = state.upgrade() else { return };
                    let stale = {
                        let mut w = state.lock().unwrap_or_else(|p| p.into_inner());
                        let stale = w.stale();
                        if w.idle.is_empty() {
                            w.sweeping = false;
                            drop(w);
                            drop(stale);
                            return;
                        }
                        stale
                    };
                    drop(stale);
                }
            });
        }
    }

    /// Records what a claim found: with nothing found, every kept connection goes back to the
    /// pool and so do those that settle until a claim finds a row again.
    pub fn claimed(&self, found: bool) {
        let give_back = {
            let mut w = self.lock();
            w.drained = !found;
            if found {
                Vec::new()
            } else {
                std::mem::take(&mut w.idle)
            }
        };
        drop(give_back);
    }

    /// How many connections are kept now.
    pub fn len(&self) -> usize {
        self.lock().idle.len()
    }

    /// Whether no connection is kept now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// After statements on `conn`: kept for the next ones when they went well (`ok`); when they
    /// failed, it and every kept connection go back to the pool (the server may have dropped
    /// them all). What every backend does around a statement on a kept connection.
    pub fn keep_if(&self, conn: C, ok: bool) {
        if ok {
            self.keep(conn);
        } else {
            drop(conn);
            self.release();
        }
    }

    /// Gives every kept connection back to the pool (a claim failed, or a subscription stops).
    pub fn release(&self) {
        let give_back = std::mem::take(&mut self.lock().idle);
        drop(give_back);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Warm<C>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<C> Warm<C> {
    /// Takes out the connections kept too long (the oldest are first).
    fn stale(&mut self) -> Vec<C> {
        let now = Instant::now();
        let fresh = self
            .idle
            .iter()
            .position(|(_, at)| now.duration_since(*at) < KEEP_FOR)
            .unwrap_or(self.idle.len());
        self.idle.drain(..fresh).map(|(c, _)| c).collect()
    }
}
