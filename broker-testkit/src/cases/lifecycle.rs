//! Shutdown, close, publish inside a transaction, wake-ups.

use std::sync::Arc;
use std::time::Duration;

use broker_core::{ClaimMode, Outcome, SqlxBrokerError, SubscribeOptions};

use super::claim_one;
use crate::{Fixture, TestDb, claim_within, wait_until};

/// Graceful shutdown lets handlers in work finish and settle, and leaves no row claimed and no
/// key held: another broker can claim every remaining row at once. More rows are published than
/// the subscription can claim before the shutdown (three slots, each handler held until the
/// shutdown has begun), so rows do remain and the check has something to check.
pub async fn shutdown_leaves_no_row_claimed_and_no_key_held<D: TestDb>(mode: ClaimMode) {
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let ids = fx.publish(&q, 24).await;
    let stopping = Arc::new(tokio::sync::Notify::new());
    let gate = stopping.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new().concurrency(3).batch_size(3),
            move |_job| {
                let gate = gate.clone();
                async move {
                    // Held until the shutdown begins (bounded, should the notification be missed).
                    let _ = tokio::time::timeout(Duration::from_secs(30), gate.notified()).await;
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe");
    wait_until("three handlers in work", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().in_work == 3 }
    })
    .await;
    // The shutdown's first poll stops the claims; the handlers are let go only after it, so
    // each of them finishes during the shutdown and no further claim starts. (Spawned and let
    // go at once, a loaded machine could run the handlers first: their rows were acked and
    // claims went on before the shutdown began, and the report rightly left them out.)
    let mut shutdown = Box::pin(sub.shutdown());
    std::future::poll_fn(|cx| {
        let _ = shutdown.as_mut().poll(cx);
        std::task::Poll::Ready(())
    })
    .await;
    let shutdown = tokio::spawn(shutdown);
    stopping.notify_waiters();
    let mut releases = 0;
    while !shutdown.is_finished() {
        releases += 1;
        assert!(
            releases < 1500,
            "the shutdown finishes once its handlers are let go"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        stopping.notify_waiters();
    }
    let report = shutdown.await.unwrap();
    assert_eq!(report.dropped, 0);
    assert!(report.finished >= 3, "{report:?}");
    let acked = q.metrics().acked;
    assert_eq!(
        acked, report.finished as u64,
        "every finished handler settled"
    );
    assert_eq!(q.metrics().in_work, 0);
    for i in 0..ids.len() {
        assert!(
            !D::key_is_held(&fx.broker, &format!("key-k{i}")).await,
            "key-k{i}"
        );
    }
    let mut left = 0;
    for id in &ids {
        if let Some(state) = q.row_state(*id).await.unwrap() {
            left += 1;
            assert_eq!(state.locked_until_ms, None, "row {id} is not leased");
        }
    }
    assert_eq!(left as u64, ids.len() as u64 - acked);
    assert!(
        left > 0,
        "rows must remain after the shutdown for this case to check them ({acked} acked)"
    );
    // Claims back to back, without waiting, each batch acked before the next (row lock holds a
    // connection per row): a claim may hand out fewer rows than asked (an advisory claim stops
    // at its candidates), but none may have to wait for a lease or a key.
    let mut claimed_again = 0;
    loop {
        let got = other.claim(4).await.unwrap();
        if got.is_empty() {
            break;
        }
        claimed_again += got.len();
        for d in got {
            d.ack().await.unwrap();
        }
    }
    assert_eq!(
        claimed_again, left,
        "the remaining rows are claimable at once"
    );
    fx.cleanup().await;
}

/// A subscription stopped while its table is busy gives back every connection it kept for its
/// next statement as it stops (strategies keep them between statements, and a clean-up task
/// gives back those unused for a quarter second). Checked against events, not a clock: the
/// subscription runs until it has handled 100 rows and its mode keeps a connection; when its
/// shutdown returns, the mode keeps none (the stop gave them back, not the clean-up, which
/// cannot have run for the connections the last settlements kept just before); and the pool
/// then gets back to as many connections out as before the subscription started (they go back
/// in tasks of their own, so that wait is bounded generously).
///
/// Row lock keeps a connection only from a settlement to the next claim, a moment a look every
/// few milliseconds can miss many times over; the handlers look too, and the table is topped up
/// as it drains, so the wait is bounded by rows handled, not by how fast they go (on a loaded
/// machine the first 2,000 rows drained while a look every 20 ms never caught one kept).
pub async fn a_stopped_subscription_gives_its_kept_connections_back_at_once<D: TestDb>(
    mode: ClaimMode,
) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Rows handled at most before the case gives up on seeing a connection kept.
    const AT_MOST: usize = 40_000;

    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let mut published = 2_000;
    let mut last = *fx.publish(&q, published).await.last().expect("an id");
    // What is out with no subscription (the publish's connection is on its way back): the
    // fewest over a tenth of a second.
    let mut before = usize::MAX;
    for _ in 0..5 {
        before = before.min(super::settle::pool_in_use(&fx.broker));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ran = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(AtomicBool::new(false));
    let sub = {
        let (ran, seen, q) = (ran.clone(), seen.clone(), q.clone());
        q.clone()
            .subscribe(SubscribeOptions::new().concurrency(4), move |_job| {
                let (ran, seen, q) = (ran.clone(), seen.clone(), q.clone());
                async move {
                    if ran.fetch_add(1, Ordering::SeqCst) + 1 >= 100 && q.kept_connections() > 0 {
                        seen.store(true, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Outcome::Ack
                }
            })
            .expect("subscribe")
    };
    loop {
        if seen.load(Ordering::SeqCst)
            || (ran.load(Ordering::SeqCst) >= 100 && q.kept_connections() > 0)
        {
            break;
        }
        let handled = ran.load(Ordering::SeqCst);
        assert!(
            published < AT_MOST,
            "{handled} rows handled and the mode never kept a connection for its next statement"
        );
        if handled + 1_000 > published {
            let jobs: Vec<_> = (published..published + 1_000).map(|i| fx.job(i)).collect();
            last = *q
                .publish_batch(&jobs)
                .await
                .expect("publish")
                .last()
                .expect("an id");
            published += 1_000;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sub.shutdown().await;
    let kept = q.kept_connections();
    assert_eq!(
        kept, 0,
        "{kept} connections still kept for the next statement when the shutdown returned"
    );
    assert!(
        q.row_state(last).await.unwrap().is_some(),
        "the table was still busy when the subscription stopped"
    );
    wait_until(
        &format!("the pool to have {before} connections out, as before the subscription"),
        Duration::from_secs(10),
        || {
            let broker = &fx.broker;
            async move { super::settle::pool_in_use(broker) <= before }
        },
    )
    .await;
    fx.cleanup().await;
}

/// Handlers still running at the shutdown deadline are dropped and their rows released at once
/// (row lock: rolled back, attempt unused; lease: released; advisory: unlocked).
pub async fn shutdown_deadline_drops_handlers_and_releases_rows<D: TestDb>(mode: ClaimMode) {
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    fx.publish(&q, 2).await;
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(2)
                // Handlers get all but the last second; that second gives their rows back.
                .shutdown_timeout(Duration::from_secs(2)),
            |_job| async move {
                tokio::time::sleep(Duration::from_secs(120)).await;
                Outcome::Ack
            },
        )
        .expect("subscribe");
    wait_until("two handlers in work", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().in_work == 2 }
    })
    .await;
    // The handlers sleep two minutes; a shutdown that waited for them would not return here.
    let report = tokio::time::timeout(Duration::from_secs(60), sub.shutdown())
        .await
        .expect("shutdown returns at its deadline, without waiting for the handlers");
    assert_eq!(report.dropped, 2, "{report:?}");
    // The dropped handlers' rows count as released.
    assert_eq!(q.metrics().released, 2, "{:?}", q.metrics());
    crate::assert_counters_add_up(&q);
    for i in 0..2 {
        assert!(!D::key_is_held(&fx.broker, &format!("key-k{i}")).await);
    }
    let mut rest = Vec::new();
    while rest.len() < 2 {
        rest.push(claim_within(&other, Duration::from_secs(10), "both rows claimable again").await);
    }
    let expected = if mode == ClaimMode::RowLock { 1 } else { 2 };
    for d in rest {
        assert_eq!(d.attempt(), expected);
        d.ack().await.unwrap();
    }
    crate::assert_counters_add_up(&other);
    fx.cleanup().await;
}

/// A publish inside the caller's transaction commits with it or not at all.
pub async fn a_publish_in_a_rolled_back_transaction_leaves_no_row<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    let mut tx = fx.broker.pool().begin().await.unwrap();
    let gone = q.publish_in(&mut *tx, &[fx.job(0)]).await.unwrap()[0];
    tx.rollback().await.unwrap();
    assert!(q.row_state(gone).await.unwrap().is_none());
    let mut tx = fx.broker.pool().begin().await.unwrap();
    let kept = q.publish_in(&mut *tx, &[fx.job(1)]).await.unwrap()[0];
    tx.commit().await.unwrap();
    assert!(q.row_state(kept).await.unwrap().is_some());
    let d = claim_one::<D>(&q).await;
    assert_eq!(d.id(), kept);
    d.ack().await.unwrap();
    fx.cleanup().await;
}

/// After the broker closes, claims and settlements are refused with `Closed`, naming the table.
pub async fn a_settlement_after_close_is_refused<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    fx.publish(&q, 1).await;
    let d = claim_one::<D>(&q).await;
    fx.broker.close().await;
    let err = d.ack().await.unwrap_err();
    assert!(matches!(err, SqlxBrokerError::Closed { .. }), "{err:?}");
    assert!(err.to_string().contains(fx.table.name()), "{err}");
    let err = q.claim(1).await.unwrap_err();
    assert!(matches!(err, SqlxBrokerError::Closed { .. }), "{err:?}");
    let other = D::connect(&fx.url).await;
    other.drop_tables(&fx.table).await.unwrap();
    other.close().await;
    D::drop_database(&fx.url).await;
}

