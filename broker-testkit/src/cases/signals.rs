//! Operator signals (#48): a pause stops handlers from starting, in this broker as soon as it
//! returns and in other brokers at once where the backend pushes signals (PostgreSQL) or
//! within the poll interval; `run_now` starts a scheduled row promptly.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use broker_core::{Backend, ClaimMode, Outcome, Queue, SubscribeOptions, Subscription};

use crate::{Fixture, TestDb, report, wait_until};

/// When each handler started (its first poll), and its row.
type Starts = Arc<Mutex<Vec<(Instant, i64)>>>;

/// A subscription whose handlers record when they start and take `work` each.
fn subscribe_recording<D: TestDb>(
    q: &Queue<D::B, D::Job>,
    options: SubscribeOptions,
    work: Duration,
) -> (Subscription, Starts) {
    let starts: Starts = Arc::default();
    let s = starts.clone();
    let sub = q
        .subscribe(options, move |job: broker_core::Job<D::Job>| {
            let s = s.clone();
            async move {
                s.lock().unwrap().push((Instant::now(), job.id()));
                tokio::time::sleep(work).await;
                Outcome::Ack
            }
        })
        .expect("subscribe");
    (sub, starts)
}

fn started_after(starts: &Starts, at: Instant) -> Vec<Duration> {
    starts
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| *t > at)
        .map(|(t, _)| *t - at)
        .collect()
}

fn count(starts: &Starts) -> usize {
    starts.lock().unwrap().len()
}

/// Waits (bounded) until `n` rows of `q` were acked.
async fn acked<B: broker_core::Backend, T>(q: &Queue<B, T>, n: u64, what: &str) {
    wait_until(what, Duration::from_secs(60), || {
        let acked = q.metrics().acked;
        async move { acked >= n }
    })
    .await;
}

/// Once `pause` returns, no handler of the queue starts in the broker that paused it, although
/// rows are claimed and prefetched (waiting for a slot) when it comes: they wait, holding their
/// claim, and run after the resume. Nothing is lost and nothing runs twice.
pub async fn no_handler_starts_after_a_pause_returns<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let rows = 120;
    fx.publish(&q, rows).await;
    let (sub, starts) = subscribe_recording::<D>(
        &q,
        SubscribeOptions::new()
            .concurrency(4)
            .poll_interval(Duration::from_millis(200)),
        Duration::from_millis(15),
    );
    wait_until("some handlers started", Duration::from_secs(30), || {
        let n = count(&starts);
        async move { n >= 12 }
    })
    .await;
    q.pause("the case").await.expect("pause");
    let paused_at = Instant::now();
    let ran_before = count(&starts);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let late = started_after(&starts, paused_at);
    assert!(
        late.is_empty(),
        "{} handlers started after pause returned (at {late:?} after it), in {mode} mode",
        late.len()
    );
    assert!(
        ran_before < rows,
        "the queue drained before the pause: the case proves nothing"
    );
    q.resume().await.expect("resume");
    acked(&q, rows as u64, "every row acked after the resume").await;
    sub.shutdown().await;
    let starts = starts.lock().unwrap().clone();
    let mut seen = std::collections::HashSet::new();
    for (_, id) in &starts {
        assert!(seen.insert(*id), "row {id} ran twice");
    }
    assert_eq!(seen.len(), rows, "every row ran once");
    fx.cleanup().await;
}

