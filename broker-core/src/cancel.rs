//! The signal a running handler gets when its delivery is cancelled (when its timeout passes,
//! see [`SubscribeOptions::timeout`](crate::SubscribeOptions::timeout), or when an operator
//! cancels its row, see [`Queue::cancel`](crate::Queue::cancel)), and why.
//!
//! The engine raises the signal, waits the subscription's
//! [`cancel_grace`](crate::SubscribeOptions::cancel_grace) for the handler to return, then
//! drops the handler's future. A handler that watches the signal can stop cleanly (close a
//! file, stop a task it spawned) instead of being cut off at an await point of the engine's
//! choosing.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Why a delivery was cancelled.
///
/// `#[non_exhaustive]`: more reasons may come, so a `match` needs a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelReason {
    /// The handler ran longer than its timeout. The delivery counts as a failed attempt
    /// whatever the handler returns after this (see docs/timeouts-and-cancelling.md).
    TimedOut {
        /// The timeout that passed.
        after: Duration,
    },
    /// An operator cancelled the row ([`Queue::cancel`](crate::Queue::cancel), from this
    /// process or another). The row is deleted whatever the handler returns after this, and
    /// never runs again (see docs/timeouts-and-cancelling.md, "Cancelling a running job").
    Cancelled,
}

impl std::fmt::Display for CancelReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TimedOut { after } => write!(f, "timed out after {after:?}"),
            Self::Cancelled => f.write_str("cancelled by an operator"),
        }
    }
}

/// The cancel requests of one table as one broker knows them, and the signals of the
/// deliveries of that table in work in it: where a request meets its delivery, from whichever
/// side comes second. Every subscription of the table in the broker shares it (it lives in the
/// table's [`Gate`](crate::driver::Gate)).
///
/// Requests come from a cancel through this broker, a `NOTIFY` from another process
/// (PostgreSQL), and the subscriptions' read of the request table once per poll interval.
#[derive(Debug, Default)]
pub(crate) struct CancelBoard {
    inner: std::sync::Mutex<Board>,
}

#[derive(Debug, Default)]
struct Board {
    /// The signals of the deliveries in work, by row id.
    running: std::collections::HashMap<i64, CancelSignal>,
    /// Rows with a cancel request, with the change number at which each was learnt.
    requested: std::collections::HashMap<i64, u64>,
    /// Counts every request learnt; a read of the table that began before one cannot drop it.
    seq: u64,
}

impl CancelBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The change number, read before a read of the request table.
    pub(crate) fn seq(&self) -> u64 {
        self.lock().seq
    }

    /// A delivery of row `id` is about to run its handler, which `signal` reaches: returns
    /// whether a cancel is requested for the row already (then the handler must not start).
    /// Until [`leave`](Self::leave), a request for the row raises the signal.
    pub(crate) fn enter(&self, id: i64, signal: &CancelSignal) -> bool {
        let mut b = self.lock();
        b.running.insert(id, signal.clone());
        b.requested.contains_key(&id)
    }

    /// The delivery of row `id` left work.
    pub(crate) fn leave(&self, id: i64) {
        self.lock().running.remove(&id);
    }

    /// A cancel of row `id` was requested: raises its delivery's signal if one is in work here.
    pub(crate) fn request(&self, id: i64) {
        let mut b = self.lock();
        b.seq += 1;
        let seq = b.seq;
        b.requested.entry(id).or_insert(seq);
        if let Some(signal) = b.running.get(&id) {
            signal.cancel(CancelReason::Cancelled);
        }
    }

    /// The request for row `id` is settled (the row is deleted) or withdrawn.
    pub(crate) fn forget(&self, id: i64) {
        self.lock().requested.remove(&id);
    }

    /// The requests a read of the table found, the read having begun at change `seq`: each is
    /// requested ([`request`](Self::request)); requests the read did not find are forgotten
    /// unless they were learnt after it began (a read is older than a signal it missed).
    pub(crate) fn apply_read(&self, seq: u64, ids: &[i64]) {
        for id in ids {
            self.request(*id);
        }
        let mut b = self.lock();
        b.requested
            .retain(|id, learnt| *learnt > seq || ids.contains(id));
    }

    /// Whether a delivery of row `id` is in work here.
    pub(crate) fn is_running(&self, id: i64) -> bool {
        self.lock().running.contains_key(&id)
    }

    /// Whether a cancel of row `id` is requested, as this broker knows it.
    #[cfg(test)]
    pub(crate) fn is_requested(&self, id: i64) -> bool {
        self.lock().requested.contains_key(&id)
    }
}

