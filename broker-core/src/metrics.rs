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
        }
    }
}

/// A reading of a queue's counters.
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
    /// Settlements refused because the lease ran out.
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
    /// Settlements whose statement failed (the row was released). A row whose settlement keeps
    /// failing is backed off and, after three failures in a row, dead-lettered without running
    /// its handler again (see the crate docs, "Settlements that fail").
    pub settle_failed: u64,
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
