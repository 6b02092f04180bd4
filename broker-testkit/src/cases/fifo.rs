//! FIFO groups beyond the happy path: a head that retries, waits for a delayed retry, or ends
//! processed or dead-lettered, and groups that run side by side. Manual claims make every step
//! an ordering or state assertion.

use std::time::Duration;

use broker_core::{ClaimMode, DeadLetter, Delivery, Queue};

use super::claim_one;
use crate::{Fixture, TestDb, claim_within};

/// A FIFO table's fixture with `rows` published, row `i` in group `groups[i]`; returns the ids.
async fn fifo_rows<D: TestDb>(
    mode: ClaimMode,
    tweak: impl FnOnce(broker_core::TableBuilder) -> broker_core::TableBuilder,
    groups: &[&str],
) -> (Fixture<D>, Queue<D::B, D::Job>, Vec<i64>) {
    let fx = Fixture::<D>::new(mode, |b| tweak(b.group("grp").fifo(true))).await;
    let q = fx.queue().await;
    let jobs: Vec<_> = groups
        .iter()
        .enumerate()
        .map(|(i, g)| fx.job(i).group(*g))
        .collect();
    let ids = q.publish_batch(&jobs).await.expect("publish");
    (fx, q, ids)
}

/// Nothing is claimable now: `why` says which rows must wait.
async fn nothing_claimable<D: TestDb>(q: &Queue<D::B, D::Job>, why: &str) {
    let got: Vec<Delivery<D::B, D::Job>> = q.claim(4).await.expect("claim");
    let ids: Vec<i64> = got.iter().map(Delivery::id).collect();
    assert!(ids.is_empty(), "{why}, but rows {ids:?} were claimed");
}

/// Two groups run side by side while each keeps its order: with one row of each group in work,
/// the groups' second rows wait, and each comes as soon as its own head is settled, while the
/// other group's head is still in work.
pub async fn fifo_groups_run_side_by_side<D: TestDb>(mode: ClaimMode) {
    let (fx, q, ids) = fifo_rows::<D>(mode, |b| b, &["ga", "ga", "gb", "gb"]).await;
    let a1 = claim_one::<D>(&q).await;
    assert_eq!(a1.id(), ids[0]);
    let b1 = claim_one::<D>(&q).await;
    assert_eq!(b1.id(), ids[2], "group gb's head runs beside group ga's");
    nothing_claimable::<D>(&q, "both groups have their head in work").await;
    a1.ack().await.unwrap();
    let a2 = claim_one::<D>(&q).await;
    assert_eq!(
        a2.id(),
        ids[1],
        "ga moves on while gb's head is still in work"
    );
    nothing_claimable::<D>(&q, "both groups have a row in work").await;
    b1.ack().await.unwrap();
    let b2 = claim_one::<D>(&q).await;
    assert_eq!(b2.id(), ids[3]);
    a2.ack().await.unwrap();
    b2.ack().await.unwrap();
    nothing_claimable::<D>(&q, "every row is acked").await;
    fx.cleanup().await;
}

/// A head that retries comes back before the next row of its group, at the next attempt; the
/// next row waits while the head is in work, both times.
pub async fn a_fifo_retry_keeps_its_group_waiting<D: TestDb>(mode: ClaimMode) {
    let (fx, q, ids) = fifo_rows::<D>(mode, |b| b, &["g", "g"]).await;
    let head = claim_one::<D>(&q).await;
    assert_eq!(head.id(), ids[0]);
    nothing_claimable::<D>(&q, "the second row waits while its head is in work").await;
    head.retry().await.unwrap();
    let again = claim_one::<D>(&q).await;
    assert_eq!(
        (again.id(), again.attempt()),
        (ids[0], 2),
        "the retried head comes back first"
    );
    nothing_claimable::<D>(&q, "the second row waits for the retried head").await;
    again.ack().await.unwrap();
    let next = claim_one::<D>(&q).await;
    assert_eq!((next.id(), next.attempt()), (ids[1], 1));
    next.ack().await.unwrap();
    fx.cleanup().await;
}

