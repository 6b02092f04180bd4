//! What a broker holds on the server while it works, and what gives it back: settlements and
//! shutdown leave no key, transaction or connection behind, and a killed connection gives its
//! row lock or key back at once. Written once for every backend (they were copies in the
//! PostgreSQL and MySQL test files).

use std::time::Duration;

use broker_core::{ClaimMode, Outcome, SubscribeOptions};

use super::claim_one;
use crate::{Fixture, TestDb, wait_until};

/// Waits (bounded) until `D::leaks` finds nothing: connections go back to the pool, and keys
/// unlock, in tasks of their own.
async fn nothing_held<D: TestDb>(fx: &Fixture<D>, when: &str) {
    for poll in 0.. {
        let leaks = D::leaks(&fx.broker).await;
        if leaks.is_empty() {
            return;
        }
        assert!(poll < 250, "{when}: {leaks:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn settlement_and_shutdown_leave_nothing_held<D: TestDb>(fx: Fixture<D>) {
    let q = fx.queue().await;
    let jobs: Vec<_> = (0..8)
        .map(|i| {
            let job = fx.job(i);
            if fx.table.group().is_some() {
                job.group(format!("g{}", i % 2))
            } else {
                job
            }
        })
        .collect();
    q.publish_batch(&jobs).await.unwrap();
    let first = claim_one::<D>(&q).await;
    let second = claim_one::<D>(&q).await;
    first.ack().await.unwrap();
    second.retry().await.unwrap();
    nothing_held(&fx, "after settlement").await;

    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(3)
                .poll_interval(Duration::from_millis(50)),
            |_job| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Outcome::Ack
            },
        )
        .expect("subscribe");
    wait_until("every row acked", Duration::from_secs(20), || {
        let q = q.clone();
        async move { q.metrics().acked == 8 }
    })
    .await;
    sub.shutdown().await;
    nothing_held(&fx, "after shutdown").await;
    fx.cleanup().await;
}

/// Settlements by hand and a subscription's shutdown leave no key locked, no transaction open
/// and no pool connection in use, in `mode`.
pub async fn settlement_and_shutdown_leave_nothing_held_in_mode<D: TestDb>(mode: ClaimMode) {
    settlement_and_shutdown_leave_nothing_held(Fixture::<D>::new(mode, |b| b).await).await;
}

/// As [`settlement_and_shutdown_leave_nothing_held_in_mode`], on a FIFO table (its group guard
/// must go with the claim's transaction).
pub async fn fifo_settlement_and_shutdown_leave_nothing_held<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b.group("grp").fifo(true)).await;
    settlement_and_shutdown_leave_nothing_held(fx).await;
}

/// Killing the connections of a broker whose row lock delivery is in work rolls its
/// transaction back: the row is due again at once for another broker, with no attempt used,
/// and the dead delivery cannot settle.
pub async fn a_killed_row_lock_connection_returns_the_row_at_once_without_an_attempt<D: TestDb>(
    _mode: ClaimMode,
) {
    let mut fx = Fixture::<D>::new(ClaimMode::RowLock, |b| b).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let id = fx.publish(&q, 1).await[0];
    let d = claim_one::<D>(&q).await;
    assert!(
        other.claim(1).await.unwrap().is_empty(),
        "the open transaction holds the row"
    );
    let killed = D::kill_connections(&fx.broker).await.unwrap_or(0);
    assert!(killed > 0, "the delivery's connection was killed");
    let again = crate::claim_within(
        &other,
        Duration::from_secs(5),
        "the killed transaction's row to come back",
    )
    .await;
    assert_eq!(again.id(), id);
    assert_eq!(again.attempt(), 1, "the rollback used no attempt");
    assert!(d.ack().await.is_err(), "the dead transaction cannot settle");
    again.ack().await.unwrap();
    assert!(q.row_state(id).await.unwrap().is_none());
    fx.cleanup().await;
}

/// Killing the connection that holds an advisory key frees the key on the server: another
/// broker takes the row (counting one more attempt), and the stale delivery cannot settle it.
pub async fn a_killed_key_connection_frees_the_key_and_the_stale_delivery_cannot_settle<
    D: TestDb,
