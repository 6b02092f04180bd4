//! Handler timeouts ([`SubscribeOptions::timeout`]): the cancel signal, the grace, the drop, and
//! what becomes of the row. A handler's run is tracked by a guard it owns, so a case sees when
//! its future was dropped as well as when it started; no case asserts an upper bound on a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_core::{
    CancelReason, ClaimMode, ColumnType, DeadLetter, NewJob, Outcome, Queue, SubscribeOptions,
    TableDescription,
};

use crate::{Fixture, TestDb, assert_counters_add_up, unique_name, wait_until};

/// One handler run, as its guard saw it.
#[derive(Debug, Clone)]
struct Run {
    attempt: i64,
    started: Instant,
    /// When the cancel signal came, if it did.
    signalled: Option<Instant>,
    /// When the handler's future ended: returned or dropped.
    ended: Option<Instant>,
    /// Whether it returned (rather than being dropped).
    returned: bool,
}

/// Every run of every row, and the overlaps seen: a run that started while another run of its
/// row had not ended.
#[derive(Debug, Default)]
struct Track {
    runs: HashMap<i64, Vec<Run>>,
    in_work: HashMap<i64, usize>,
    overlaps: Vec<String>,
}

type Shared = Arc<Mutex<Track>>;

/// Owned by a handler's future: counts its run in work until the future returns or is dropped.
struct Running {
    track: Shared,
    id: i64,
    index: usize,
}

impl Running {
    /// Notes that a run of row `id` began (and an overlap, if another run of it is in work), and
    /// watches the job's cancel signal.
    fn enter(track: &Shared, job: &broker_core::Job<impl Send>) -> Self {
        let id = job.id();
        let index = {
            let mut t = track.lock().unwrap();
            let n = t.in_work.entry(id).or_default();
            *n += 1;
            if *n > 1 {
                let line = format!(
                    "row {id}: attempt {} started while {} other run(s) of it were in work",
                    job.attempt(),
                    *n - 1
                );
                t.overlaps.push(line);
            }
            let runs = t.runs.entry(id).or_default();
            runs.push(Run {
                attempt: job.attempt(),
                started: Instant::now(),
                signalled: None,
                ended: None,
                returned: false,
            });
            runs.len() - 1
        };
        let signal = job.cancel_signal();
        let watcher = track.clone();
        tokio::spawn(async move {
            signal.cancelled().await;
            watcher.lock().unwrap().runs.get_mut(&id).unwrap()[index].signalled =
                Some(Instant::now());
        });
        Self {
            track: track.clone(),
            id,
            index,
        }
    }

    /// Notes that the handler returns (its future is not dropped midway).
    fn returned(self) {
        self.track.lock().unwrap().runs.get_mut(&self.id).unwrap()[self.index].returned = true;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A case that failed poisons the lock; its handlers still drop quietly.
        let mut t = self.track.lock().unwrap_or_else(|p| p.into_inner());
        *t.in_work.get_mut(&self.id).unwrap() -= 1;
        t.runs.get_mut(&self.id).unwrap()[self.index].ended = Some(Instant::now());
    }
}

fn runs_of(track: &Shared, id: i64) -> Vec<Run> {
    track
        .lock()
        .unwrap()
        .runs
        .get(&id)
        .cloned()
        .unwrap_or_default()
}

