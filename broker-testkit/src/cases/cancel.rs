//! Cancelling a running job (issue #48, [`Queue::cancel`] of a row in work): the holder's
//! handler is signalled from another broker or process, dropped after the grace if it ignores
//! the signal, and the row is deleted and never runs again, also when its holder is killed
//! while the cancel is pending. No case asserts an upper bound on a time: the waits are bounded
//! only so that a hang fails with the case's name, and the latencies go to the report.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_core::driver::AdminDriver;
use broker_core::{
    Backend, CancelReason, Cancelled, ClaimMode, Outcome, Queue, SubscribeOptions, Subscription,
};

use super::faults::{CHILD_ENV, spawn_child};
use crate::{Fixture, TestDb, assert_counters_add_up, describe, report, wait_until};

/// What the handlers of a case saw, by row.
#[derive(Debug, Default)]
struct Seen {
    starts: HashMap<i64, usize>,
    /// When the cancel signal came, and why.
    signalled: HashMap<i64, (Instant, CancelReason)>,
    /// When the handler's future ended, and whether it returned (rather than being dropped).
    ended: HashMap<i64, (Instant, bool)>,
}

type Log = Arc<Mutex<Seen>>;

/// Owned by a handler's future: notes when it ended, returned or dropped.
struct Ends {
    log: Log,
    id: i64,
    returned: bool,
}

impl Drop for Ends {
    fn drop(&mut self) {
        let mut s = self.log.lock().unwrap_or_else(|p| p.into_inner());
        s.ended.insert(self.id, (Instant::now(), self.returned));
    }
}

fn starts(log: &Log, id: i64) -> usize {
    log.lock().unwrap().starts.get(&id).copied().unwrap_or(0)
}

/// Subscribes handlers that ack every row but `target`, whose handler waits for its cancel
/// signal and then (when `watch`) returns a retry at once, or (not `watch`) ignores it and
/// runs until dropped. Every handler's start, signal and end go into the returned log.
fn subscribe_logging<B: Backend, T>(
    q: &Queue<B, T>,
    target: i64,
    options: SubscribeOptions,
    watch: bool,
) -> (Subscription, Log)
where
    T: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row> + Send + 'static,
{
    let log = Log::default();
    let seen = log.clone();
    let sub = q
        .subscribe(options, move |job| {
            let id = job.id();
            *seen.lock().unwrap().starts.entry(id).or_default() += 1;
            let signal = job.cancel_signal();
            let watcher = seen.clone();
            tokio::spawn(async move {
                let reason = signal.cancelled().await;
                watcher
                    .lock()
                    .unwrap()
                    .signalled
                    .insert(id, (Instant::now(), reason));
            });
            let ends = Ends {
                log: seen.clone(),
                id,
                returned: false,
            };
            async move {
                // The whole guard moves in (not only the field the block writes), so it drops
                // with the future.
                let mut ends = ends;
                if id != target {
                    ends.returned = true;
                    return Outcome::Ack;
                }
                if watch {
                    job.cancelled().await;
                    ends.returned = true;
                    // Whatever it returns after the signal, the row is deleted, not retried.
                    return Outcome::Retry;
                }
                std::future::pending::<()>().await;
                Outcome::Ack
            }
        })
        .expect("subscribe");
    (sub, log)
}

/// The poll interval of a case, and whether signals cross processes without it: on a backend
/// that pushes (PostgreSQL's `NOTIFY`) the poll is longer than any wait of the case, so only the
/// push can bring the cancel in time.
fn poll_of<B: Backend>(backend: &B) -> (Duration, bool) {
    if backend.capabilities().cross_process_wakeups {
        (Duration::from_secs(120), true)
    } else {
        (Duration::from_millis(300), false)
    }
}

/// Waits until no cancel request of `table` is left in the cancel table.
async fn wait_requests_gone<B: Backend>(backend: &B, table: &str) {
    wait_until(
        "the cancel request deleted",
        Duration::from_secs(30),
        || async move {
            backend
                .admin()
                .cancel_requests(table)
                .await
                .expect("read the cancel requests")
                .is_empty()
        },
    )
    .await;
}

/// A row in work is cancelled through another broker: `cancel` says it signalled the holder,
/// the handler sees [`CancelReason::Cancelled`] (on PostgreSQL through `NOTIFY`, with a poll
/// interval longer than the wait; elsewhere within the poll), returns a retry, and yet the row
/// is deleted, counted in `cancelled`, its request deleted, and it never runs again. The
/// other rows run as usual.
pub async fn a_cancel_from_another_broker_signals_the_running_handler_and_the_row_never_runs_again<
    D: TestDb,
