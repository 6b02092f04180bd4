//! The user's handler, boxed once so the engine's tasks can share it, and the catching of its
//! panics (a panicking handler becomes a retry, never a lost worker slot). A handler may also
//! be a tower [`Service`] of jobs, which is how middleware wraps it (see [`HandlerService`]).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tower_service::Service;

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

/// What one job may take, decided per job before its handler runs: what a job kind sets in
/// place of the subscription's timeout and the table's max attempts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The handler's timeout, in place of [`SubscribeOptions::timeout`](super::SubscribeOptions::timeout).
    pub(crate) timeout: Option<std::time::Duration>,
    /// The deliveries after which the row, failing, is dead-lettered, in place of the table's.
    pub(crate) max_attempts: Option<u32>,
}

type LimitsFn<T> = dyn Fn(&mut T) -> Limits + Send + Sync;

/// The handler, boxed once so the engine's tasks can share it.
pub(crate) struct Handler<B: Backend, T> {
    /// The boxed call: the job, and the lent transaction where the handler takes one.
    pub(super) f: Arc<HandlerFn<B, T>>,
    /// Whether the handler takes the row lock transaction.
    pub(super) lends_transaction: bool,
    /// The limits of each job, read from its row before its handler runs (it may keep what it
    /// read in the row for the handler); `None`: the subscription's and the table's.
    pub(super) limits: Option<Arc<LimitsFn<T>>>,
}

impl<B: Backend, T> Clone for Handler<B, T> {
    fn clone(&self) -> Self {
        Self {
            f: self.f.clone(),
            lends_transaction: self.lends_transaction,
            limits: self.limits.clone(),
        }
    }
}

impl<B: Backend, T> Handler<B, T> {
    /// This handler, with limits read from each job's row.
    pub(crate) fn with_limits(
        mut self,
        limits: impl Fn(&mut T) -> Limits + Send + Sync + 'static,
    ) -> Self {
        self.limits = Some(Arc::new(limits));
        self
    }

    /// The limits of one job (the defaults when the handler sets none).
    pub(super) fn limits_of(&self, row: &mut T) -> Limits {
        self.limits.as_ref().map(|f| f(row)).unwrap_or_default()
    }
}

/// A handler error after which trying again cannot help: the row is dead-lettered at once,
/// whatever attempts it has left, with this error as its last error where the table keeps one.
/// A handler returns it as its error (`Err(Unrecoverable::new(..).into())`, or with `?` from a
/// function whose error type is [`BoxError`]); job kinds return it for arguments that do not
/// decode into the kind's type.
#[derive(Debug)]
pub struct Unrecoverable(pub BoxError);

impl Unrecoverable {
    /// Wraps the error that makes the job hopeless.
    pub fn new(error: impl Into<BoxError>) -> Self {
        Self(error.into())
    }
}

impl std::fmt::Display for Unrecoverable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Unrecoverable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
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
            limits: None,
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
            limits: None,
        }
    }
}

impl<B: Backend, T: Send + 'static> Handler<B, T> {
    /// A handler that is a tower service of jobs, middleware and all.
    pub(crate) fn service<S>(service: S) -> Self
    where
        S: Service<Job<T>, Response = Outcome> + Clone + Send + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        let service = Shared::new(service);
        Self {
            f: Arc::new(move |job, _| {
                let service = service.clone();
                Box::pin(async move { service.ready_then_call(job).await })
            }),
            lends_transaction: false,
            limits: None,
        }
    }

    /// A handler that is a tower service of a job and its row lock transaction.
    pub(crate) fn service_with_transaction<S>(service: S) -> Self
    where
        S: Service<(Job<T>, JobTransaction<B>), Response = Outcome> + Clone + Send + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        let service = Shared::new(service);
        Self {
            f: Arc::new(move |job, tx: Option<JobTransaction<B>>| {
                let service = service.clone();
                Box::pin(async move {
                    let tx = tx.expect("a row lock delivery lends its transaction");
                    service.ready_then_call((job, tx)).await
                })
            }),
            lends_transaction: true,
            limits: None,
        }
    }
}