/// A head waiting for a delayed retry still blocks the later rows of its group (they are due,
/// it is not); the head comes back before them, and another group's row is delivered too.
pub async fn a_fifo_delayed_retry_blocks_later_rows_of_its_group<D: TestDb>(mode: ClaimMode) {
    let (fx, q, ids) = fifo_rows::<D>(mode, |b| b, &["g", "g", "h"]).await;
    let head = claim_one::<D>(&q).await;
    assert_eq!(head.id(), ids[0]);
    head.retry_after(Duration::from_secs(3)).await.unwrap();
    // Everything delivered from here on, in order, each acked at once.
    let mut order = Vec::new();
    while order.len() < 3 {
        let d = claim_within(&q, Duration::from_secs(20), "the next row").await;
        order.push((d.id(), d.attempt()));
        d.ack().await.unwrap();
    }
    let group_g: Vec<_> = order.iter().filter(|(id, _)| *id != ids[2]).collect();
    assert_eq!(
        group_g,
        [&(ids[0], 2), &(ids[1], 1)],
        "g's second row comes only after its head's delayed retry (order {order:?})"
    );
    assert!(order.contains(&(ids[2], 1)), "group h ran: {order:?}");
    nothing_claimable::<D>(&q, "every row is acked").await;
    fx.cleanup().await;
}

/// Rows of a group that are processed (`processed_at` set) or dead-lettered (marked) stay in the
/// table but do not hold their group up, and are never delivered again.
pub async fn a_fifo_group_moves_on_past_processed_and_dead_rows<D: TestDb>(mode: ClaimMode) {
    let (fx, q, ids) = fifo_rows::<D>(
        mode,
        |b| {
            b.processed_at("done_at")
                .dead_letter(DeadLetter::Column("dead_at".into()))
        },
        &["g", "g", "g"],
    )
    .await;
    let first = claim_one::<D>(&q).await;
    assert_eq!(first.id(), ids[0]);
    first.ack().await.unwrap();
    let second = claim_one::<D>(&q).await;
    assert_eq!(second.id(), ids[1], "a processed head lets its group go on");
    second.dead_letter().await.unwrap();
    let third = claim_one::<D>(&q).await;
    assert_eq!(
        third.id(),
        ids[2],
        "a dead-lettered head lets its group go on"
    );
    third.ack().await.unwrap();
    nothing_claimable::<D>(&q, "processed and dead rows are never delivered again").await;
    let states: Vec<_> = {
        let mut v = Vec::new();
        for id in &ids {
            let s = q.row_state(*id).await.unwrap().expect("marked rows stay");
            v.push((s.processed, s.dead));
        }
        v
    };
    assert_eq!(states, [(true, false), (false, true), (true, false)]);
    fx.cleanup().await;
}

/// Issue #13: a row the application inserts with its own SQL (not through `publish`) into a
/// group whose head is in work waits for that head, then comes next, with no call into the
/// library: whatever the claim needs must come from the table itself.
pub async fn a_fifo_row_inserted_by_plain_sql_waits_for_its_head<D: TestDb>(mode: ClaimMode) {
    use crate::JobText as _;
    let (fx, q, ids) = fifo_rows::<D>(mode, |b| b, &["g"]).await;
    let head = claim_one::<D>(&q).await;
    assert_eq!(head.id(), ids[0]);
    let sql = format!(
        "INSERT INTO {} ({}, {}) VALUES ('by-hand', 'g')",
        D::quote(fx.table.name()),
        D::quote("payload"),
        D::quote("grp")
    );
    D::execute(&fx.broker, &sql).await;
    nothing_claimable::<D>(
        &q,
        "the row inserted by hand waits while its group's head is in work",
    )
    .await;
    head.ack().await.unwrap();
    let next = claim_one::<D>(&q).await;
    assert_eq!(next.payload().text(), "by-hand");
    assert!(next.id() > ids[0]);
    next.ack().await.unwrap();
    nothing_claimable::<D>(&q, "both rows are acked").await;
    fx.cleanup().await;
}

