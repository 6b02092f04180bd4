//! Counters a user can read.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of one queue (shared by every subscription and manual claim on it).
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) claimed: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) lease_lost: AtomicU64,
    pub(crate) in_work: AtomicU64,
    pub(crate) handler_errors: AtomicU64,
    pub(crate) panics: AtomicU64,
    pub(crate) claim_errors: AtomicU64,
    pub(crate) decode_errors: AtomicU64,
    pub(crate) settle_failed: AtomicU64,
    pub(crate) gone: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) batched_acks: AtomicU64,
}

impl Metrics {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            claimed: get(&self.claimed),
            acked: get(&self.acked),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            lease_lost: get(&self.lease_lost),
            in_work: get(&self.in_work),
            handler_errors: get(&self.handler_errors),
            panics: get(&self.panics),
            claim_errors: get(&self.claim_errors),
            decode_errors: get(&self.decode_errors),
            settle_failed: get(&self.settle_failed),
            gone: get(&self.gone),
            released: get(&self.released),
            batched_acks: get(&self.batched_acks),
        }
    }
}

/// A reading of a queue's counters.
///
/// Every claimed row leaves work exactly once, through one of seven counters, so at rest (no
/// subscription running, no manual delivery held):
///
/// `claimed = acked + retried + dead_lettered + lease_lost + gone + settle_failed + released`
///
/// While subscriptions run, the difference is the rows in work ([`in_work`](Self::in_work))
/// and the rows a claim fetched ahead that wait for a free worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Rows handed out by claims.
    pub claimed: u64,
    /// Rows acked.
    pub acked: u64,
    /// Rows put back for another attempt.
    pub retried: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// Settlements refused because the delivery's hold was lost: its lease ran out (lease
    /// mode), or its key's session died and the row was claimed again (advisory mode).
    pub lease_lost: u64,
    /// Deliveries whose handler is running now.
    pub in_work: u64,
    /// Handlers that returned an error.
    pub handler_errors: u64,
    /// Handlers that panicked.
    pub panics: u64,
    /// Claims that failed (the engine retries them).
    pub claim_errors: u64,
    /// Rows whose columns did not decode into the handler's type.
    pub decode_errors: u64,
    /// Settlements that failed for any other reason, e.g. their statement failed (the row was
    /// released). A row whose settlement keeps
    /// failing is backed off and, after three failures in a row, dead-lettered without running
    /// its handler again (see the crate docs, "Settlements that fail").
    pub settle_failed: u64,
    /// Settlements that found their row deleted by something other than the broker while the
    /// delivery held it.
    pub gone: u64,
    /// Rows given back without a settlement: a delivery dropped unsettled (a handler cut by
    /// the shutdown deadline, rows fetched ahead and never run, a manual delivery dropped), a
    /// settlement refused before it ran (no dead-letter target, no due-time column, the broker
    /// closed, the handler kept the transaction). The row is due again as its mode releases it.
    pub released: u64,
    /// Of the acked rows, those acked by a statement that acked others with them (lease mode,
    /// where the backend acks many rows at once: acks that finish close together share one
    /// statement and one commit). Not one of the seven counters above: a part of `acked`.
    pub batched_acks: u64,
}

/// Decrements `in_work` when a delivery leaves work, however it leaves.
pub(crate) struct InWork<'a>(&'a AtomicU64);

impl<'a> InWork<'a> {
    pub(crate) fn enter(counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter)
    }
}

impl Drop for InWork<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