/// A delivery's cancel signal, as a cancellation token: [`cancelled`](Self::cancelled)
/// completes once the engine cancels the delivery. Cloning it is cheap, and every clone sees the
/// same signal, so a handler can hand one to a task it spawns
/// ([`Job::cancel_signal`](crate::Job::cancel_signal)).
///
/// ```
/// use broker_core::{Job, Outcome, Payload};
///
/// async fn export(job: Job<Payload<String>>) -> Result<Outcome, std::io::Error> {
///     for _chunk in 0..100 {
///         tokio::select! {
///             reason = job.cancelled() => {
///                 // Stop here; the delivery counts as a failed attempt and is retried.
///                 return Err(std::io::Error::other(reason.to_string()));
///             }
///             _ = tokio::time::sleep(std::time::Duration::from_millis(10)) => {}
///         }
///     }
///     Ok(Outcome::Ack)
/// }
/// # let _ = export;
/// ```
#[derive(Debug, Clone, Default)]
pub struct CancelSignal {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    token: CancellationToken,
    /// Set once, before the token is cancelled, so a handler woken by the token reads it.
    reason: OnceLock<CancelReason>,
}

impl CancelSignal {
    /// A signal not raised yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Raises the signal with `reason`; the first reason stays if it was raised before.
    pub(crate) fn cancel(&self, reason: CancelReason) {
        let _ = self.inner.reason.set(reason);
        self.inner.token.cancel();
    }

    /// Completes, with the reason, once the delivery is cancelled (at once if it already was).
    /// A delivery that is never cancelled never completes it, so use it in a `select!` beside
    /// the work.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it and calling again misses nothing.
    pub async fn cancelled(&self) -> CancelReason {
        self.inner.token.cancelled().await;
        self.reason()
            .expect("the reason is set before the token is cancelled")
    }

    /// Whether the delivery has been cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.inner.token.is_cancelled()
    }

    /// Why the delivery was cancelled, once it has been.
    pub fn reason(&self) -> Option<CancelReason> {
        self.inner.reason.get().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_clone_sees_the_signal_and_its_reason() {
        let signal = CancelSignal::new();
        let clone = signal.clone();
        assert!(!clone.is_cancelled());
        assert_eq!(clone.reason(), None);
        let waiting = tokio::spawn(async move { clone.cancelled().await });
        let reason = CancelReason::TimedOut {
            after: Duration::from_secs(3),
        };
        signal.cancel(reason);
        assert_eq!(waiting.await.unwrap(), reason);
        assert!(signal.is_cancelled());
        assert_eq!(reason.to_string(), "timed out after 3s");
    }

    #[test]
    fn a_request_meets_its_delivery_from_either_side() {
        let board = CancelBoard::default();
        // The delivery first, then the request.
        let running = CancelSignal::new();
        assert!(!board.enter(1, &running));
        board.request(1);
        assert_eq!(running.reason(), Some(CancelReason::Cancelled));
        board.leave(1);
        // The request first: the delivery is told not to start.
        board.request(2);
        assert!(board.enter(2, &CancelSignal::new()));
        board.leave(2);
        // A request for a row not in work here raises nothing.
        let other = CancelSignal::new();
        assert!(!board.enter(3, &other));
        board.request(4);
        assert!(!other.is_cancelled());
    }

    #[test]
    fn a_read_forgets_what_it_did_not_find_unless_it_is_newer_than_the_read() {
        let board = CancelBoard::default();
        board.request(1);
        let seq = board.seq();
        board.request(2);
        board.apply_read(seq, &[3]);
        assert!(
            !board.is_requested(1),
            "settled elsewhere: the read no longer finds it"
        );
        assert!(board.is_requested(2), "learnt after the read began");
        assert!(board.is_requested(3));
        let seq = board.seq();
        board.apply_read(seq, &[]);
        assert!(!board.is_requested(2) && !board.is_requested(3));
    }
}