/// Issue #13: one group that empties and fills again over and over while two brokers' claims
/// run (each row, or pair of rows, is published only once the group is empty): its rows start
/// in id order and never two at once.
pub async fn a_fifo_group_that_empties_and_fills_again_keeps_its_order<D: TestDb>(mode: ClaimMode) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use broker_core::{Outcome, SubscribeOptions};

    const ROUNDS: usize = 40;
    let (mut fx, q, _) = fifo_rows::<D>(mode, |b| b, &[]).await;
    let other = fx.other_queue().await;
    let in_work = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let started: Arc<Mutex<Vec<i64>>> = Arc::default();
    let acked = Arc::new(AtomicUsize::new(0));
    let subscribe = |queue: &Queue<D::B, D::Job>| {
        let (in_work, overlaps, started, acked) = (
            in_work.clone(),
            overlaps.clone(),
            started.clone(),
            acked.clone(),
        );
        queue
            .subscribe(
                SubscribeOptions::new()
                    .concurrency(4)
                    .poll_interval(Duration::from_millis(50)),
                move |job| {
                    let (in_work, overlaps, started, acked) = (
                        in_work.clone(),
                        overlaps.clone(),
                        started.clone(),
                        acked.clone(),
                    );
                    async move {
                        if in_work.fetch_add(1, Ordering::SeqCst) > 0 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        started.lock().unwrap().push(job.id());
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        in_work.fetch_sub(1, Ordering::SeqCst);
                        acked.fetch_add(1, Ordering::SeqCst);
                        Outcome::Ack
                    }
                },
            )
            .expect("subscribe")
    };
    let subs = [subscribe(&q), subscribe(&other)];
    let mut ids = Vec::new();
    for round in 0..ROUNDS {
        // Every third round the group fills with two rows at once.
        let n = if round % 3 == 0 { 2 } else { 1 };
        let jobs: Vec<_> = (0..n).map(|i| fx.job(round * 2 + i).group("g")).collect();
        ids.extend(q.publish_batch(&jobs).await.expect("publish"));
        let want = ids.len();
        crate::wait_until(
            &format!("round {round}'s rows acked"),
            Duration::from_secs(20),
            || {
                let acked = acked.clone();
                async move { acked.load(Ordering::SeqCst) >= want }
            },
        )
        .await;
    }
    for s in subs {
        s.shutdown().await;
    }
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two rows of the group ran at once"
    );
    assert_eq!(
        *started.lock().unwrap(),
        ids,
        "the group's rows started in id order, each once"
    );
    fx.cleanup().await;
}

/// Issue #13: groups take turns. With three groups published one after the other, claims that
/// each ack before the next visit the groups in turn (each claim starts after the group the
/// last one took), not the first group's rows back to back; each group keeps its own order.
pub async fn fifo_groups_take_turns<D: TestDb>(mode: ClaimMode) {
    let groups = ["ga", "ga", "ga", "gb", "gb", "gb", "gc", "gc", "gc"];
    let (fx, q, ids) = fifo_rows::<D>(mode, |b| b, &groups).await;
    let mut order = Vec::new();
    for _ in 0..groups.len() {
        let d = claim_one::<D>(&q).await;
        order.push(d.id());
        d.ack().await.unwrap();
    }
    let group_of = |id: &i64| groups[ids.iter().position(|i| i == id).unwrap()];
    let first_three: Vec<&str> = order[..3].iter().map(group_of).collect();
    let mut distinct = first_three.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        3,
        "the first three claims took {first_three:?}: one group ran ahead of the others"
    );
    for g in ["ga", "gb", "gc"] {
        let of_group: Vec<i64> = order
            .iter()
            .copied()
            .filter(|id| group_of(id) == g)
            .collect();
        let mut sorted = of_group.clone();
        sorted.sort_unstable();
        assert_eq!(of_group, sorted, "group {g} ran out of order");
    }
    nothing_claimable::<D>(&q, "every row is acked").await;
    fx.cleanup().await;
}

/// A claim whose walk of the groups starts after the last group goes on from the first: with
/// the last claim in group `gb` (the last group) and only `ga`'s head claimable, one claim
/// takes it. A walk that stopped at the last group came back empty here, and a subscription
/// then slept until its poll with the head claimable.
pub async fn a_walk_that_starts_after_the_last_group_goes_on_from_the_first<D: TestDb>(
    mode: ClaimMode,
) {
    let (fx, q, ids) = fifo_rows::<D>(mode, |b| b, &["ga", "ga", "gb"]).await;
    for expected in [ids[0], ids[2]] {
        let d = claim_one::<D>(&q).await;
        assert_eq!(d.id(), expected, "the groups take turns");
        d.ack().await.unwrap();
    }
    let got: Vec<Delivery<D::B, D::Job>> = q.claim(4).await.expect("claim");
    let taken: Vec<i64> = got.iter().map(Delivery::id).collect();
    assert_eq!(
        taken,
        vec![ids[1]],
        "the claim after one in the last group takes the first group's head"
    );
    for d in got {
        d.ack().await.unwrap();
    }
    fx.cleanup().await;
}