/// A service the engine's tasks share: each delivery clones its own copy, as tower's contract
/// asks (a service is readied and called by one caller), under a lock that makes a `Send`
/// service shareable without asking it to be `Sync` (tower's boxed services are not).
struct Shared<S>(Arc<Mutex<S>>);

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S: Clone> Shared<S> {
    fn new(service: S) -> Self {
        Self(Arc::new(Mutex::new(service)))
    }

    /// Waits until a copy of the service is ready, then calls it. Runs inside the handler's
    /// boxed future, so a panic in the service's `clone`, `poll_ready` or `call` is caught like
    /// one in a handler's body.
    async fn ready_then_call<R>(&self, request: R) -> HandlerResult
    where
        S: Service<R, Response = Outcome>,
        S::Error: Into<BoxError>,
    {
        let mut service = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        std::future::poll_fn(|cx| service.poll_ready(cx))
            .await
            .map_err(Into::into)?;
        service.call(request).await.map_err(Into::into)
    }
}

/// A handler function as a tower [`Service`], so middleware can wrap it: a
/// [`Layer`](tower_layer::Layer) (tower's own, or one of the ecosystem's) applied to it makes
/// the service [`Queue::subscribe_service`](crate::Queue::subscribe_service) runs, and
/// [`Queue::subscribe_layered`](crate::Queue::subscribe_layered) does both in one call.
///
/// The service's request is the [`Job`] (or, for a handler of a row lock transaction, the job
/// and its [`JobTransaction`]), its response the [`Outcome`], its error a [`BoxError`]. A
/// panic in the handler reaches the layers around it as a [`HandlerPanicked`] error, so a
/// layer sees every way a handler can end; the subscription still counts it as a panic.
///
/// ```
/// use broker_core::{BoxError, HandlerService, Job, Outcome, Payload, handler_service};
/// use tower_service::Service;
///
/// async fn handle(job: Job<Payload<String>>) -> Result<Outcome, BoxError> {
///     Ok(Outcome::Ack)
/// }
/// let service: HandlerService<_> = handler_service(handle);
/// fn is_a_service<S: Service<Job<Payload<String>>>>(_: &S) {}
/// is_a_service(&service);
/// ```
pub struct HandlerService<F> {
    f: Arc<F>,
}

impl<F> Clone for HandlerService<F> {
    fn clone(&self) -> Self {
        Self { f: self.f.clone() }
    }
}

impl<F> std::fmt::Debug for HandlerService<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerService").finish_non_exhaustive()
    }
}

/// Makes a handler function a [`HandlerService`], for middleware to wrap: the same functions
/// [`Queue::subscribe`](crate::Queue::subscribe) and
/// [`Queue::subscribe_with_transaction`](crate::Queue::subscribe_with_transaction) take.
pub fn handler_service<F>(f: F) -> HandlerService<F> {
    HandlerService { f: Arc::new(f) }
}

impl<T, F, Fut> Service<Job<T>> for HandlerService<F>
where
    T: Send + 'static,
    F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: IntoOutcome,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = BoxFuture<'static, HandlerResult>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, job: Job<T>) -> Self::Future {
        let f = self.f.clone();
        caught(async move { f(job).await.into_outcome() })
    }
}

impl<B, T, F, Fut> Service<(Job<T>, JobTransaction<B>)> for HandlerService<F>
where
    B: Backend,
    T: Send + 'static,
    F: Fn(Job<T>, JobTransaction<B>) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: IntoOutcome,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = BoxFuture<'static, HandlerResult>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, (job, tx): (Job<T>, JobTransaction<B>)) -> Self::Future {
        let f = self.f.clone();
        caught(async move { f(job, tx).await.into_outcome() })
    }
}

/// Runs a handler's future, a panic in it (or in the call that made it) becoming a
/// [`HandlerPanicked`] error.
fn caught(
    handler: impl Future<Output = HandlerResult> + Send + 'static,
) -> BoxFuture<'static, HandlerResult> {
    Box::pin(async move {
        match CatchUnwind(Box::pin(handler)).await {
            Ok(result) => result,
            Err(panic) => Err(HandlerPanicked {
                message: panic_message(&panic).to_owned(),
            }
            .into()),
        }
    })
}

/// The error a [`HandlerService`] returns for a handler that panicked, so the layers around it
/// see the panic as an error. The subscription counts it as a panic (the `panics` counter) and
/// writes `panic: <message>` as the row's last error, as for a handler subscribed without
/// middleware.
#[derive(Debug)]
pub struct HandlerPanicked {
    message: String,
}

impl HandlerPanicked {
    /// The text the panic carried (`(no message)` when it was not a string).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for HandlerPanicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "panic: {}", self.message)
    }
}

impl std::error::Error for HandlerPanicked {}

/// The text a panic carries, for logs and the row's last error.
pub(crate) fn panic_message(panic: &Box<dyn Any + Send>) -> &str {
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