/// A publish through the broker wakes an idle subscription of the table in the same process,
/// long before its poll.
pub async fn a_publish_wakes_an_idle_subscription<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    let sub = q
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_secs(3600)),
            |_job| async move { Outcome::Ack },
        )
        .expect("subscribe");
    tokio::time::sleep(Duration::from_millis(300)).await;
    fx.publish(&q, 1).await;
    // The poll comes once an hour: an ack within the bounded wait can only come from the wake.
    wait_until(
        "the woken subscription's ack",
        Duration::from_secs(10),
        || {
            let q = q.clone();
            async move { q.metrics().acked == 1 }
        },
    )
    .await;
    sub.shutdown().await;
    fx.cleanup().await;
}

/// Issue #32: rows that arrive without a wake-up (inserted by plain SQL, as another service, a
/// trigger or a migration would) while a subscription drains its table are found at the pace
/// they arrive, not at the next poll: the subscription's poll is an hour, one row published
/// through the queue wakes it, and then forty rows inserted by hand one after another must all
/// run within the bounded wait. Without the poll cooldown the subscription sleeps the hour after
/// its first drained claim.
pub async fn rows_inserted_by_plain_sql_into_a_busy_queue_run_without_waiting_for_the_poll<
    D: TestDb,
>(
    mode: ClaimMode,
) {
    const BY_HAND: usize = 40;
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(2)
                .poll_interval(Duration::from_secs(3600)),
            |_job| async move { Outcome::Ack },
        )
        .expect("subscribe");
    fx.publish(&q, 1).await;
    wait_until("the published row's ack", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().acked == 1 }
    })
    .await;
    let key = if mode == ClaimMode::Advisory {
        format!(", {}", D::quote("k"))
    } else {
        String::new()
    };
    for i in 0..BY_HAND {
        let value = if mode == ClaimMode::Advisory {
            format!(", 'k{i}'")
        } else {
            String::new()
        };
        let sql = format!(
            "INSERT INTO {} ({}{key}) VALUES ('by-hand-{i}'{value})",
            D::quote(fx.table.name()),
            D::quote("payload"),
        );
        D::execute(&fx.broker, &sql).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    wait_until(
        "every row inserted by hand to run (the poll is an hour away)",
        Duration::from_secs(30),
        || {
            let q = q.clone();
            async move { q.metrics().acked == 1 + BY_HAND as u64 }
        },
    )
    .await;
    sub.shutdown().await;
    fx.cleanup().await;
}
