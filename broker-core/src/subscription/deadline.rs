//! A handler's timeout: when it passes, the job's cancel signal, then the grace, then the
//! handler's future is given back to the caller to drop (see
//! [`SubscribeOptions::timeout`](super::SubscribeOptions::timeout)).
//!
//! A handler that returns before its timeout costs one timer entry (`tokio::time::timeout`),
//! no task and no allocation beyond the job's signal; without a timeout, nothing at all.

use std::future::Future;
use std::time::Duration;

use crate::cancel::{CancelReason, CancelSignal};

/// How a handler's run under its timeout ended.
#[derive(Debug)]
pub(super) enum Ran<O, F> {
    /// The handler returned before its timeout.
    Returned(O),
    /// The timeout passed and the signal was raised.
    TimedOut {
        /// Why: the timeout that passed.
        reason: CancelReason,
        /// The handler's future, still running when the grace ended; `None` when the handler
        /// returned within the grace (what it returned does not count). The caller drops it,
        /// after looking at what the handler may still hold and before it gives the row back.
        left: Option<F>,
    },
}

/// Runs `handler` for at most `limit` (`None`: as long as it runs), then raises `signal` and
/// gives it up to `grace` more to return.
pub(super) async fn run<F>(
    mut handler: F,
    limit: Option<Duration>,
    grace: Duration,
    signal: &CancelSignal,
) -> Ran<F::Output, F>
where
    F: Future + Unpin,
{
    let Some(limit) = limit else {
        return Ran::Returned(handler.await);
    };
    if let Ok(out) = tokio::time::timeout(limit, &mut handler).await {
        return Ran::Returned(out);
    }
    let reason = CancelReason::TimedOut { after: limit };
    signal.cancel(reason);
    let left = match tokio::time::timeout(grace, &mut handler).await {
        Ok(_) => None,
        Err(_) => Some(handler),
    };
    Ran::TimedOut { reason, left }
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
            Ran::TimedOut { reason, left } => {
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
        assert!(matches!(ran, Ran::TimedOut { left: None, .. }));
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
