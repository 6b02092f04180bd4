//! Settlements across killed connections and server restarts: a lease drain whose broker loses
//! every server connection eight times, or whose server restarts, must recover by itself, lose
//! nothing, and run no handler twice, because a lease settlement that fails with a connection
//! error runs again on a fresh connection while its lease holds. Row lock's transactions die
//! with the server, so its rows come back at once and the handlers a restart cut run again;
//! nothing is lost there either.

use std::time::{Duration, Instant};

use broker_core::{Backend, ClaimMode, SqlxBrokerError};

use crate::{Fixture, Runs, TestDb, report, subscribe_counting, wait_until, wait_until_rows_gone};

/// Rows of the drain.
const ROWS: usize = 200;
/// How often the broker's connections are killed, spread over the drain.
const KILLS: usize = 8;

/// A lease drain (8 workers, 200 rows, a 4 s lease) while every server connection of the
/// broker is terminated eight times: every row is acked exactly once (no handler runs twice: the
/// acks cut by a kill ran again on fresh connections before their leases ran out), and the
/// subscription keeps going on its own. Only for databases with server connections.
pub async fn lease_settlements_survive_killed_connections_without_reruns<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b.lease_seconds(4)).await;
    let database = fx.broker.backend().capabilities().database;
    let q = fx.queue().await;
    let ids = fx.publish(&q, ROWS).await;
    // With slow deletes most workers are mid-ack at any moment, so the kills cut acks.
    let slowed = D::slow_down_deletes(&fx.broker, fx.table.name()).await;
    let started = Instant::now();
    // Long enough that kills find deliveries in work and settling.
    let (sub, runs) = subscribe_counting::<D>(&q, Duration::from_millis(3));
    let ran = |runs: &Runs| runs.lock().unwrap().len();
    let mut killed = 0;
    for k in 1..=KILLS {
        let target = ROWS * k / (KILLS + 1);
        wait_until("the drain to move on", Duration::from_secs(60), || {
            let runs = runs.clone();
            async move { ran(&runs) >= target }
        })
        .await;
        killed += D::kill_connections(&fx.broker)
            .await
            .expect("this case runs only where there are server connections to kill");
    }
    // Rows a claim took just as its connection died come back when their lease runs out. An ack
    // whose reply was lost finds its row gone when it runs again (and says so), so the table,
    // not the counters, says when every row is done.
    wait_until("every row run", Duration::from_secs(60), || {
        let (runs, q) = (runs.clone(), q.clone());
        async move { ran(&runs) == ROWS && q.metrics().in_work == 0 }
    })
    .await;
    wait_until_rows_gone::<D>(&q, &ids, Duration::from_secs(60)).await;
    let elapsed = started.elapsed();
    sub.shutdown().await;
    crate::assert_counters_add_up(&q);
    for id in &ids {
        assert_eq!(
            q.row_state(*id).await.expect("read the row"),
            None,
            "row {id} is still in the table after its ack"
        );
    }
    let reruns: Vec<(i64, usize)> = runs
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, n)| (*id, *n))
        .collect();
    let m = q.metrics();
    // Each counter points at one way a handler can run twice: an ack that failed for good
    // (`settle_failed`: the row was released), a lease that ran out under a delivery
    // (`lease_lost`), two deliveries of one row at once (`gone`: the second ack found the row
    // deleted, as does an ack run again after its reply was lost).
    report(&format!(
        "{database} lease settlements across killed connections: {ROWS} rows, {KILLS} kills, {killed} connections terminated{}, {} handlers run twice, {:.1} s; settlements failed {}, leases lost {}, acks that found their row gone {}, released {}, claim errors {}",
        if slowed {
            " (acks slowed to ~20 ms)"
        } else {
            ""
        },
        reruns.len(),
        elapsed.as_secs_f64(),
        m.settle_failed,
        m.lease_lost,
        m.gone,
        m.released,
        m.claim_errors,
    ));
    assert!(killed > 0, "the kills must terminate connections");
    assert!(
        reruns.is_empty(),
        "handlers ran twice for rows {reruns:?}: settlements cut by a kill were not run again in time ({m:?})"
    );
    fx.cleanup().await;
}

/// Rows of the restart drain.
const RESTART_ROWS: usize = 300;

/// A drain (8 workers, handlers of 100 ms, slow deletes so acks are on the wire) across a real
/// server restart that `restart` performs, returning once the server accepts connections again
/// (it runs on a blocking thread). Every row runs and is gone; in lease mode (a 15 s lease, to
/// outlast the restart) no handler runs twice. For one test binary of its own per database: it
/// stops the server every other test uses.
pub async fn drain_across_a_server_restart<D: TestDb>(mode: ClaimMode, restart: fn() -> Duration) {
    let fx = Fixture::<D>::new(mode, |b| {
        if mode == ClaimMode::Lease {
            b.lease_seconds(15)
        } else {
            b
        }
    })
    .await;
    let database = fx.broker.backend().capabilities().database;
    let q = fx.queue().await;
    let ids = fx.publish(&q, RESTART_ROWS).await;
    // Slow deletes (a trigger): most acks are on the wire when the server stops, so the restart
    // cuts statements mid-flight, not only idle connections (a pool acquire waits out a down
    // server by itself).
    assert!(D::slow_down_deletes(&fx.broker, fx.table.name()).await);
    let (sub, runs) = subscribe_counting::<D>(&q, Duration::from_millis(100));
    let ran = |runs: &Runs| runs.lock().unwrap().len();
    wait_until("a third of the drain", Duration::from_secs(60), || {
        let runs = runs.clone();
        async move { ran(&runs) >= RESTART_ROWS / 3 }
    })
    .await;
    let in_work = q.metrics().in_work;
    assert!(in_work > 0, "the restart must find handlers in work");
    let down_for = tokio::task::spawn_blocking(restart).await.unwrap();
    // Rows whose claim died with the server come back when their lease runs out (lease) or at
    // once (row lock); the table says when every row is done.
    wait_until_rows_gone::<D>(&q, &ids, Duration::from_secs(90)).await;
    let report_ = sub.shutdown().await;
    assert_eq!(report_.dropped, 0);
    crate::assert_counters_add_up(&q);
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), RESTART_ROWS, "every row ran");
    let reruns: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    let m = q.metrics();
    if mode == ClaimMode::Lease {
        assert!(
            reruns.is_empty(),
            "lease handlers ran again after the restart although their acks could run again in time: {reruns:?} ({m:?})"
        );
    }
    report(&format!(
        "{database} server restart under a {mode} drain: {RESTART_ROWS} rows, {in_work} in work at the restart, server back after {:.1} s, {} handlers ran twice, {} claim errors, {} settlements failed, nothing lost",
        down_for.as_secs_f64(),
        reruns.len(),
        m.claim_errors,
        m.settle_failed,
    ));
    fx.cleanup().await;
}