/// A handler that ignores its cancel signal is signalled when its timeout passes and dropped
/// once the grace has passed too; the row is retried as a failed attempt, and when its attempts
/// are spent it is dead-lettered with `last_error` reading "timed out after 300ms". The row's
/// next delivery starts only after the timed-out one's future was dropped. `timed_out` counts
/// both, and no handler error or panic is counted.
pub async fn a_hung_handler_is_signalled_then_dropped_after_the_grace_and_retried<D: TestDb>(
    mode: ClaimMode,
) {
    const TIMEOUT: Duration = Duration::from_millis(300);
    const GRACE: Duration = Duration::from_millis(400);
    let fx = Fixture::<D>::new(mode, |b| {
        b.last_error("last_error")
            .max_attempts(2)
            .dead_letter(DeadLetter::Column("dead_at".into()))
    })
    .await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let track = Shared::default();
    let seen = track.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(100))
                .timeout(TIMEOUT)
                .cancel_grace(GRACE)
                .error_backoff(Duration::from_millis(200), Duration::from_millis(200)),
            move |job| {
                let running = Running::enter(&seen, &job);
                async move {
                    // Ignores the signal: only the drop ends it.
                    std::future::pending::<()>().await;
                    running.returned();
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe");
    wait_until("the row dead-lettered", Duration::from_secs(60), || {
        let q = q.clone();
        async move { q.row_state(id).await.unwrap().is_some_and(|r| r.dead) }
    })
    .await;
    assert_eq!(sub.shutdown().await.dropped, 0);

    let runs = runs_of(&track, id);
    assert_eq!(
        runs.iter().map(|r| r.attempt).collect::<Vec<_>>(),
        [1, 2],
        "{runs:?}"
    );
    for run in &runs {
        let signalled = run.signalled.expect("the handler was signalled");
        let ended = run.ended.expect("the handler's future was dropped");
        assert!(!run.returned, "a pending handler cannot return: {run:?}");
        assert!(
            signalled >= run.started + TIMEOUT,
            "signalled only once the timeout passed: {run:?}"
        );
        assert!(
            ended >= signalled + GRACE,
            "dropped only once the grace passed: {run:?}"
        );
    }
    assert!(
        runs[1].started >= runs[0].ended.unwrap(),
        "the next delivery starts after the timed-out one was dropped: {runs:?}"
    );
    let m = q.metrics();
    assert_eq!(
        (
            m.timed_out,
            m.retried,
            m.dead_lettered,
            m.handler_errors,
            m.panics
        ),
        (2, 1, 1, 0, 0),
        "{m:?}"
    );
    let info = q.job(id).await.unwrap().expect("the dead row is kept");
    assert_eq!(info.last_error.as_deref(), Some("timed out after 300ms"));
    assert_counters_add_up(&q);
    fx.cleanup().await;
}

/// A handler that watches [`Job::cancelled`](broker_core::Job::cancelled) sees the reason and
/// returns at once, long before its grace (60 s) would have ended; what it returns (here an ack)
/// does not count: the delivery timed out, and the row runs again.
pub async fn a_handler_that_watches_its_cancel_signal_returns_early_and_still_timed_out<
    D: TestDb,
>(
    mode: ClaimMode,
) {
    const TIMEOUT: Duration = Duration::from_millis(300);
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let track = Shared::default();
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let (seen, told) = (track.clone(), reasons.clone());
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(100))
                .timeout(TIMEOUT)
                .cancel_grace(Duration::from_secs(60))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |job| {
                let running = Running::enter(&seen, &job);
                let told = told.clone();
                async move {
                    if job.attempt() == 1 {
                        let reason = job.cancelled().await;
                        told.lock().unwrap().push((
                            reason,
                            job.is_cancelled(),
                            job.cancel_reason(),
                        ));
                    } else {
                        assert!(!job.is_cancelled() && job.cancel_reason().is_none());
                    }
                    running.returned();
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe");
    // Well under the 60 s grace: only a handler that returned early gets here.
    wait_until("the row acked", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.metrics().acked == 1 }
    })
    .await;
    assert_eq!(sub.shutdown().await.dropped, 0);
    let reason = CancelReason::TimedOut { after: TIMEOUT };
    assert_eq!(*reasons.lock().unwrap(), [(reason, true, Some(reason))]);
    let runs = runs_of(&track, id);
    assert_eq!(
        runs.len(),
        2,
        "the timed-out delivery's ack did not count: {runs:?}"
    );
    assert!(runs.iter().all(|r| r.returned), "{runs:?}");
    assert_eq!(
        runs[1].attempt, 2,
        "the timed-out delivery was an attempt: {runs:?}"
    );
    let m = q.metrics();
    assert_eq!((m.timed_out, m.retried, m.acked), (1, 1, 1), "{m:?}");
    assert!(q.row_state(id).await.unwrap().is_none());
    assert_counters_add_up(&q);
    fx.cleanup().await;
}

/// A second table, for writes a handler makes through its transaction.
async fn side_table<D: TestDb>(fx: &Fixture<D>) -> (TableDescription, Queue<D::B, D::Job>) {
    let side = TableDescription::builder(unique_name("side"))
        .payload("payload", ColumnType::Text)
        .build()
        .unwrap();
    fx.broker.create_tables(&side).await.unwrap();
    let side_q = fx.broker.queue::<D::Job>(side.clone()).await.unwrap();
    (side, side_q)
}