/// A pause through another broker (its own pool) reaches this broker's subscription: at once
/// where the backend pushes signals across processes (PostgreSQL `NOTIFY`; the poll is set far
/// longer than the bound, so only the signal can make it), within the poll interval (plus a
/// margin for a loaded machine) elsewhere. The figure goes to the report.
pub async fn a_pause_through_another_broker_reaches_this_one<D: TestDb>(mode: ClaimMode) {
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let operator = fx.other_queue().await;
    let pushed = fx.broker.backend().capabilities().cross_process_wakeups;
    let (poll, bound) = if pushed {
        (Duration::from_secs(10), Duration::from_secs(1))
    } else {
        let poll = Duration::from_millis(500);
        (poll, 2 * poll + Duration::from_secs(1))
    };
    let rows = 400;
    fx.publish(&q, rows).await;
    let (sub, starts) = subscribe_recording::<D>(
        &q,
        SubscribeOptions::new().concurrency(4).poll_interval(poll),
        Duration::from_millis(25),
    );
    wait_until("some handlers started", Duration::from_secs(30), || {
        let n = count(&starts);
        async move { n >= 12 }
    })
    .await;
    let asked = Instant::now();
    operator.pause("the other broker").await.expect("pause");
    let paused_at = Instant::now();
    // Long enough to see starts that come after the bound.
    tokio::time::sleep(bound + Duration::from_millis(500)).await;
    let late = started_after(&starts, paused_at);
    let last = late.iter().max().copied().unwrap_or_default();
    assert!(
        count(&starts) < rows,
        "the queue drained before the pause took effect: the case proves nothing"
    );
    // Handlers that started while the pause ran (between the call and its return), for the
    // report: how long the last one started after the call.
    let during = started_after(&starts, asked);
    report(&format!(
        "signals: {} {mode}: pause through another broker took {} ms; {} handlers started during the call (the last {} ms after it), {} after it returned (the last {} ms after) (bound {} ms, poll {} ms)",
        fx.broker.backend().capabilities().database,
        (paused_at - asked).as_millis(),
        during.len() - late.len(),
        during
            .iter()
            .filter(|d| **d <= paused_at - asked)
            .max()
            .copied()
            .unwrap_or_default()
            .as_millis(),
        late.len(),
        last.as_millis(),
        bound.as_millis(),
        poll.as_millis(),
    ));
    assert!(
        last <= bound,
        "a handler started {} ms after a pause through another broker returned (bound {} ms)",
        last.as_millis(),
        bound.as_millis()
    );
    wait_until("health to show the pause", Duration::from_secs(10), || {
        let paused = sub.health().paused;
        async move { paused }
    })
    .await;
    operator.resume().await.expect("resume");
    acked(&q, rows as u64, "every row acked after the resume").await;
    sub.shutdown().await;
    fx.cleanup().await;
}

/// `run_now` of a scheduled row on an idle queue starts it promptly: through another broker at
/// once where the backend pushes signals (the poll is far longer than the bound), within the
/// poll interval elsewhere; through the subscription's own broker at once everywhere.
pub async fn run_now_starts_a_scheduled_row_promptly<D: TestDb>(mode: ClaimMode) {
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let operator = fx.other_queue().await;
    let pushed = fx.broker.backend().capabilities().cross_process_wakeups;
    let (poll, bound) = if pushed {
        (Duration::from_secs(10), Duration::from_secs(1))
    } else {
        let poll = Duration::from_millis(500);
        (poll, 2 * poll + Duration::from_secs(1))
    };
    let later = SystemTime::now() + Duration::from_secs(3600);
    let scheduled = |i: usize| {
        let job = fx.job(i).run_at(later);
        q.publish(job)
    };
    let far = scheduled(0).await.expect("publish");
    let near = scheduled(1).await.expect("publish");
    let (sub, starts) = subscribe_recording::<D>(
        &q,
        SubscribeOptions::new().concurrency(2).poll_interval(poll),
        Duration::ZERO,
    );
    // Let the subscription find nothing due and wait for its poll.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(count(&starts), 0, "a scheduled row ran early");
    let db = fx.broker.backend().capabilities().database;
    for (who, queue, id, limit) in [
        ("another broker", &operator, far, bound),
        ("this broker", &q, near, Duration::from_secs(1)),
    ] {
        let before = count(&starts);
        queue.run_now(id).await.expect("run now");
        let asked = Instant::now();
        wait_until(
            &format!("the row made due through {who} to start"),
            limit + Duration::from_secs(10),
            || {
                let n = count(&starts);
                async move { n > before }
            },
        )
        .await;
        let took = starts.lock().unwrap()[before]
            .0
            .saturating_duration_since(asked);
        report(&format!(
            "signals: {db} {mode}: run_now through {who} started the row {} ms later (bound {} ms, poll {} ms)",
            took.as_millis(),
            limit.as_millis(),
            poll.as_millis()
        ));
        assert!(
            took <= limit,
            "run_now through {who} started the row {} ms later (bound {} ms)",
            took.as_millis(),
            limit.as_millis()
        );
    }
    acked(&q, 2, "both rows acked").await;
    sub.shutdown().await;
    fx.cleanup().await;
}