/// A lease settlement whose first try a killed connection cut runs again on a fresh connection;
/// when another claim took the row between the cut try and the rerun, the rerun must be refused
/// by the fence (`LeaseLost`) and leave that claim's row alone. Two deliveries, one acking and
/// one retrying, send their settlements while a transaction of another broker holds their rows
/// (it has written what another claim writes: the attempt counted again). Their statements
/// wait; the case kills every connection of the settling broker, which cuts both tries, lets
/// the reruns start on fresh connections, and commits the other claim: each rerun then finds a
/// row that holds another token. Only for databases with server connections.
pub async fn a_settlement_run_again_after_a_cut_leaves_another_claims_row_alone<D: TestDb>(
    mode: ClaimMode,
) {
    assert_eq!(mode, ClaimMode::Lease, "a case of lease mode");
    let fx = Fixture::<D>::new(mode, |b| b.lease_seconds(60)).await;
    let database = fx.broker.backend().capabilities().database;
    let settling = D::connect(&fx.url).await;
    let q = settling
        .queue::<D::Job>(fx.table.clone())
        .await
        .expect("the settling broker's queue");
    let ids = fx.publish(&q, 2).await;
    let acking = crate::claim_one(&q).await;
    let retrying = crate::claim_one(&q).await;
    assert_eq!((acking.id(), retrying.id()), (ids[0], ids[1]));
    // The other claim, not committed yet: it holds both rows' locks until it commits.
    let sql = format!(
        "UPDATE {t} SET {a} = {a} + 1 WHERE {id} IN ({}, {})",
        ids[0],
        ids[1],
        t = D::quote(fx.table.name()),
        a = D::quote(fx.table.attempt()),
        id = D::quote(fx.table.id()),
    );
    let other_claim = D::hold_row_lock(&fx.broker, &sql)
        .await
        .expect("a server database has row locks");
    let ack = tokio::spawn(async move { acking.ack().await });
    let retry = tokio::spawn(async move { retrying.retry().await });
    // Both statements are on the wire, waiting for the other claim's locks.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !ack.is_finished() && !retry.is_finished(),
        "the settlements wait for the rows' locks"
    );
    let killed = D::kill_connections(&settling)
        .await
        .expect("this case runs only where there are server connections to kill");
    assert!(killed >= 2, "the kill cut the two settlements: {killed}");
    // The reruns start after a pause of 50 ms and wait for the locks again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !ack.is_finished() && !retry.is_finished(),
        "the settlements run again after the cut, and wait for the rows' locks"
    );
    let before: Vec<_> = {
        // What the other claim wrote, read before it commits: the rows as they were, plus one
        // attempt.
        let mut rows = Vec::new();
        for id in &ids {
            let mut state = q.row_state(*id).await.unwrap().expect("the row is there");
            state.attempt += 1;
            rows.push(state);
        }
        rows
    };
    let other_claim = other_claim
        .downcast::<sqlx::Transaction<'static, crate::DbOf<D>>>()
        .expect("the held lock is a transaction of the backend's database");
    other_claim.commit().await.expect("the other claim commits");
    let ack = tokio::time::timeout(Duration::from_secs(30), ack)
        .await
        .expect("the rerun ack ends once the other claim commits")
        .expect("the ack task");
    let retry = tokio::time::timeout(Duration::from_secs(30), retry)
        .await
        .expect("the rerun retry ends once the other claim commits")
        .expect("the retry task");
    for (what, id, result) in [("ack", ids[0], ack), ("retry", ids[1], retry)] {
        let err = result.expect_err(&format!(
            "the {what} run again after the cut settled the row another claim holds"
        ));
        assert!(
            matches!(err, SqlxBrokerError::LeaseLost { id: lost, .. } if lost == id),
            "the rerun {what}: {err:?}"
        );
    }
    for (id, expected) in ids.iter().zip(&before) {
        assert_eq!(
            q.row_state(*id).await.unwrap().as_ref(),
            Some(expected),
            "row {id} must stay as the other claim left it"
        );
    }
    let m = q.metrics();
    assert_eq!((m.lease_lost, m.acked, m.retried), (2, 0, 0), "{m:?}");
    report(&format!(
        "{database} lease settlements cut by a kill ({killed} connections) and run again after another claim took their rows: both refused, the rows left alone"
    ));
    settling.close().await;
    fx.cleanup().await;
}
