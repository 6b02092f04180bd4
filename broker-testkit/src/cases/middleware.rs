//! Middleware: a tower layer around a subscription's handler sees every job before and after,
//! with its outcome or error (a panic included), and what it returns is what settles the row.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use broker_core::api::{Layer, Service};
use broker_core::{
    BoxError, BoxFuture, ClaimMode, DeadLetter, Job, JobTransaction, NewJob, Outcome,
    SubscribeOptions, handler_service,
};

use crate::{Fixture, TestDb, wait_until};

/// What the recording layer saw: a job going in, and the same job coming out with what its
/// handler ended with (`Err` holds the error's text).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Before(i64, i64),
    After(i64, i64, Result<Outcome, String>),
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// A request that names its job: a plain job, or a job with its transaction.
trait Named {
    fn job_id(&self) -> (i64, i64);
}

impl<T> Named for Job<T> {
    fn job_id(&self) -> (i64, i64) {
        (self.id(), self.attempt())
    }
}

impl<T, B: broker_core::Backend> Named for (Job<T>, JobTransaction<B>) {
    fn job_id(&self) -> (i64, i64) {
        self.0.job_id()
    }
}

/// A layer that records each job before and after its handler.
#[derive(Clone)]
struct Record(Log);

impl<S> Layer<S> for Record {
    type Service = Recording<S>;
    fn layer(&self, inner: S) -> Recording<S> {
        Recording {
            inner,
            log: self.0.clone(),
        }
    }
}

#[derive(Clone)]
struct Recording<S> {
    inner: S,
    log: Log,
}

impl<S, R> Service<R> for Recording<S>
where
    R: Named,
    S: Service<R, Response = Outcome, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Outcome, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let (id, attempt) = request.job_id();
        self.log.lock().unwrap().push(Seen::Before(id, attempt));
        let end = self.inner.call(request);
        let log = self.log.clone();
        Box::pin(async move {
            let result = end.await;
            let seen = result
                .as_ref()
                .map(|o| *o)
                .map_err(std::string::ToString::to_string);
            log.lock().unwrap().push(Seen::After(id, attempt, seen));
            result
        })
    }
}

/// A layer around every handler sees each job go in and come out, with the outcome, the
/// handler's error, or its panic as an error; the subscription still counts the error and the
/// panic as such, and retries both.
pub async fn a_layer_sees_each_job_before_and_after_with_its_outcome_or_error<D: TestDb>(
    mode: ClaimMode,
) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 3).await;
    let log = Log::default();
    let (fails, panics) = (ids[1], ids[2]);
    let sub = q
        .subscribe_layered(
            SubscribeOptions::new()
                .concurrency(2)
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            Record(log.clone()),
            move |job: Job<D::Job>| async move {
                if job.attempt() == 1 && job.id() == fails {
                    return Err::<Outcome, BoxError>("the handler fails".into());
                }
                if job.attempt() == 1 && job.id() == panics {
                    panic!("the handler panics");
                }
                Ok(Outcome::Ack)
            },
        )
        .expect("subscribe");
    wait_until("every row acked", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.metrics().acked == 3 }
    })
    .await;
    let m = sub.metrics();
    assert_eq!(sub.shutdown().await.dropped, 0);
    let log = log.lock().unwrap().clone();
    let mut ends: Vec<_> = log
        .iter()
        .filter(|s| matches!(s, Seen::After(..)))
        .cloned()
        .collect();
    ends.sort_by_key(|s| match s {
        Seen::After(id, attempt, _) => (*id, *attempt),
        Seen::Before(..) => unreachable!(),
    });
    assert_eq!(
        ends,
        vec![
            Seen::After(ids[0], 1, Ok(Outcome::Ack)),
            Seen::After(fails, 1, Err("the handler fails".into())),
            Seen::After(fails, 2, Ok(Outcome::Ack)),
            Seen::After(panics, 1, Err("panic: the handler panics".into())),
            Seen::After(panics, 2, Ok(Outcome::Ack)),
        ],
        "the layer saw every end: {log:?}"
    );
    // Each job went in before it came out.
    for end in &ends {
        let Seen::After(id, attempt, _) = end else {
            unreachable!()
        };
        let before = log.iter().position(|s| *s == Seen::Before(*id, *attempt));
        let after = log.iter().position(|s| s == end);
        assert!(before < after, "row {id} attempt {attempt}: {log:?}");
    }
    assert_eq!(
        (m.handler_errors, m.panics, m.retried, m.acked),
        (1, 1, 2, 3),
        "the error and the panic count as such: {m:?}"
    );
    fx.cleanup().await;
}

