//! The user's handler, boxed once so the engine's tasks can share it, and the catching of its
//! panics (a panicking handler becomes a retry, never a lost worker slot).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::delivery::{Job, JobTransaction, Outcome};
use crate::driver::Backend;

/// A boxed, sendable future, as handlers return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A handler's error: it becomes a retry (with the subscription's backoff), never a lost row.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a handler returns.
pub type HandlerResult = Result<Outcome, BoxError>;

/// What a handler's future may return: an [`Outcome`], or a `Result` of one with any error
/// that converts into [`BoxError`] (an error becomes a retry, with the subscription's backoff).
pub trait IntoOutcome {
    /// The outcome, or the handler's error.
    fn into_outcome(self) -> HandlerResult;
}

impl IntoOutcome for Outcome {
    fn into_outcome(self) -> HandlerResult {
        Ok(self)
    }
}

impl<E: Into<BoxError>> IntoOutcome for Result<Outcome, E> {
    fn into_outcome(self) -> HandlerResult {
        self.map_err(Into::into)
    }
}

type HandlerFn<B, T> =
    dyn Fn(Job<T>, Option<JobTransaction<B>>) -> BoxFuture<'static, HandlerResult> + Send + Sync;

/// The handler, boxed once so the engine's tasks can share it.
pub(crate) struct Handler<B: Backend, T> {
    /// The boxed call: the job, and the lent transaction where the handler takes one.
    pub(super) f: Arc<HandlerFn<B, T>>,
    /// Whether the handler takes the row lock transaction.
    pub(super) lends_transaction: bool,
}

impl<B: Backend, T> Clone for Handler<B, T> {
    fn clone(&self) -> Self {
        Self {
            f: self.f.clone(),
            lends_transaction: self.lends_transaction,
        }
    }
}

impl<B: Backend, T: Send + 'static> Handler<B, T> {
    /// A handler of jobs.
    pub(crate) fn plain<F, Fut>(f: F) -> Self
    where
        F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
    {
        let f = Arc::new(f);
        Self {
            // The call runs inside the boxed future, so a panic in the handler's synchronous
            // part is caught like one in its body.
            f: Arc::new(move |job, _| {
                let f = f.clone();
                Box::pin(async move { f(job).await.into_outcome() })
            }),
            lends_transaction: false,
        }
    }

    /// A handler of jobs and their row lock transaction.
    pub(crate) fn with_transaction<F, Fut>(f: F) -> Self
    where
        F: Fn(Job<T>, JobTransaction<B>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
    {
        let f = Arc::new(f);
        Self {
            f: Arc::new(move |job, tx: Option<JobTransaction<B>>| {
                let f = f.clone();
                Box::pin(async move {
                    let tx = tx.expect("a row lock delivery lends its transaction");
                    f(job, tx).await.into_outcome()
                })
            }),
            lends_transaction: true,
        }
    }
}

/// The text a panic carries, for logs and the row's last error.
pub(super) fn panic_message(panic: &Box<dyn Any + Send>) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Catches a panic inside the handler's future, so a panicking handler becomes a retry and its
/// worker slot survives.
pub(super) struct CatchUnwind<F>(pub(super) F);

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(inner).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