/// Issue #13: a claim reaches a claimable head however many groups before it have none (here
/// 69 groups whose only row is scheduled an hour ahead, more than one claim window of groups on
/// MySQL and MariaDB), and takes nothing else.
pub async fn a_head_past_many_groups_without_one_is_claimed<D: TestDb>(mode: ClaimMode) {
    const BLOCKED: usize = 69;
    let fx = Fixture::<D>::new(mode, |b| b.group("grp").fifo(true)).await;
    let q = fx.queue().await;
    let later = std::time::SystemTime::now() + Duration::from_secs(3600);
    let mut jobs: Vec<_> = (0..BLOCKED)
        .map(|i| fx.job(i).group(format!("g{i:03}")).run_at(later))
        .collect();
    jobs.push(fx.job(BLOCKED).group(format!("g{BLOCKED:03}")));
    let ids = q.publish_batch(&jobs).await.expect("publish");
    let got = claim_one::<D>(&q).await;
    assert_eq!(
        got.id(),
        ids[BLOCKED],
        "the only due head, after {BLOCKED} groups whose heads are scheduled"
    );
    got.ack().await.unwrap();
    nothing_claimable::<D>(&q, "every other head is scheduled an hour ahead").await;
    fx.cleanup().await;
}

/// Issue #13, advisory mode: when a whole window of candidates is group heads under a key in
/// work (20 groups whose heads share one key), the claim goes on to the other groups (the walk
/// of the groups) and takes the one free head, never a row behind a head; once the key is free
/// again, the heads come one at a time and the rows behind them after.
pub async fn advisory_claims_past_heads_in_work_take_only_heads<D: TestDb>(mode: ClaimMode) {
    const HOT: usize = 20;
    let fx = Fixture::<D>::new(mode, |b| b.group("grp").fifo(true)).await;
    let q = fx.queue().await;
    let group = |g: usize| format!("g{g:02}");
    let mut jobs: Vec<_> = (0..HOT)
        .map(|g| {
            broker_core::NewJob::new(D::Text::from(format!("hot-{g}")))
                .column("k", "hot".to_owned())
                .group(group(g))
        })
        .collect();
    jobs.push(fx.job(HOT).group(group(HOT)));
    jobs.extend((0..HOT).map(|g| fx.job(HOT + 1 + g).group(group(g))));
    let ids = q.publish_batch(&jobs).await.expect("publish");
    let first = claim_one::<D>(&q).await;
    assert_eq!(first.id(), ids[0], "the first head");
    let free = claim_one::<D>(&q).await;
    assert_eq!(
        free.id(),
        ids[HOT],
        "the only head whose key is free, past {HOT} heads under the held key"
    );
    nothing_claimable::<D>(&q, "every other head is under the held key").await;
    free.ack().await.unwrap();
    first.ack().await.unwrap();
    // Each head of key "hot" runs alone; the row behind it comes once it is acked.
    let mut done = vec![ids[0], ids[HOT]];
    for _ in 0..(2 * HOT - 1) {
        let d = claim_one::<D>(&q).await;
        let at = ids
            .iter()
            .position(|&i| i == d.id())
            .expect("a published row");
        if at > HOT {
            let head = ids[at - HOT - 1];
            assert!(
                done.contains(&head),
                "row {} came before its group's head",
                d.id()
            );
        }
        done.push(d.id());
        d.ack().await.unwrap();
    }
    done.sort_unstable();
    let mut all = ids.clone();
    all.sort_unstable();
    assert_eq!(done, all, "every row once");
    fx.cleanup().await;
}