/// A subscription stopped while its queue is paused gives the rows waiting at the gate (claimed
/// or prefetched before the pause, not started) back unrun at once, instead of keeping them
/// until its shutdown deadline; after the resume another subscription runs every row, none
/// twice.
pub async fn a_subscription_stopped_while_paused_gives_its_waiting_rows_back<D: TestDb>(
    mode: ClaimMode,
) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let rows = 40;
    fx.publish(&q, rows).await;
    let options = || {
        SubscribeOptions::new()
            .concurrency(2)
            .poll_interval(Duration::from_millis(200))
            .shutdown_timeout(Duration::from_secs(60))
    };
    let (sub, starts) = subscribe_recording::<D>(&q, options(), Duration::from_millis(200));
    wait_until(
        "the first handlers started",
        Duration::from_secs(30),
        || {
            let n = count(&starts);
            async move { n >= 2 }
        },
    )
    .await;
    q.pause("the case").await.expect("pause");
    let paused_at = Instant::now();
    // The handlers in work finish; rows fetched ahead reach the gate and wait there.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stopping = Instant::now();
    let report = sub.shutdown().await;
    assert!(
        stopping.elapsed() < Duration::from_secs(10),
        "shutdown of a paused subscription took {:?}: it kept rows waiting at the gate until its deadline",
        stopping.elapsed()
    );
    assert_eq!(report.dropped, 0, "no handler was dropped: {report:?}");
    assert!(
        started_after(&starts, paused_at).is_empty(),
        "a handler started after the pause"
    );
    fx.broker.flush_cleanups().await;
    q.resume().await.expect("resume");
    let (again, more) = subscribe_recording::<D>(&q, options(), Duration::ZERO);
    wait_until(
        "every row ran after the resume",
        Duration::from_secs(60),
        || {
            let n = count(&starts) + count(&more);
            async move { n >= rows }
        },
    )
    .await;
    again.shutdown().await;
    let mut seen = std::collections::HashSet::new();
    for (_, id) in starts
        .lock()
        .unwrap()
        .iter()
        .chain(more.lock().unwrap().iter())
    {
        assert!(seen.insert(*id), "row {id} ran twice");
    }
    assert_eq!(seen.len(), rows, "every row ran once");
    fx.cleanup().await;
}

/// Dead letters requeued through another broker run promptly on an idle queue: at once where
/// the backend pushes signals (the poll is far longer than the bound), within the poll interval
/// elsewhere. The figure goes to the report.
pub async fn dead_letters_requeued_through_another_broker_run_promptly<D: TestDb>(mode: ClaimMode) {
    let mut fx = Fixture::<D>::new(mode, |b| {
        b.max_attempts(1)
            .dead_letter(broker_core::DeadLetter::Column("dead_at".into()))
    })
    .await;
    let q = fx.queue().await;
    let operator = fx.other_queue().await;
    let pushed = fx.broker.backend().capabilities().cross_process_wakeups;
    let (poll, bound) = if pushed {
        (Duration::from_secs(10), Duration::from_secs(1))
    } else {
        let poll = Duration::from_millis(500);
        (poll, 2 * poll + Duration::from_secs(1))
    };
    fx.publish(&q, 1).await;
    crate::claim_one(&q)
        .await
        .dead_letter()
        .await
        .expect("dead-letter the row");
    let (sub, starts) = subscribe_recording::<D>(
        &q,
        SubscribeOptions::new().concurrency(2).poll_interval(poll),
        Duration::ZERO,
    );
    // Let the subscription find nothing due and wait for its poll.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(count(&starts), 0, "a dead letter ran");
    let moved = operator
        .requeue_dead(broker_core::DeadLetters::All)
        .await
        .expect("requeue");
    assert_eq!(moved, 1);
    let asked = Instant::now();
    wait_until(
        "the requeued row to start",
        bound + Duration::from_secs(10),
        || {
            let n = count(&starts);
            async move { n > 0 }
        },
    )
    .await;
    let took = starts.lock().unwrap()[0].0.saturating_duration_since(asked);
    report(&format!(
        "signals: {} {mode}: requeue_dead through another broker started the row {} ms later (bound {} ms, poll {} ms)",
        fx.broker.backend().capabilities().database,
        took.as_millis(),
        bound.as_millis(),
        poll.as_millis()
    ));
    assert!(
        took <= bound,
        "requeue_dead through another broker started the row {} ms later (bound {} ms)",
        took.as_millis(),
        bound.as_millis()
    );
    acked(&q, 1, "the requeued row acked").await;
    sub.shutdown().await;
    fx.cleanup().await;
}
