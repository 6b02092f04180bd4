//! The claim modes. Each module owns its mode's hold (what keeps a row while its handler
//! runs), claim, settlement, renewal and release on drop; this module only picks the mode a
//! table prepared. The modules import [`crate::inner`] and the driver traits, never each other,
//! deliveries or the engine.

pub(crate) mod advisory;
pub(crate) mod lease;
pub(crate) mod row_lock;

use std::sync::Arc;

use crate::driver::clock;
use crate::driver::{Backend, ClaimedRow, Prepared, RowLockStrategy, Settle};
use crate::error::Result;
use crate::inner::Shared;
use crate::metrics::Counter;

/// A prepared table: what it shares with its deliveries, and its mode's strategy.
pub(crate) struct QueueInner<B: Backend> {
    pub(crate) shared: Arc<Shared<B>>,
    pub(crate) mode: Mode<B>,
}

/// The strategy of a table's mode.
pub(crate) enum Mode<B: Backend> {
    RowLock(Arc<B::RowLock>),
    Lease(lease::LeaseMode<B>),
    Advisory(Arc<B::Advisory>),
}

impl<B: Backend> From<Prepared<B>> for Mode<B> {
    fn from(prepared: Prepared<B>) -> Self {
        match prepared {
            Prepared::RowLock(s) => Self::RowLock(Arc::new(s)),
            Prepared::Lease(s) => Self::Lease(lease::LeaseMode::new(s)),
            Prepared::Advisory(s) => Self::Advisory(Arc::new(s)),
        }
    }
}

/// What holds a claimed row while its handler runs; each mode's hold settles itself.
pub(crate) enum Hold<B: Backend> {
    RowLock(row_lock::TxHold<B>),
    Lease(lease::LeaseHold<B>),
    Key(advisory::KeyHold<B>),
}

impl<B: Backend> QueueInner<B> {
    /// Claims up to `limit` rows in the table's mode, with the hold of each; `for_subscription`
    /// says a subscription's claim loop claims (and claims again once these settle).
    pub(crate) async fn claim(
        &self,
        limit: usize,
        for_subscription: bool,
    ) -> Result<Vec<(ClaimedRow<B::Db>, Hold<B>)>> {
        let now = clock::now_ms();
        let shared = &self.shared;
        let claimed: Vec<_> = match &self.mode {
            Mode::RowLock(s) => {
                let from = shared.head.start();
                row_lock::claim::<B>(s, limit, now, for_subscription, from)
                    .await?
                    .into_iter()
                    .map(|(row, hold)| (row, Hold::RowLock(hold)))
                    .collect()
            }
            Mode::Lease(s) => {
                let from = shared.head.start();
                lease::claim(s, shared, limit, now, from)
                    .await?
                    .into_iter()
                    .map(|(row, hold)| (row, Hold::Lease(hold)))
                    .collect()
            }
            Mode::Advisory(s) => advisory::claim(s, shared, limit, now)
                .await?
                .into_iter()
                .map(|(row, hold)| (row, Hold::Key(hold)))
                .collect(),
        };
        shared.metrics.add(Counter::Claimed, claimed.len() as u64);
        // Advisory claims tell the head what their candidate reads found (its rows may be passed
        // over for held keys); the other modes take the first rows of the claim order.
        if !matches!(self.mode, Mode::Advisory(_))
            && let Some(first) = claimed.iter().map(|(row, _)| row.position()).min()
        {
            shared.head.found(first);
        }
        Ok(claimed)
    }
}

impl<B: Backend> QueueInner<B> {
    /// Gives back what the mode keeps for the next claim (warm connections), as a subscription
    /// stops.
    pub(crate) fn release_kept(&self) {
        match &self.mode {
            Mode::RowLock(s) => s.release_kept(),
            Mode::Lease(s) => s.release_kept(),
            Mode::Advisory(s) => crate::driver::AdvisoryStrategy::release_kept(&**s),
        }
    }

    /// How many connections the mode keeps for the next claim now.
    pub(crate) fn kept(&self) -> usize {
        match &self.mode {
            Mode::RowLock(s) => s.kept(),
            Mode::Lease(s) => s.kept(),
            Mode::Advisory(s) => crate::driver::AdvisoryStrategy::kept(&**s),
        }
    }
}

impl<B: Backend> Hold<B> {
    /// Settles the row by its hold. A settlement that fails is counted against the row (see
    /// [`Shared::settle_failed`]) before the hold gives the row back where the mode gives it
    /// back itself (lease releases it, advisory unlocks its key), so a claim that takes the row
    /// next sees the failure and backs off. Row lock's rollback happens in the backend.
    ///
    /// A settlement cut short (its future dropped while a statement ran: a shutdown's deadline
    /// passed) counts in `settle_failed`, so its row is never in no counter; it may have
    /// landed. Every path above counts its row with no wait after the count, so a cut never
    /// counts a row twice.
    pub(crate) async fn settle(self, settle: Settle, shared: &Shared<B>) -> Result<()> {
        let cut = CutShort {
            shared,
            id: settle.id,
            armed: true,
        };
        let out = match self {
            Hold::RowLock(h) => {
                let out = h.settle(settle).await;
                if let Err(e) = &out {
                    shared.settle_failed(settle.id, e);
                }
                out
            }
            Hold::Lease(h) => h.settle(settle).await,
            Hold::Key(h) => h.settle(settle).await,
        };
        cut.disarm();
        out
    }
}

/// Counts a settlement whose future was dropped before it returned (see [`Hold::settle`]).
struct CutShort<'a, B: Backend> {
    shared: &'a Shared<B>,
    id: i64,
    armed: bool,
}

impl<B: Backend> CutShort<'_, B> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<B: Backend> Drop for CutShort<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            tracing::warn!(
                table = self.shared.name(),
                id = self.id,
                "a settlement was cut short (the shutdown deadline passed); it may have landed, and counts as failed"
            );
            self.shared.metrics.add(Counter::SettleFailed, 1);
        }
    }
}