>(
    mode: ClaimMode,
) {
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let operator = fx.other_queue().await;
    let (poll, pushed) = poll_of(fx.broker.backend());
    let ids = fx.publish(&q, 3).await;
    let target = ids[1];
    let (sub, log) = subscribe_logging(
        &q,
        target,
        SubscribeOptions::new().concurrency(4).poll_interval(poll),
        true,
    );
    wait_until("the row's handler started", Duration::from_secs(30), || {
        let n = starts(&log, target);
        async move { n == 1 }
    })
    .await;
    let asked = Instant::now();
    let did = operator.cancel(target).await.expect("cancel a row in work");
    assert_eq!(did, Cancelled::Signalled);
    wait_until(
        "the handler saw the cancel signal",
        Duration::from_secs(30),
        || {
            let got = log.lock().unwrap().signalled.contains_key(&target);
            async move { got }
        },
    )
    .await;
    let (at, reason) = log.lock().unwrap().signalled[&target];
    assert_eq!(reason, CancelReason::Cancelled);
    wait_until("the cancelled row deleted", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.row_state(target).await.unwrap().is_none() }
    })
    .await;
    crate::wait_until_rows_gone::<D>(&q, &ids, Duration::from_secs(30)).await;
    wait_requests_gone(fx.broker.backend(), fx.table.name()).await;
    // Long enough for a claim that would take the row again to have run.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        starts(&log, target),
        1,
        "the cancelled row never runs again"
    );
    let ended = log.lock().unwrap().ended.get(&target).copied();
    assert!(
        ended.is_some_and(|(_, returned)| returned),
        "the handler returned on its signal: {ended:?}"
    );
    assert_eq!(sub.shutdown().await.dropped, 0);
    let m = q.metrics();
    assert_eq!((m.cancelled, m.acked, m.retried), (1, 2, 0), "{m:?}");
    assert_counters_add_up(&q);
    report(&format!(
        "cancel: {} {mode}: a cancel through another broker reached the handler in {} ms ({}, poll {} ms)",
        fx.broker.backend().capabilities().database,
        (at - asked).as_millis(),
        if pushed { "NOTIFY" } else { "the poll" },
        poll.as_millis(),
    ));
    fx.cleanup().await;
}

/// A handler that ignores its cancel signal is dropped once the grace has passed, and then the
/// row is deleted (not retried, though the drop looks like a failure) and never runs again.
pub async fn a_handler_that_ignores_a_cancel_is_dropped_after_the_grace<D: TestDb>(
    mode: ClaimMode,
) {
    const GRACE: Duration = Duration::from_millis(1500);
    let mut fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let operator = fx.other_queue().await;
    let (poll, _) = poll_of(fx.broker.backend());
    let target = fx.publish(&q, 1).await[0];
    let (sub, log) = subscribe_logging(
        &q,
        target,
        SubscribeOptions::new()
            .poll_interval(poll)
            .cancel_grace(GRACE),
        false,
    );
    wait_until("the row's handler started", Duration::from_secs(30), || {
        let n = starts(&log, target);
        async move { n == 1 }
    })
    .await;
    // Before the signal can be raised: the drop comes a grace after the signal, so after this
    // too. (The watcher task's own note of the signal can come late on a loaded machine.)
    let asked = Instant::now();
    assert_eq!(
        operator.cancel(target).await.expect("cancel"),
        Cancelled::Signalled
    );
    wait_until("the handler dropped", Duration::from_secs(30), || {
        let got = log.lock().unwrap().ended.contains_key(&target);
        async move { got }
    })
    .await;
    let (_, reason) = log.lock().unwrap().signalled[&target];
    let (ended, returned) = log.lock().unwrap().ended[&target];
    assert_eq!(reason, CancelReason::Cancelled);
    assert!(!returned, "a pending handler cannot return");
    assert!(ended >= asked + GRACE, "dropped only once the grace passed");
    wait_until("the cancelled row deleted", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.row_state(target).await.unwrap().is_none() }
    })
    .await;
    wait_requests_gone(fx.broker.backend(), fx.table.name()).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        starts(&log, target),
        1,
        "the cancelled row never runs again"
    );
    assert_eq!(sub.shutdown().await.dropped, 0);
    let m = q.metrics();
    assert_eq!((m.cancelled, m.retried, m.timed_out), (1, 0, 0), "{m:?}");
    assert_counters_add_up(&q);
    fx.cleanup().await;
}

