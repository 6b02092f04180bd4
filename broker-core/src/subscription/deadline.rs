//! A handler's timeout and an operator's cancel: when the timeout passes (see
//! [`SubscribeOptions::timeout`](super::SubscribeOptions::timeout)) or the job's cancel signal is
//! raised from elsewhere, the signal, then the grace, then the handler's future is given back
//! to the caller to drop.
//!
//! A handler that returns before its timeout costs one timer entry, no task and no allocation
//! beyond the job's signal; without a timeout, a wait on the signal's token.

use std::future::Future;
use std::time::Duration;

use crate::cancel::{CancelReason, CancelSignal};

/// How a handler's run under its timeout ended.
#[derive(Debug)]
pub(super) enum Ran<O, F> {
    /// The handler returned before its timeout and before any cancel.
    Returned(O),
    /// The timeout passed or an operator cancelled the row, and the signal was raised.
    Cancelled {
        /// Why: the timeout that passed, or the operator's cancel.
        reason: CancelReason,
        /// The handler's future, still running when the grace ended; `None` when the handler
        /// returned within the grace (what it returned does not count). The caller drops it,
        /// after looking at what the handler may still hold and before it gives the row back.
        left: Option<F>,
    },
}

/// Runs `handler` for at most `limit` (`None`: as long as it runs) or until `signal` is raised
/// from elsewhere (an operator's cancel), raising it when the limit passes, then gives the
/// handler up to `grace` more to return. A handler whose return is seen before the signal is
/// raised wins: its outcome counts even if the signal is raised right after; one that returns
/// once an operator's cancel was raised (most likely because of it) is cancelled.
pub(super) async fn run<F>(
    mut handler: F,
    limit: Option<Duration>,
    grace: Duration,
    signal: &CancelSignal,
) -> Ran<F::Output, F>
where
    F: Future + Unpin,
{
    let timer = async {
        match limit {
            Some(limit) => tokio::time::sleep(limit).await,
            None => std::future::pending().await,
        }
    };
    let reason = tokio::select! {
        biased;
        out = &mut handler => {
            return match signal.reason() {
                Some(reason @ CancelReason::Cancelled) => Ran::Cancelled { reason, left: None },
                _ => Ran::Returned(out),
            };
        }
        () = timer => {
            let after = limit.expect("the timer runs out only with a limit");
            signal.cancel(CancelReason::TimedOut { after });
            // A cancel raised first keeps its reason.
            signal.reason().expect("just raised")
        }
        reason = signal.cancelled() => reason,
    };
    let left = match tokio::time::timeout(grace, &mut handler).await {
        Ok(_) => None,
        Err(_) => Some(handler),
    };
    Ran::Cancelled { reason, left }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    const LIMIT: Duration = Duration::from_secs(10);
    const GRACE: Duration = Duration::from_secs(2);

    #[tokio::test(start_paused = true)]
    async fn a_handler_that_returns_in_time_is_not_signalled() {
        let signal = CancelSignal::new();
        let ran = run(
            Box::pin(async {
                tokio::time::sleep(Duration::from_secs(9)).await;
                7
            }),
            Some(LIMIT),
            GRACE,
            &signal,
        )
        .await;
        assert!(matches!(ran, Ran::Returned(7)));
        assert!(!signal.is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_that_ignores_the_signal_is_given_back_after_the_grace() {
        let signal = CancelSignal::new();
        let start = Instant::now();
        let ran = run(
            Box::pin(std::future::pending::<()>()),
            Some(LIMIT),
            GRACE,
            &signal,
        )
        .await;
        assert_eq!(start.elapsed(), LIMIT + GRACE);
        match ran {
            Ran::Cancelled { reason, left } => {
                assert_eq!(reason, CancelReason::TimedOut { after: LIMIT });
                assert!(left.is_some(), "still running: given back to be dropped");
            }
            Ran::Returned(()) => panic!("a pending handler cannot return"),
        }
        assert_eq!(
            signal.reason(),
            Some(CancelReason::TimedOut { after: LIMIT })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_that_watches_the_signal_returns_within_the_grace_and_still_timed_out() {
        let signal = CancelSignal::new();
        let watching = signal.clone();
        let start = Instant::now();
        let ran = run(
            Box::pin(async move {
                watching.cancelled().await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }),
            Some(LIMIT),
            GRACE,
            &signal,
        )
        .await;
        assert_eq!(start.elapsed(), LIMIT + Duration::from_millis(500));
        assert!(matches!(ran, Ran::Cancelled { left: None, .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancel_from_elsewhere_stops_a_handler_without_a_timeout_after_the_grace() {
        let signal = CancelSignal::new();
        let raising = signal.clone();
        let start = Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            raising.cancel(CancelReason::Cancelled);
        });
        let ran = run(Box::pin(std::future::pending::<()>()), None, GRACE, &signal).await;
        assert_eq!(start.elapsed(), Duration::from_secs(3) + GRACE);
        match ran {
            Ran::Cancelled { reason, left } => {
                assert_eq!(reason, CancelReason::Cancelled);
                assert!(left.is_some());
            }
            Ran::Returned(()) => panic!("a pending handler cannot return"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_that_returns_on_an_operators_cancel_is_cancelled_not_returned() {
        let signal = CancelSignal::new();
        let (raising, watching) = (signal.clone(), signal.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            raising.cancel(CancelReason::Cancelled);
        });
        let ran = run(
            Box::pin(async move {
                watching.cancelled().await;
                7
            }),
            None,
            GRACE,
            &signal,
        )
        .await;
        assert!(matches!(
            ran,
            Ran::Cancelled {
                reason: CancelReason::Cancelled,
                left: None
            }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancel_before_the_timeout_keeps_its_reason() {
        let signal = CancelSignal::new();
        signal.cancel(CancelReason::Cancelled);
        let ran = run(
            Box::pin(std::future::pending::<()>()),
            Some(LIMIT),
            GRACE,
            &signal,
        )
        .await;
        assert!(matches!(
            ran,
            Ran::Cancelled {
                reason: CancelReason::Cancelled,
                ..
            }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_timeout_a_handler_runs_as_long_as_it_likes() {
        let signal = CancelSignal::new();
        let ran = run(
            Box::pin(async {
                tokio::time::sleep(Duration::from_secs(86_400)).await;
            }),
            None,
            GRACE,
            &signal,
        )
        .await;
        assert!(matches!(ran, Ran::Returned(())));
        assert!(!signal.is_cancelled());
    }
}