/// Row lock: what a timed-out handler wrote through its transaction rolls back with the retry
/// (the timeout never commits it), and the retry counts the attempt. `hold_guard`: the handler
/// keeps its transaction borrowed while it hangs (it could be mid-statement), so the engine
/// closes the transaction's connection instead of settling through it: the row is released
/// unsettled, its attempt not counted, as when a process dies.
async fn timed_out_transaction_case<D: TestDb>(hold_guard: bool) {
    let fx = Fixture::<D>::new(ClaimMode::RowLock, |b| b).await;
    let q = fx.queue().await;
    let (side, side_q) = side_table(&fx).await;
    let id = fx.publish(&q, 1).await[0];
    let track = Shared::default();
    // (attempt, side row written)
    let written = Arc::new(Mutex::new(Vec::<(i64, i64)>::new()));
    let sub = {
        let (seen, written, side_q) = (track.clone(), written.clone(), side_q.clone());
        q.subscribe_with_transaction(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(100))
                .timeout(Duration::from_millis(300))
                .cancel_grace(Duration::from_millis(100))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |job, tx| {
                let running = Running::enter(&seen, &job);
                let (written, side_q) = (written.clone(), side_q.clone());
                async move {
                    let mut guard = tx.get().await?;
                    let text = format!("row {} run {}", job.id(), running.index);
                    let side_id = side_q
                        .publish_in(&mut **guard, &[NewJob::new(D::Text::from(text))])
                        .await?[0];
                    written.lock().unwrap().push((job.attempt(), side_id));
                    if running.index == 0 {
                        if !hold_guard {
                            drop(guard);
                            // The signal reaches a handler that took the transaction too; this
                            // one sees it, then ignores it.
                            let reason = job.cancelled().await;
                            assert!(matches!(reason, CancelReason::TimedOut { .. }));
                        }
                        std::future::pending::<()>().await;
                    }
                    running.returned();
                    Ok::<_, broker_core::BoxError>(Outcome::Ack)
                }
            },
        )
        .expect("subscribe")
    };
    wait_until("the row acked", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.metrics().acked == 1 }
    })
    .await;
    assert_eq!(sub.shutdown().await.dropped, 0);
    let written = written.lock().unwrap().clone();
    let runs = runs_of(&track, id);
    assert_eq!(written.len(), 2, "{written:?} {runs:?}");
    // Held guard: released unsettled, so the attempt was not counted.
    let second_attempt = if hold_guard { 1 } else { 2 };
    assert_eq!(
        runs.iter().map(|r| r.attempt).collect::<Vec<_>>(),
        [1, second_attempt],
        "{runs:?}"
    );
    assert!(
        runs[1].started >= runs[0].ended.expect("dropped"),
        "{runs:?}"
    );
    assert!(runs[0].signalled.is_some() && !runs[0].returned, "{runs:?}");
    let (_, timed_out_write) = written[0];
    let (_, acked_write) = written[1];
    assert!(
        side_q.row_state(timed_out_write).await.unwrap().is_none(),
        "the timed-out handler's write rolled back"
    );
    assert!(
        side_q.row_state(acked_write).await.unwrap().is_some(),
        "the acking handler's write committed"
    );
    let m = q.metrics();
    let (retried, released) = if hold_guard { (0, 1) } else { (1, 0) };
    assert_eq!(
        (m.timed_out, m.retried, m.released, m.acked),
        (1, retried, released, 1),
        "{m:?}"
    );
    assert_counters_add_up(&q);
    fx.broker.drop_tables(&side).await.unwrap();
    fx.cleanup().await;
}

/// Row lock: a timed-out handler's writes through its transaction roll back, and the row is
/// retried as a failed attempt.
pub async fn a_timed_out_handlers_transaction_writes_roll_back<D: TestDb>() {
    timed_out_transaction_case::<D>(false).await;
}

/// Row lock: a handler that times out while it holds its transaction (it may be
/// mid-statement) has the transaction's connection closed rather than reused: its writes roll
/// back and the row is released unsettled, its attempt not counted.
pub async fn a_handler_timed_out_holding_its_transaction_has_the_connection_closed<D: TestDb>() {
    timed_out_transaction_case::<D>(true).await;
}