/// The child of [`a_row_whose_holder_is_killed_while_a_cancel_is_pending_never_runs_again`]:
/// claims the row, prints `STARTED <id>`, and holds it (ignoring the cancel signal, with a grace
/// longer than the case) until it is killed.
async fn holding_child<D: TestDb>(spec: &str) {
    let mut parts = spec.splitn(3, '|');
    let (mode, table, url) = (
        crate::__private::mode(parts.next().unwrap()),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let broker = D::connect(url).await;
    let queue = broker
        .queue::<D::Job>(holding_table(table, mode))
        .await
        .expect("the child's queue");
    let _sub = queue
        .subscribe(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(200))
                .cancel_grace(Duration::from_secs(600)),
            |job| async move {
                println!("STARTED {}", job.id());
                std::future::pending::<()>().await;
                Outcome::Ack
            },
        )
        .expect("subscribe");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// The mode's name as the suite spells it (`row_lock`).
fn mode_name(mode: ClaimMode) -> &'static str {
    match mode {
        ClaimMode::RowLock => "row_lock",
        ClaimMode::Lease => "lease",
        _ => "advisory",
    }
}

fn holding_table(name: &str, mode: ClaimMode) -> broker_core::TableDescription {
    let b = describe(name, mode);
    let b = if mode == ClaimMode::Lease {
        b.lease_seconds(2)
    } else {
        b
    };
    b.build().expect("a valid description")
}

/// A child process holds a row in work; a cancel comes through another broker while a
/// surviving subscription (in this process) runs beside it; the child is killed with SIGKILL
/// before it could settle. The survivor claims the row once the database gives it back (row
/// lock and advisory at once, lease after its 2 s) and deletes it without running its handler:
/// the row is never run again, and its request is deleted. Where two processes do not see each
/// other's advisory keys (SQLite) the case does not apply and says so. `test_path` is this test's name in its binary (the child
/// re-runs it).
pub async fn a_row_whose_holder_is_killed_while_a_cancel_is_pending_never_runs_again<D: TestDb>(
    mode: ClaimMode,
    test_path: &str,
) {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        holding_child::<D>(&spec).await;
        return;
    }
    let mut fx = Fixture::<D>::new(mode, |b| {
        if mode == ClaimMode::Lease {
            b.lease_seconds(2)
        } else {
            b
        }
    })
    .await;
    let q = fx.queue().await;
    let operator = fx.other_queue().await;
    let caps = fx.broker.backend().capabilities();
    if mode == ClaimMode::Advisory && caps.process_local_keys {
        crate::report_not_run(&format!(
            "{} advisory: a holder in another process is invisible to this one (keys live in \
             the process), so a cancel from here deletes its row at once; the cross-process \
             cancel of a held row does not apply",
            caps.database
        ));
        fx.cleanup().await;
        return;
    }
    let poll = Duration::from_millis(200);
    let target = fx.publish(&q, 1).await[0];
    let mut child = spawn_child(
        test_path,
        &format!("{}|{}|{}", mode_name(mode), fx.table.name(), fx.url),
        Stdio::null(),
    );
    let stdout = child.stdout.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest prints "test <name> ... " without a newline first, so look anywhere.
            if let Some(at) = line.find("STARTED ") {
                return line[at + "STARTED ".len()..].trim().parse::<i64>().ok();
            }
        }
        None
    });
    let started = match tokio::time::timeout(Duration::from_secs(60), started).await {
        Ok(s) => s.unwrap(),
        Err(_) => {
            let _ = child.kill();
            panic!("the child did not start the row's handler within 60 s");
        }
    };
    assert_eq!(started, Some(target), "the child holds the row");
    let (sub, log) = subscribe_logging(
        &q,
        target,
        SubscribeOptions::new().poll_interval(poll),
        true,
    );
    assert_eq!(
        operator.cancel(target).await.expect("cancel the held row"),
        Cancelled::Signalled
    );
    // The survivor learns of the request by NOTIFY or by its poll.
    tokio::time::sleep(3 * poll).await;
    child.kill().expect("SIGKILL the holder");
    let _ = child.wait();
    wait_until(
        "the survivor deleted the cancelled row",
        Duration::from_secs(30),
        || {
            let q = q.clone();
            async move { q.row_state(target).await.unwrap().is_none() }
        },
    )
    .await;
    wait_requests_gone(fx.broker.backend(), fx.table.name()).await;
    assert_eq!(
        starts(&log, target),
        0,
        "the survivor never ran the cancelled row"
    );
    assert_eq!(sub.shutdown().await.dropped, 0);
    let m = q.metrics();
    assert_eq!((m.cancelled, m.claimed), (1, 1), "{m:?}");
    assert_counters_add_up(&q);
    fx.cleanup().await;
}
