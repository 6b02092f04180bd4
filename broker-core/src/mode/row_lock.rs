//! Row lock mode: an open transaction holds each claimed row; the settlement runs in it and
//! commits it. A dropped hold rolls the transaction back (the row is due again at once and the
//! attempt is not counted).

use std::sync::Arc;

use crate::driver::{Backend, ClaimedRow, Position, RowLockStrategy, RowTransaction, Settle};
use crate::error::Result;

/// What holds a row lock delivery's row: the claim's open transaction, and whether the
/// handler's writes began in it (see [`RowLockStrategy::begin_writes`]).
pub(crate) struct TxHold<B: Backend> {
    strategy: Arc<B::RowLock>,
    tx: RowTransaction<B::Db>,
    writes_began: bool,
    /// A subscription claimed the row and claims again once it settles: the strategy may keep
    /// the connection for that claim.
    keep_connection: bool,
}

/// Claims up to `limit` rows, one transaction each. `for_subscription`: see
/// [`RowLockStrategy::settle`]'s `keep_connection`.
pub(crate) async fn claim<B: Backend>(
    strategy: &Arc<B::RowLock>,
    limit: usize,
    now_ms: i64,
    for_subscription: bool,
    from: Option<Position>,
) -> Result<Vec<(ClaimedRow<B::Db>, TxHold<B>)>> {
    let mut out = Vec::new();
    while out.len() < limit {
        match strategy.claim(now_ms, from).await? {
            Some((tx, row)) => out.push((
                row,
                TxHold {
                    strategy: strategy.clone(),
                    tx,
                    writes_began: false,
                    keep_connection: for_subscription,
                },
            )),
            None => break,
        }
    }
    Ok(out)
}

impl<B: Backend> TxHold<B> {
    /// The transaction, with the mark where the handler's writes begin set on first use.
    pub(crate) async fn transaction(&mut self) -> Result<&mut RowTransaction<B::Db>> {
        if !self.writes_began {
            self.strategy.begin_writes(&mut self.tx).await?;
            self.writes_began = true;
        }
        Ok(&mut self.tx)
    }

    pub(crate) fn tx(&self) -> &RowTransaction<B::Db> {
        &self.tx
    }

    pub(crate) fn tx_mut(&mut self) -> &mut RowTransaction<B::Db> {
        &mut self.tx
    }

    /// Settles in the transaction and commits it.
    pub(crate) async fn settle(self, settle: Settle) -> Result<()> {
        self.strategy
            .settle(self.tx, settle, self.writes_began, self.keep_connection)
            .await
    }
}