>(
    _mode: ClaimMode,
) {
    let mut fx = Fixture::<D>::new(ClaimMode::Advisory, |b| b).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let id = fx.publish(&q, 1).await[0];
    let stale = claim_one::<D>(&q).await;
    assert!(
        other.claim(1).await.unwrap().is_empty(),
        "the key holds the row"
    );
    let killed = D::kill_connections(&fx.broker).await.unwrap_or(0);
    assert!(killed > 0, "the key's connection was killed");
    let fresh = crate::claim_within(&other, Duration::from_secs(5), "the key to be freed").await;
    assert_eq!(
        (fresh.id(), fresh.attempt()),
        (id, 2),
        "the take counted one more"
    );
    assert!(
        stale.ack().await.is_err(),
        "the stale delivery cannot settle"
    );
    assert!(
        q.row_state(id).await.unwrap().is_some(),
        "the stale ack changed nothing"
    );
    fresh.ack().await.unwrap();
    fx.broker.flush_cleanups().await;
    assert!(q.row_state(id).await.unwrap().is_none());
    fx.cleanup().await;
}

/// A key lock the strategy hands out and that is dropped without an unlock (the engine always
/// unlocks; this is the backstop when it cannot) frees its key: its connection is closed, not
/// returned to the pool holding the lock, and the key can be locked again.
pub async fn a_key_lock_dropped_without_unlocking_frees_its_key<D: TestDb>(mode: ClaimMode) {
    use broker_core::driver::{AdvisoryStrategy, Backend, Prepared};
    assert_eq!(mode, ClaimMode::Advisory, "a case of advisory mode");
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let table = std::sync::Arc::new(fx.table.clone());
    let Prepared::Advisory(adv) = fx.broker.backend().prepare(&table).await.expect("prepare")
    else {
        panic!("an advisory table prepares its advisory strategy")
    };
    let key = "key-dropped";
    let lock = adv
        .try_lock(key)
        .await
        .expect("try the key")
        .expect("a free key is locked");
    assert!(D::key_is_held(&fx.broker, key).await, "{key} is held");
    drop(lock);
    wait_until(
        &format!("{key} to be free after its lock dropped"),
        Duration::from_secs(10),
        || async { !D::key_is_held(&fx.broker, key).await },
    )
    .await;
    let again = adv
        .try_lock(key)
        .await
        .expect("try the key again")
        .expect("the dropped lock's key is locked again");
    adv.unlock(again).await.expect("unlock");
    adv.release_kept();
    fx.cleanup().await;
}

/// Two keys that share their first hundred characters (longer than MySQL's 64-character lock
/// names) and differ after them are two keys: a row of each is held at once, by two brokers,
/// and each key is reported held. A backend that cut long lock names short, instead of hashing
/// them whole, would lock both rows under one name and keep the second out.
pub async fn keys_that_share_a_long_prefix_are_held_at_once<D: TestDb>(mode: ClaimMode) {
    use crate::claim_within;
    assert_eq!(mode, ClaimMode::Advisory, "a case of advisory mode");
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let prefix = "p".repeat(100);
    let keys = [format!("{prefix}-one"), format!("{prefix}-two")];
    let jobs: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            broker_core::NewJob::new(D::Text::from(format!("job-{i}"))).column("k", k.clone())
        })
        .collect();
    let ids = q.publish_batch(&jobs).await.expect("publish");
    let first = claim_one::<D>(&q).await;
    assert_eq!(first.id(), ids[0]);
    let second = claim_within(
        &other,
        Duration::from_secs(10),
        "the row of the second key while the first key, which shares its first 100 characters, is held",
    )
    .await;
    assert_eq!(second.id(), ids[1]);
    for k in &keys {
        let key = format!("key-{k}");
        assert!(
            D::key_is_held(&fx.broker, &key).await,
            "{key} is held while both rows are in work"
        );
    }
    first.ack().await.expect("ack the first row");
    second.ack().await.expect("ack the second row");
    for k in &keys {
        let key = format!("key-{k}");
        wait_until(
            &format!("{key} to be free"),
            Duration::from_secs(10),
            || {
                let (broker, key) = (&fx.broker, key.clone());
                async move { !D::key_is_held(broker, &key).await }
            },
        )
        .await;
    }
    fx.cleanup().await;
}
