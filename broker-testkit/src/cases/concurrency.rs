//! Real concurrency: two brokers, several workers, bounded runs.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_core::{ClaimMode, Outcome, Queue, SubscribeOptions, Subscription};

use crate::{Fixture, JobText, TestDb, wait_until};

/// What handlers saw: starts and ends per row, with a check that no row (or key, or group) is
/// in work twice at once.
#[derive(Default)]
struct Log {
    in_work: HashSet<String>,
    overlaps: Vec<String>,
    handled: HashMap<i64, usize>,
    spans: Vec<(String, i64, Instant, Instant)>,
    peak: usize,
}

type Shared = Arc<Mutex<Log>>;

/// Subscribes a handler that marks `lane(row)` in work for `hold`, recording overlaps and
/// intervals, then acks.
fn subscribe_logged<D: TestDb>(
    q: &Queue<D::B, D::Job>,
    log: &Shared,
    concurrency: usize,
    hold: Duration,
    lane: fn(&broker_core::Job<D::Job>) -> String,
) -> Subscription {
    let log = log.clone();
    q.subscribe(
        SubscribeOptions::new()
            .concurrency(concurrency)
            .batch_size(4)
            .poll_interval(Duration::from_millis(50)),
        move |job| {
            let log = log.clone();
            async move {
                let lane = lane(&job);
                let start = Instant::now();
                {
                    let mut l = log.lock().unwrap();
                    if !l.in_work.insert(lane.clone()) {
                        l.overlaps
                            .push(format!("{lane} (row {}) entered twice", job.id()));
                    }
                    l.peak = l.peak.max(l.in_work.len());
                }
                tokio::time::sleep(hold).await;
                let mut l = log.lock().unwrap();
                l.in_work.remove(&lane);
                *l.handled.entry(job.id()).or_default() += 1;
                l.spans.push((lane, job.id(), start, Instant::now()));
                Outcome::Ack
            }
        },
    )
    .expect("subscribe")
}

async fn drain(log: &Shared, n: usize) {
    wait_until(
        &format!("{n} rows handled"),
        Duration::from_secs(60),
        || {
            let log = log.clone();
            async move { log.lock().unwrap().handled.len() >= n }
        },
    )
    .await;
}

/// Two subscriptions on two brokers never hold one row at once, and every row is acked exactly
/// once (240 rows).
pub async fn two_subscriptions_never_hold_one_row<D: TestDb>(mode: ClaimMode) {
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q1 = fx.queue().await;
    let q2 = fx.other_queue().await;
    let ids = fx.publish(&q1, 240).await;
    let log = Shared::default();
    let row = |d: &broker_core::Job<D::Job>| format!("row {}", d.id());
    let s1 = subscribe_logged::<D>(&q1, &log, 4, Duration::from_millis(1), row);
    let s2 = subscribe_logged::<D>(&q2, &log, 4, Duration::from_millis(1), row);
    drain(&log, ids.len()).await;
    s1.shutdown().await;
    s2.shutdown().await;
    let log = std::mem::take(&mut *log.lock().unwrap());
    assert!(log.overlaps.is_empty(), "{:?}", log.overlaps);
    for id in &ids {
        assert_eq!(log.handled.get(id), Some(&1), "row {id} handled once");
    }
    assert_eq!(log.handled.len(), ids.len());
    assert_eq!(q1.metrics().acked + q2.metrics().acked, 240);
    assert!(q1.claim(1).await.unwrap().is_empty());
    fx.cleanup().await;
}

