//! Lease mode: an expiry in `locked_until` holds each claimed row. The token (expiry and
//! attempt) fences every settlement and renewal; renewal moves it forward. A dropped hold gives
//! the row back at once in a clean-up task (without a runtime the lease runs out).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::driver::clock;
use crate::driver::{Action, Backend, ClaimedRow, LeaseStrategy, LeaseToken, Settle};
use crate::error::{Result, SqlxBrokerError};
use crate::inner::Shared;

/// A lease token that renewal can move while the handler runs.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    token: Mutex<LeaseToken>,
    lost: AtomicBool,
}

impl LeaseCell {
    fn new(token: LeaseToken) -> Self {
        Self {
            token: Mutex::new(token),
            lost: AtomicBool::new(false),
        }
    }
    pub(crate) fn token(&self) -> LeaseToken {
        *self.token.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn set(&self, token: LeaseToken) {
        *self.token.lock().unwrap_or_else(|p| p.into_inner()) = token;
    }
    /// The settlement that gives the row back, due at once, while it still holds this lease.
    fn release(&self, id: i64) -> Settle {
        Settle {
            id,
            action: Action::Retry { due_ms: None },
            now_ms: clock::now_ms(),
            attempt: self.token().attempt,
        }
    }
    fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// What holds a lease delivery's row. Renewal shares the cell; dropping the hold unsettled
/// releases the lease.
pub(crate) struct LeaseHold<B: Backend> {
    strategy: Arc<B::Lease>,
    shared: Arc<Shared<B>>,
    id: i64,
    cell: Arc<LeaseCell>,
    /// Whether the row still needs giving back when the hold drops.
    armed: bool,
}

/// Claims up to `limit` rows in one statement, each with its lease.
pub(crate) async fn claim<B: Backend>(
    strategy: &Arc<B::Lease>,
    shared: &Arc<Shared<B>>,
    limit: usize,
    now_ms: i64,
) -> Result<Vec<(ClaimedRow<B::Db>, LeaseHold<B>)>> {
    let expires_ms = clock::lease_expiry_ms(now_ms, shared.table.lease_seconds());
    let rows = strategy.claim(limit, now_ms, expires_ms).await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let token = LeaseToken {
                expires_ms,
                attempt: row.attempt + 1,
            };
            let hold = LeaseHold {
                strategy: strategy.clone(),
                shared: shared.clone(),
                id: row.id,
                cell: Arc::new(LeaseCell::new(token)),
                armed: true,
            };
            (row, hold)
        })
        .collect())
}

impl<B: Backend> LeaseHold<B> {
    pub(crate) fn cell(&self) -> &Arc<LeaseCell> {
        &self.cell
    }

    /// Settles while the row still holds the lease; [`SqlxBrokerError::LeaseLost`] (or
    /// `RowGone`) and nothing changed when it does not.
    pub(crate) async fn settle(mut self, settle: Settle) -> Result<()> {
        self.armed = false;
        let token = self.cell.token();
        match self.strategy.settle(token, settle).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.shared.lost(settle.id).await),
            Err(e) => {
                // The row still holds this lease: give it back now, as a dropped delivery's
                // is, instead of leaving it until the lease runs out (its next delivery backs
                // off). A release that fails too leaves the lease to run out.
                if let Err(r) = self
                    .strategy
                    .settle(token, self.cell.release(self.id))
                    .await
                {
                    tracing::warn!(table = self.shared.name(), id = self.id, error = %r, "release after a failed settlement failed; the lease runs out instead");
                }
                Err(e)
            }
        }
    }
}

/// Moves the lease forward from the token the cell holds; marks the cell lost when the row no
/// longer holds it.
pub(crate) async fn renew<B: Backend>(
    strategy: &B::Lease,
    shared: &Shared<B>,
    id: i64,
    cell: &LeaseCell,
) -> Result<()> {
    if cell.is_lost() {
        return Err(SqlxBrokerError::LeaseLost {
            table: shared.name().to_owned(),
            id,
        });
    }
    let token = cell.token();
    let expires_ms = clock::lease_expiry_ms(clock::now_ms(), shared.table.lease_seconds());
    if expires_ms == token.expires_ms {
        return Ok(());
    }
    if strategy.renew(id, token, expires_ms).await? {
        cell.set(LeaseToken {
            expires_ms,
            attempt: token.attempt,
        });
        Ok(())
    } else {
        cell.mark_lost();
        Err(shared.lost(id).await)
    }
}

impl<B: Backend> LeaseHold<B> {
    /// A renewer for the engine's renewal loop, which runs beside the handler.
    pub(crate) fn renewer(&self) -> Renewer<B> {
        Renewer {
            strategy: self.strategy.clone(),
            shared: self.shared.clone(),
            id: self.id,
            cell: self.cell.clone(),
        }
    }
}

/// What the engine's renewal loop needs of a lease hold.
pub(crate) struct Renewer<B: Backend> {
    strategy: Arc<B::Lease>,
    shared: Arc<Shared<B>>,
    id: i64,
    cell: Arc<LeaseCell>,
}

impl<B: Backend> Renewer<B> {
    pub(crate) async fn renew(&self) -> Result<()> {
        renew(&*self.strategy, &self.shared, self.id, &self.cell).await
    }
    pub(crate) fn is_lost(&self) -> bool {
        self.cell.is_lost()
    }
}

impl<B: Backend> Drop for LeaseHold<B> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let strategy = self.strategy.clone();
        let shared = self.shared.clone();
        let cell = self.cell.clone();
        let id = self.id;
        self.shared.broker.spawn_cleanup(async move {
            if let Err(e) = strategy.settle(cell.token(), cell.release(id)).await {
                tracing::warn!(table = shared.name(), id, error = %e, "release of a dropped lease failed; it runs out instead");
            }
        });
    }
}