/// A FIFO row published inside a transaction that commits late gets its id before a row of its
/// group published and committed meanwhile. The late row becomes the group's head once it
/// commits, so the group's head changes under the claims: while any row of the group is in
/// work, no claim may take another, before or after the commit. A claim runs while the
/// transaction is open (on MySQL/MariaDB it waits for the unseen row; on PostgreSQL a lease
/// or advisory claim skips the group, whose guard the publish holds; a row lock claim takes the
/// committed row), the transaction commits, and a second claim must find nothing while the
/// first delivery is in work. Then the rows run one at a time to the end. Only for databases
/// with server connections (SQLite has one writer: the open transaction holds every claim).
pub async fn a_fifo_row_committed_late_with_an_earlier_id_waits_for_the_row_in_work<D: TestDb>(
    mode: ClaimMode,
) {
    let fx = Fixture::<D>::new(mode, |b| b.group("grp").fifo(true)).await;
    let q = fx.queue().await;
    let mut tx = fx.broker.pool().begin().await.expect("begin");
    let early = q
        .publish_in(&mut *tx, &[fx.job(0).group("g")])
        .await
        .expect("publish in the transaction")[0];
    let later = q.publish(fx.job(1).group("g")).await.expect("publish");
    assert!(
        early < later,
        "ids {early} and {later} are in publish order"
    );
    let claiming = q.clone();
    let first = tokio::spawn(async move {
        claim_within(
            &claiming,
            Duration::from_secs(30),
            "a row of the group once the late row commits",
        )
        .await
    });
    // The claim runs while the transaction is open (it waits, skips or takes the later row).
    tokio::time::sleep(Duration::from_millis(500)).await;
    tx.commit().await.expect("commit the late row");
    let first = first.await.expect("the claim task");
    let second = q.claim(1).await.expect("claim");
    assert!(
        second.is_empty(),
        "row {} of the group was claimed while row {} of it was in work (late row {early}, later row {later})",
        second[0].id(),
        first.id()
    );
    let order = [first.id(), {
        first.ack().await.expect("ack the first row");
        let next = claim_one::<D>(&q).await;
        let id = next.id();
        next.ack().await.expect("ack the second row");
        id
    }];
    crate::report(&format!(
        "{mode} on {}: a FIFO row committed late ({early}) and a later row of its group ({later}) ran one at a time, in the order {order:?}",
        broker_core::Backend::capabilities(fx.broker.backend()).database,
    ));
    fx.cleanup().await;
}

/// An advisory claim reads its candidates, locks a key, then takes the row in a statement of its
/// own; the group's head can change in between. Driven through the backend's advisory
/// strategy, so the change lands exactly there: a group's first row is dead-lettered (marked),
/// the walk of the groups finds the second row as the head, the first row is requeued, and the
/// take of the second row, under its own free key, must then refuse it: the first row is the
/// group's head again. A queue claim then takes the first row.
pub async fn an_advisory_take_rechecks_that_its_row_is_still_the_groups_head<D: TestDb>(
    mode: ClaimMode,
) {
    use broker_core::Backend as _;
    use broker_core::driver::{AdvisoryStrategy, Prepared, clock};

    assert_eq!(mode, ClaimMode::Advisory, "a case of advisory mode");
    let fx = Fixture::<D>::new(mode, |b| {
        b.group("grp")
            .fifo(true)
            .dead_letter(DeadLetter::Column("dead_at".into()))
    })
    .await;
    let q = fx.queue().await;
    let ids = q
        .publish_batch(&[fx.job(0).group("g"), fx.job(1).group("g")])
        .await
        .expect("publish");
    let first = claim_one::<D>(&q).await;
    assert_eq!(first.id(), ids[0]);
    first.dead_letter().await.expect("dead-letter the head");
    let table = std::sync::Arc::new(fx.table.clone());
    let Prepared::Advisory(adv) = fx.broker.backend().prepare(&table).await.expect("prepare")
    else {
        panic!("an advisory table prepares its advisory strategy")
    };
    let walk = adv
        .walk_keys(None, 10, clock::now_ms())
        .await
        .expect("walk the groups");
    let heads: Vec<i64> = walk.candidates.iter().map(|c| c.id).collect();
    assert_eq!(
        heads,
        vec![ids[1]],
        "the walk finds the second row as the head"
    );
    let key = walk.candidates[0].key.clone();
    // The head changes between the walk and the take: the first row comes back.
    assert_eq!(
        q.requeue_dead(broker_core::DeadLetters::Ids(vec![ids[0]]))
            .await
            .expect("requeue the first row"),
        1
    );
    let mut lock = adv
        .try_lock(&key)
        .await
        .expect("try the key")
        .expect("the second row's key is free");
    let taken = adv
        .take(&mut lock, ids[1], clock::now_ms())
        .await
        .expect("take");
    adv.unlock(lock).await.expect("unlock");
    assert!(
        taken.is_none(),
        "the take claimed row {} although row {} was its group's head again",
        ids[1],
        ids[0]
    );
    let next = claim_one::<D>(&q).await;
    assert_eq!(next.id(), ids[0], "the requeued head runs first");
    next.ack().await.expect("ack");
    let last = claim_one::<D>(&q).await;
    assert_eq!(last.id(), ids[1]);
    last.ack().await.expect("ack");
    fx.cleanup().await;
}
