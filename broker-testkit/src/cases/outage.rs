//! A server that goes away and does not come back in time: what a subscription does then is
//! bounded by its own deadlines, never by the pool's acquire timeout (sqlx keeps reconnecting to
//! a refused port for 30 s). The server is taken away behind a proxy ([`Outage`]), so other
//! tests go on using it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use broker_core::{Backend, ClaimMode, MetricsSnapshot, Outcome, Queue, SubscribeOptions};

use crate::outage::Outage;
use crate::{Fixture, TestDb, wait_until};

/// The rows a reading counts as having left work, through the nine counters.
fn counted_out(m: &MetricsSnapshot) -> u64 {
    m.acked
        + m.retried
        + m.cancelled
        + m.snoozed
        + m.dead_lettered
        + m.lease_lost
        + m.gone
        + m.settle_failed
        + m.released
}

/// Reads `q`'s counters every 5 ms until stopped, and fails at the first reading in which a
/// claimed row is in no counter and not held.
fn watch_counters<B: Backend, T: 'static>(
    q: &Queue<B, T>,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<u64>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (q, stopped) = (q.clone(), stop.clone());
    let task = tokio::spawn(async move {
        let mut readings = 0;
        while !stopped.load(Ordering::SeqCst) {
            let m = q.metrics();
            assert!(
                m.claimed <= counted_out(&m) + m.held,
                "a claimed row was in no counter and not held: {m:?}"
            );
            readings += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        readings
    });
    (stop, task)
}

/// The server goes away while handlers run, rows wait for a worker and claims are in flight;
/// the shutdown that follows returns within its deadline (it would wait for the pool's 30 s
/// acquire timeout, and then for releases that keep trying, without one), and every claimed
/// row is in a counter or held at every moment, and in a counter once it returns.
pub async fn a_shutdown_while_the_server_is_gone_returns_within_its_deadline<D: TestDb>(
    mode: ClaimMode,
) {
    // A short lease, so rows whose lease the outage left behind come back soon after.
    let fx = Fixture::<D>::new(mode, |b| {
        if mode == ClaimMode::Lease {
            b.lease_seconds(2)
        } else {
            b
        }
    })
    .await;
    let direct = fx.queue().await;
    let ids = fx.publish(&direct, 40).await;
    let (mut outage, url) = Outage::start(&fx.url).await;
    let broker = D::connect(&url).await;
    let q = broker
        .queue::<D::Job>(fx.table.clone())
        .await
        .expect("prepare the queue through the proxy");
    let (stop_watch, watch) = watch_counters(&q);
    let sub = q
        .subscribe(
            // A long poll: the pause is read once per poll, so after the cut the loop starts
            // claims (for the slots that free up) rather than wait in a pause read, and those
            // claims wait for a connection.
            SubscribeOptions::new()
                .concurrency(4)
                .poll_interval(Duration::from_secs(10))
                .shutdown_timeout(Duration::from_secs(2)),
            |_job| async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                Outcome::Ack
            },
        )
        .expect("subscribe");
    wait_until(
        "a few rows acked through the proxy",
        Duration::from_secs(30),
        || {
            let q = q.clone();
            async move { q.metrics().acked >= 4 && q.metrics().in_work > 0 }
        },
    )
    .await;
    outage.cut();
    // Handlers in work finish while the server is gone: their settlements wait for it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = tokio::time::timeout(Duration::from_secs(15), sub.shutdown())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{mode}: a shutdown with a 2 s deadline still ran 15 s after the server went away: {:?}",
                q.metrics()
            )
        });
    stop_watch.store(true, Ordering::SeqCst);
    let readings = watch.await.expect("the counters held at every reading");
    assert!(readings > 0);
    crate::assert_counters_add_up(&q);
    assert!(
        report.engine_panic.is_none(),
        "{mode}: the engine panicked: {report:?}"
    );
    // The server comes back: what the outage left (leases, keys) runs out or is given back,
    // and every row is delivered in the end.
    outage.restore().await;
    broker.close().await;
    drain::<D>(&direct, &ids).await;
    fx.cleanup().await;
}

/// A lease settlement whose server went away gives up when its lease runs out (a later try
/// could find the row claimed again), not after the pool's 30 s acquire timeout, and counts
/// the row as failed; renewal stops with it.
pub async fn a_settlement_gives_up_when_its_lease_runs_out_while_the_server_is_gone<D: TestDb>(
    mode: ClaimMode,
) {
    assert_eq!(mode, ClaimMode::Lease);
    let fx = Fixture::<D>::new(mode, |b| b.lease_seconds(2)).await;
    let direct = fx.queue().await;
    let ids = fx.publish(&direct, 1).await;
    let (mut outage, url) = Outage::start(&fx.url).await;
    let broker = D::connect(&url).await;
    let q = broker
        .queue::<D::Job>(fx.table.clone())
        .await
        .expect("prepare the queue through the proxy");
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let started_tx = std::sync::Mutex::new(Some(started_tx));
    let sub = q
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
            move |_job| {
                if let Some(tx) = started_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe");
    tokio::time::timeout(Duration::from_secs(30), started)
        .await
        .expect("the handler started")
        .expect("the handler started");
    outage.cut();
    // The lease (2 s, whole seconds) runs out about 3 s after the claim; the settlement gives
    // up a second before that. Without the cut it would wait 30 s for a connection.
    wait_until(
        "the settlement to give up once its lease ran out",
        Duration::from_secs(15),
        || {
            let q = q.clone();
            async move { q.metrics().settle_failed == 1 }
        },
    )
    .await;
    let m = q.metrics();
    assert_eq!((m.claimed, m.acked, m.held), (1, 0, 0), "{m:?}");
    outage.restore().await;
    sub.shutdown().await;
    broker.close().await;
    // The row comes back (its lease ran out) and runs again.
    drain::<D>(&direct, &ids).await;
    fx.cleanup().await;
}

/// Acks every row of `ids` on a subscription of `q` (on the server directly), waiting until
/// none is left: nothing the outage touched is lost.
async fn drain<D: TestDb>(q: &Queue<D::B, D::Job>, ids: &[i64]) {
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(4)
                .poll_interval(Duration::from_millis(50)),
            |_job| async { Outcome::Ack },
        )
        .expect("subscribe to drain");
    crate::wait_until_rows_gone::<D>(q, ids, Duration::from_secs(60)).await;
    sub.shutdown().await;
}

/// An idle subscription looks at the queue's pause once per poll: with the server gone, that
/// read waits for a connection (30 s, the pool's acquire timeout). A shutdown meanwhile returns
/// within its deadline all the same.
pub async fn an_idle_subscription_shuts_down_within_its_deadline_while_the_server_is_gone<
    D: TestDb,
>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let (mut outage, url) = Outage::start(&fx.url).await;
    let broker = D::connect(&url).await;
    let q = broker
        .queue::<D::Job>(fx.table.clone())
        .await
        .expect("prepare the queue through the proxy");
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(50))
                .shutdown_timeout(Duration::from_secs(2)),
            |_job| async { Outcome::Ack },
        )
        .expect("subscribe");
    // Polls (and the pause reads before them) go on while nothing is due.
    tokio::time::sleep(Duration::from_millis(300)).await;
    outage.cut();
    // The next pause read is in flight, waiting for a connection.
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::time::timeout(Duration::from_secs(15), sub.shutdown())
        .await
        .expect("a shutdown with a 2 s deadline returns while a pause read waits for the server");
    outage.restore().await;
    broker.close().await;
    fx.cleanup().await;
}