/// Rows with one advisory key never overlap in work, while rows of other keys run side by side
/// (three keys, eight rows each, two brokers).
pub async fn rows_with_one_key_never_overlap_while_other_keys_run<D: TestDb>() {
    let mut fx = Fixture::<D>::new(ClaimMode::Advisory, |b| b).await;
    let q1 = fx.queue().await;
    let q2 = fx.other_queue().await;
    let jobs: Vec<_> = (0..24)
        .map(|i| {
            broker_core::NewJob::new(D::Text::from(format!("job-{i}")))
                .column("k", ["a", "b", "c"][i % 3])
        })
        .collect();
    let ids = q1.publish_batch(&jobs).await.unwrap();
    let log = Shared::default();
    let key = |d: &broker_core::Job<D::Job>| {
        d.key()
            .expect("advisory deliveries carry their key")
            .to_owned()
    };
    let s1 = subscribe_logged::<D>(&q1, &log, 3, Duration::from_millis(30), key);
    let s2 = subscribe_logged::<D>(&q2, &log, 3, Duration::from_millis(30), key);
    drain(&log, ids.len()).await;
    s1.shutdown().await;
    s2.shutdown().await;
    let log = std::mem::take(&mut *log.lock().unwrap());
    assert!(log.overlaps.is_empty(), "{:?}", log.overlaps);
    for k in ["key-a", "key-b", "key-c"] {
        let mut spans: Vec<_> = log.spans.iter().filter(|s| s.0 == k).collect();
        assert_eq!(spans.len(), 8, "{k}");
        spans.sort_by_key(|s| s.2);
        for w in spans.windows(2) {
            assert!(
                w[0].3 <= w[1].2,
                "{k}: rows {} and {} overlap",
                w[0].1,
                w[1].1
            );
        }
    }
    assert!(
        log.peak > 1,
        "other keys ran side by side (peak {})",
        log.peak
    );
    for k in ["key-a", "key-b", "key-c"] {
        assert!(
            !D::key_is_held(&fx.broker, k).await,
            "{k} is free after shutdown"
        );
    }
    fx.cleanup().await;
}

/// No wake-up is lost to a claim already in flight. On a one-group FIFO table with four
/// workers, each settlement frees the next head while the other claim slots' claims run; one
/// that started before the wake-up may come back empty, and must not put the subscription to
/// sleep until the poll (an hour here), or the drain stops short.
pub async fn a_wake_up_during_a_claim_in_flight_is_not_lost<D: TestDb>(mode: ClaimMode) {
    const ROWS: usize = 1500;
    let fx = Fixture::<D>::new(mode, |b| b.group("grp").fifo(true)).await;
    let q = fx.queue().await;
    let jobs: Vec<_> = (0..ROWS).map(|i| fx.job(i).group("one")).collect();
    q.publish_batch(&jobs).await.expect("publish");
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(4)
                .poll_interval(Duration::from_secs(3600)),
            |_job| async { Outcome::Ack },
        )
        .expect("subscribe");
    wait_until(
        "every row of the one group acked with no poll to fall back on",
        Duration::from_secs(90),
        || {
            let acked = q.metrics().acked;
            async move { acked >= ROWS as u64 }
        },
    )
    .await;
    sub.shutdown().await;
    fx.cleanup().await;
}

/// A FIFO group is processed in id order, one row at a time, across two brokers; groups run
/// side by side.
pub async fn fifo_groups_run_in_order_one_at_a_time<D: TestDb>(mode: ClaimMode) {
    let mut fx = Fixture::<D>::new(mode, |b| b.group("grp").fifo(true)).await;
    let q1 = fx.queue().await;
    let q2 = fx.other_queue().await;
    let jobs: Vec<_> = (0..48)
        .map(|i| fx.job(i).group(format!("g{}", i % 4)))
        .collect();
    let ids = q1.publish_batch(&jobs).await.unwrap();
    let log = Shared::default();
    let group = |d: &broker_core::Job<D::Job>| {
        let i: usize = d.payload().text()["job-".len()..].parse().unwrap();
        format!("g{}", i % 4)
    };
    let s1 = subscribe_logged::<D>(&q1, &log, 4, Duration::from_millis(5), group);
    let s2 = subscribe_logged::<D>(&q2, &log, 4, Duration::from_millis(5), group);
    drain(&log, ids.len()).await;
    s1.shutdown().await;
    s2.shutdown().await;
    let log = std::mem::take(&mut *log.lock().unwrap());
    assert!(log.overlaps.is_empty(), "{:?}", log.overlaps);
    for g in 0..4 {
        let lane = format!("g{g}");
        let mut spans: Vec<_> = log.spans.iter().filter(|s| s.0 == lane).collect();
        spans.sort_by_key(|s| s.2);
        let order: Vec<i64> = spans.iter().map(|s| s.1).collect();
        let expected: Vec<i64> = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 4 == g)
            .map(|(_, id)| *id)
            .collect();
        assert_eq!(order, expected, "group {lane} runs in publish order");
    }
    fx.cleanup().await;
}