/// Three brokers drain 16 rows whose first delivery hangs ignoring its signal, whose second
/// returns on its signal, and whose third acks: no row's deliveries ever overlap, though every
/// timed-out row is due again at once (no backoff) and other brokers claim all the time.
pub async fn a_timed_out_delivery_and_the_rows_next_delivery_never_overlap<D: TestDb>(
    mode: ClaimMode,
) {
    const ROWS: usize = 16;
    let mut fx = Fixture::<D>::new(mode, |b| b.last_error("last_error")).await;
    let queues = vec![
        fx.queue().await,
        fx.other_queue().await,
        fx.other_queue().await,
    ];
    let ids = fx.publish(&queues[0], ROWS).await;
    let track = Shared::default();
    let mut subs = Vec::new();
    for q in &queues {
        let seen = track.clone();
        let sub = q
            .subscribe(
                SubscribeOptions::new()
                    .concurrency(4)
                    .poll_interval(Duration::from_millis(50))
                    .timeout(Duration::from_millis(200))
                    .cancel_grace(Duration::from_millis(150))
                    .error_backoff(Duration::ZERO, Duration::ZERO),
                move |job| {
                    let running = Running::enter(&seen, &job);
                    async move {
                        match running.index {
                            0 => std::future::pending::<()>().await,
                            1 => {
                                job.cancelled().await;
                            }
                            _ => {}
                        }
                        running.returned();
                        Outcome::Ack
                    }
                },
            )
            .expect("subscribe");
        subs.push(sub);
    }
    wait_until("every row acked", Duration::from_secs(120), || {
        let queues = queues.clone();
        async move { queues.iter().map(|q| q.metrics().acked).sum::<u64>() == ROWS as u64 }
    })
    .await;
    for sub in subs {
        assert_eq!(sub.shutdown().await.dropped, 0);
    }
    {
        let t = track.lock().unwrap();
        assert!(
            t.overlaps.is_empty(),
            "deliveries overlapped: {:?}",
            t.overlaps
        );
        for id in &ids {
            let runs = &t.runs[id];
            assert_eq!(runs.len(), 3, "row {id}: {runs:?}");
            assert!(
                !runs[0].returned && runs[1].returned && runs[2].returned,
                "row {id}: {runs:?}"
            );
            for pair in runs.windows(2) {
                assert!(
                    pair[1].started >= pair[0].ended.expect("ended"),
                    "row {id}: a delivery started before the last one ended: {runs:?}"
                );
            }
        }
    }
    let timed_out: u64 = queues.iter().map(|q| q.metrics().timed_out).sum();
    assert_eq!(timed_out, 2 * ROWS as u64);
    for q in &queues {
        assert_counters_add_up(q);
    }
    fx.cleanup().await;
}

/// A job's own timeout (its row's job timeout column, written by `NewJob::timeout`) applies in
/// place of the subscription's, longer or shorter: of three rows whose handlers sleep 600 ms on
/// their first delivery, under a subscription timeout of 300 ms, the row with its own 200 ms
/// and the row with none time out, and the row with its own 60 s acks on its first delivery.
pub async fn a_jobs_own_timeout_applies_in_place_of_the_subscriptions<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b.job_timeout("timeout_ms")).await;
    let q = fx.queue().await;
    let jobs = [
        fx.job(0).timeout(Duration::from_millis(200)),
        fx.job(1).timeout(Duration::from_secs(60)),
        fx.job(2),
    ];
    let ids = q.publish_batch(&jobs).await.expect("publish");
    let runs: Arc<Mutex<HashMap<i64, Vec<i64>>>> = Arc::default();
    let seen = runs.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(3)
                .poll_interval(Duration::from_millis(100))
                .error_backoff(Duration::ZERO, Duration::ZERO)
                .timeout(Duration::from_millis(300))
                .cancel_grace(Duration::from_millis(50)),
            move |job| {
                seen.lock()
                    .unwrap()
                    .entry(job.id())
                    .or_default()
                    .push(job.attempt());
                async move {
                    if job.attempt() == 1 {
                        tokio::time::sleep(Duration::from_millis(600)).await;
                    }
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe");
    wait_until("three acks", Duration::from_secs(30), || {
        let acked = sub.metrics().acked;
        async move { acked >= 3 }
    })
    .await;
    let m = sub.metrics();
    sub.shutdown().await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(
        runs[&ids[0]],
        [1, 2],
        "its own 200 ms timed it out: {runs:?}"
    );
    assert_eq!(runs[&ids[1]], [1], "its own 60 s let it finish: {runs:?}");
    assert_eq!(
        runs[&ids[2]],
        [1, 2],
        "the subscription's 300 ms timed it out: {runs:?}"
    );
    assert_eq!(m.timed_out, 2, "{m:?}");
    fx.cleanup().await;
}

/// A job timeout on a table without the column is refused at publish, saying what to add.
pub async fn a_job_timeout_without_its_column_is_refused_with_what_to_add<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    let e = q
        .publish(fx.job(0).timeout(Duration::from_secs(1)))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains(".job_timeout("), "{e}");
    assert_eq!(q.stats().await.unwrap().due.rows, 0, "nothing published");
    fx.cleanup().await;
}