/// What a layer returns settles the row: a layer that turns the handler's error into a dead
/// letter dead-letters the row after one attempt, and one that answers without calling the
/// handler acks a row the handler never saw.
pub async fn a_layer_decides_the_outcome_and_may_answer_without_the_handler<D: TestDb>(
    mode: ClaimMode,
) {
    let fx = Fixture::<D>::new(mode, |b| {
        b.max_attempts(5)
            .dead_letter(DeadLetter::Column("dead_at".into()))
    })
    .await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 2).await;
    let (failing, skipped) = (ids[0], ids[1]);
    let ran = Arc::new(Mutex::new(Vec::<i64>::new()));
    let handler = {
        let ran = ran.clone();
        move |job: Job<D::Job>| {
            ran.lock().unwrap().push(job.id());
            async move { Err::<Outcome, BoxError>("the handler always fails".into()) }
        }
    };
    let service = Decide {
        inner: handler_service(handler),
        skip: skipped,
    };
    let sub = q
        .subscribe_service(
            SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
            service,
        )
        .expect("subscribe");
    wait_until(
        "one row dead-lettered and one acked",
        Duration::from_secs(30),
        || {
            let q = q.clone();
            async move {
                let m = q.metrics();
                m.dead_lettered == 1 && m.acked == 1
            }
        },
    )
    .await;
    let m = sub.metrics();
    assert_eq!(sub.shutdown().await.dropped, 0);
    assert_eq!(
        *ran.lock().unwrap(),
        vec![failing],
        "the handler ran once, for the row the layer passed on"
    );
    let state = q
        .row_state(failing)
        .await
        .unwrap()
        .expect("the dead row is kept");
    assert!(
        state.dead,
        "the layer's dead letter settled the row: {state:?}"
    );
    assert!(
        q.row_state(skipped).await.unwrap().is_none(),
        "the row the layer answered for is acked"
    );
    assert_eq!(
        (m.handler_errors, m.retried),
        (0, 0),
        "the engine never saw the handler's error: {m:?}"
    );
    fx.cleanup().await;
}

/// Turns its handler's errors into dead letters, and acks the row `skip` without calling it.
#[derive(Clone)]
struct Decide<S> {
    inner: S,
    skip: i64,
}

impl<S, T> Service<Job<T>> for Decide<S>
where
    S: Service<Job<T>, Response = Outcome, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Outcome, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, job: Job<T>) -> Self::Future {
        if job.id() == self.skip {
            return Box::pin(async { Ok(Outcome::Ack) });
        }
        let end = self.inner.call(job);
        Box::pin(async move { Ok(end.await.unwrap_or(Outcome::DeadLetter)) })
    }
}

/// A service that is not ready yet is a failed attempt when its readiness fails: the row is
/// retried (counted as a handler error) and runs once the service is ready.
pub async fn a_service_whose_readiness_fails_retries_the_row<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let ran = Arc::new(Mutex::new(Vec::<(i64, i64)>::new()));
    let handler = {
        let ran = ran.clone();
        move |job: Job<D::Job>| {
            ran.lock().unwrap().push((job.id(), job.attempt()));
            async { Outcome::Ack }
        }
    };
    let service = FailReadyOnce {
        inner: handler_service(handler),
        failed: Arc::new(AtomicBool::new(false)),
    };
    let sub = q
        .subscribe_service(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            service,
        )
        .expect("subscribe");
    wait_until("the row acked", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.metrics().acked == 1 }
    })
    .await;
    let m = sub.metrics();
    assert_eq!(sub.shutdown().await.dropped, 0);
    assert_eq!(
        *ran.lock().unwrap(),
        vec![(id, 2)],
        "the handler ran once, on the retry"
    );
    assert_eq!((m.handler_errors, m.retried), (1, 1), "{m:?}");
    fx.cleanup().await;
}

/// Fails `poll_ready` once (across its clones), then is its inner service.
#[derive(Clone)]
struct FailReadyOnce<S> {
    inner: S,
    failed: Arc<AtomicBool>,
}

impl<S, R> Service<R> for FailReadyOnce<S>
where
    S: Service<R, Response = Outcome, Error = BoxError>,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if !self.failed.swap(true, Ordering::SeqCst) {
            return Poll::Ready(Err("not ready: the service's backend is down".into()));
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.inner.call(request)
    }
}

/// A row lock handler of the job and its transaction, behind a layer: what it writes through
/// the transaction commits with the ack and rolls back with a retry, as without the layer, and
/// the layer sees both attempts.
pub async fn a_layered_transaction_handler_commits_with_the_ack_only<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::RowLock, |b| b).await;
    let q = fx.queue().await;
    let (side, side_q) = super::settle::side_table(&fx).await;
    let id = fx.publish(&q, 1).await[0];
    let written = Arc::new(Mutex::new(Vec::<(i64, i64)>::new()));
    let log = Log::default();
    let handler = {
        let (side_q, written) = (side_q.clone(), written.clone());
        move |job: Job<D::Job>, tx: JobTransaction<D::B>| {
            let (side_q, written) = (side_q.clone(), written.clone());
            async move {
                let mut tx = tx.get().await?;
                let side_id = side_q
                    .publish_in(&mut **tx, &[NewJob::new(D::Text::from("side".to_owned()))])
                    .await?[0];
                written.lock().unwrap().push((job.attempt(), side_id));
                Ok::<_, BoxError>(if job.attempt() == 1 {
                    Outcome::Retry
                } else {
                    Outcome::Ack
                })
            }
        }
    };
    let sub = q
        .subscribe_service_with_transaction(
            SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
            Record(log.clone()).layer(handler_service(handler)),
        )
        .expect("subscribe");
    wait_until("the row acked", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.metrics().acked == 1 }
    })
    .await;
    assert_eq!(sub.shutdown().await.dropped, 0);
    let ends: Vec<_> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|s| matches!(s, Seen::After(..)))
        .cloned()
        .collect();
    assert_eq!(
        ends,
        vec![
            Seen::After(id, 1, Ok(Outcome::Retry)),
            Seen::After(id, 2, Ok(Outcome::Ack)),
        ]
    );
    let written = written.lock().unwrap().clone();
    assert_eq!(written.len(), 2, "{written:?}");
    for (attempt, side_id) in written {
        let kept = side_q.row_state(side_id).await.unwrap().is_some();
        assert_eq!(
            kept,
            attempt == 2,
            "side row of attempt {attempt}: a retry rolls back, an ack commits"
        );
    }
    fx.broker.drop_tables(&side).await.unwrap();
    fx.cleanup().await;
}
