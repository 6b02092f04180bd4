//! The signal a running handler gets when its delivery is cancelled (today: when its timeout
//! passes, see [`SubscribeOptions::timeout`](crate::SubscribeOptions::timeout)), and why.
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
/// `#[non_exhaustive]`: an operator's cancel of a running row is planned as another reason, so
/// a `match` needs a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelReason {
    /// The handler ran longer than its timeout. The delivery counts as a failed attempt
    /// whatever the handler returns after this (see docs/timeouts-and-cancelling.md).
    TimedOut {
        /// The timeout that passed.
        after: Duration,
    },
}

impl std::fmt::Display for CancelReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TimedOut { after } => write!(f, "timed out after {after:?}"),
        }
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
}
