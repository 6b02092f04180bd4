//! Faults: killed worker processes and killed database connections, checked by the history
//! checker (the stress run, with its own faults, is in `stress`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use broker_core::{Backend, ClaimMode, Outcome, Queue, SubscribeOptions, TableDescription};

use crate::history::{Expect, Final, History, Recorded};
use crate::{Fixture, JobText, TestDb, describe, wait_until};

/// The environment variable that turns a test binary into a kill test's worker.
pub const CHILD_ENV: &str = "SQLX_BROKER_CHILD_WORKER";

/// Re-runs this test binary as a child process that runs only `test_path` (this test's name
/// with its crate, e.g. `conformance::lease::a_killed_worker_gives_its_rows_back`), with
/// [`CHILD_ENV`] set to `spec`, its stdout piped.
pub(crate) fn spawn_child(test_path: &str, spec: &str, stderr: Stdio) -> Child {
    let test_name = test_path
        .split_once("::")
        .map_or(test_path, |(_, rest)| rest)
        .to_owned();
    Command::new(std::env::current_exe().unwrap())
        .args([
            test_name.as_str(),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, spec)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn a child process")
}

/// The kill test's worker: run in a child process (the test binary itself, re-run with
/// [`CHILD_ENV`] set), it claims rows, prints `STARTED <id> <attempt>` and sleeps until killed.
async fn child_worker<D: TestDb>(spec: &str) {
    let mut parts = spec.splitn(3, '|');
    let (mode, table, url) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let mode = match mode {
        "row_lock" => ClaimMode::RowLock,
        "lease" => ClaimMode::Lease,
        _ => ClaimMode::Advisory,
    };
    let broker = D::connect(url).await;
    let queue = broker
        .queue::<D::Job>(kill_table(table, mode))
        .await
        .expect("the child's queue");
    let _sub = queue
        .subscribe(
            SubscribeOptions::new().concurrency(4).batch_size(4),
            |job| async move {
                println!("STARTED {} {}", job.id(), job.attempt());
                tokio::time::sleep(Duration::from_secs(300)).await;
                Outcome::Ack
            },
        )
        .expect("subscribe");
    tokio::time::sleep(Duration::from_secs(300)).await;
}

fn kill_table(name: &str, mode: ClaimMode) -> TableDescription {
    let b = describe(name, mode);
    let b = if mode == ClaimMode::Lease {
        b.lease_seconds(2)
    } else {
        b
    };
    b.build().expect("the kill test's description is valid")
}

/// A worker process killed with SIGKILL mid-handler gives its rows back as its mode says: row
/// lock at once with the attempt unused; lease after the lease (2 s) with one attempt used;
/// advisory at once with one attempt used and the keys free. `test_path` is this test's name in
/// its binary (the child re-runs it).
pub async fn a_killed_worker_gives_its_rows_back<D: TestDb>(mode: ClaimMode, test_path: &str) {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child_worker::<D>(&spec).await;
        return;
    }
    let fx = Fixture::<D>::new(mode, |b| {
        if mode == ClaimMode::Lease {
            b.lease_seconds(2)
        } else {
            b
        }
    })
    .await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 4).await;
    let mode_name = match mode {
        ClaimMode::RowLock => "row_lock",
        ClaimMode::Lease => "lease",
        ClaimMode::Advisory => "advisory",
        other => panic!("the suite has no case for claim mode {other:?}"),
    };
    let mut child = spawn_child(
        test_path,
        &format!("{mode_name}|{}|{}", fx.table.name(), fx.url),
        Stdio::null(),
    );
    let stdout = child.stdout.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        let mut started = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest prints "test <name> ... " without a newline first, so look anywhere.
            if let Some(at) = line.find("STARTED ") {
                let rest = &line[at + "STARTED ".len()..];
                let mut it = rest.split(' ').map(|x| x.parse::<i64>().unwrap());
                started.push((it.next().unwrap(), it.next().unwrap()));
                if started.len() == 4 {
                    break;
                }
            }
        }
        started
    });
    let started = match tokio::time::timeout(Duration::from_secs(60), started).await {
        Ok(s) => s.unwrap(),
        Err(_) => {
            let _ = child.kill();
            panic!("the worker process did not start four handlers within 60 s");
        }
    };
    assert_eq!(
        started.len(),
        4,
        "the worker started four handlers: {started:?}"
    );
    assert!(started.iter().all(|(_, attempt)| *attempt == 1));
    // The leases the killed worker holds, as the rows hold them.
    let mut expiries = BTreeMap::new();
    for id in &ids {
        let state = q.row_state(*id).await.unwrap().expect("the row is queued");
        expiries.insert(*id, state.locked_until_ms);
    }
    child.kill().expect("SIGKILL the worker");
    let _ = child.wait();
    // What the killed deliveries spent, as the rows hold it (the column starts at 1): row lock
    // nothing (its transactions roll back, and the count was never committed on its own),
    // lease and advisory one attempt each (their claims commit the count).
    let stored = 1 + i64::from(mode != ClaimMode::RowLock);
    for id in &ids {
        let state = q.row_state(*id).await.unwrap().expect("the row is queued");
        assert_eq!(
            state.attempt, stored,
            "row {id}: the stored attempt after the worker was killed mid-handler ({mode})"
        );
    }
    // Measured for the report only; the checks below compare states, not durations.
    let killed_at = Instant::now();

    if mode == ClaimMode::Lease {
        assert!(
            q.claim(4).await.unwrap().is_empty(),
            "the leases still hold right after the kill"
        );
    }
    let mut back = Vec::new();
    let mut polls = 0;
    while back.len() < 4 {
        polls += 1;
        assert!(
            polls < 750,
            "the killed worker's rows came back: {} of 4",
            back.len()
        );
        let got = q.claim(4).await.unwrap();
        let claimed_by = broker_core::driver::clock::now_ms();
        for d in &got {
            match (mode, expiries[&d.id()]) {
                (ClaimMode::Lease, Some(expiry)) => assert!(
                    claimed_by >= expiry,
                    "row {} came back before its lease ran out ({claimed_by} < {expiry})",
                    d.id()
                ),
                (ClaimMode::Lease, None) => panic!("row {} was not leased by the worker", d.id()),
                (_, expiry) => assert_eq!(expiry, None, "no lease in {mode} mode"),
            }
        }
        back.extend(got);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waited = killed_at.elapsed();
    let expected = if mode == ClaimMode::RowLock { 1 } else { 2 };
    let mut seen: Vec<i64> = back.iter().map(|d| d.id()).collect();
    seen.sort_unstable();
    assert_eq!(seen, ids);
    for d in back {
        assert_eq!(d.attempt(), expected, "row {} after the kill", d.id());
        d.ack().await.unwrap();
    }
    for i in 0..4 {
        assert!(!D::key_is_held(&fx.broker, &format!("key-k{i}")).await);
    }
    let leaks = D::leaks(&fx.broker).await;
    assert!(leaks.is_empty(), "{leaks:?}");
    crate::report(&format!(
        "kill -9 {mode} on {}: 4 deliveries killed mid-handler, back after {:.1}s at attempt {expected}, no leaks",
        fx.broker.backend().capabilities().database,
        waited.as_secs_f64()
    ));
    fx.cleanup().await;
}

/// Killing the database connections under deliveries in work and under claims loses nothing.
/// A FIFO table (rows in eight groups) is drained by a victim broker whose connections are
/// terminated three times, then by a helper. Each kill marks the deliveries it reached (the
/// victim's handlers running then, and its settlements still on the wire), the run fails if the
/// kills reached none, and the history checker checks every other delivery in full and those as
/// their mode promises. Both brokers, which did the work, must leak nothing.
pub async fn killed_connections_lose_nothing<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| {
        let b = b.group("grp").fifo(true);
        if mode == ClaimMode::Lease {
            b.lease_seconds(1)
        } else {
            b
        }
    })
    .await;
    let victim = D::connect(&fx.url).await;
    assert!(
        D::kill_connections(&victim).await.is_some(),
        "the suite stamps this case only for databases with server connections"
    );
    let helper = D::connect(&fx.url).await;
    let q = victim.queue::<D::Job>(fx.table.clone()).await.unwrap();
    let hq = helper.queue::<D::Job>(fx.table.clone()).await.unwrap();
    let group = |i: usize| format!("g{}", i % 8);
    let jobs: Vec<_> = (0..120).map(|i| fx.job(i).group(group(i))).collect();
    let ids = q.publish_batch(&jobs).await.unwrap();
    let history = Arc::new(History::new(fx.table.name()));
    let subscribe = |q: &Queue<D::B, D::Job>, index: usize| {
        let history = history.clone();
        q.subscribe(
            SubscribeOptions::new()
                .name(History::subscription_name(index))
                .concurrency(4)
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |job| {
                let history = history.clone();
                async move {
                    let i: usize = job.payload().text()["job-".len()..].parse().unwrap();
                    let at = history.start(
                        index,
                        job.id(),
                        job.attempt(),
                        job.key().map(str::to_owned),
                        Some(group(i)),
                        job.lease_expires_ms(),
                    );
                    // Long enough that a kill finds handlers running, short enough that most
                    // deliveries run between kills and get every check.
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    history.finish(at, Recorded::Ack);
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe")
    };
    let s1 = subscribe(&q, 0);
    let mut terminated = 0;
    let mut cuts = Vec::new();
    for target in [20, 50, 80] {
        wait_until(
            &format!("{target} rows handled"),
            Duration::from_secs(60),
            || {
                let h = history.clone();
                async move { h.finished_rows(None) >= target }
            },
        )
        .await;
        let from = history.now();
        terminated += D::kill_connections(&victim).await.unwrap_or(0);
        cuts.push(history.connections_killed(0, from, history.now()));
    }
    // A second broker drains what the victim cannot (a lost lease, a row it rolled back).
    let s2 = subscribe(&hq, 1);
    wait_until("the table to drain", Duration::from_secs(60), || {
        let hq = hq.clone();
        let ids = ids.clone();
        async move {
            for id in ids {
                if hq.row_state(id).await.unwrap().is_some() {
                    return false;
                }
            }
            true
        }
    })
    .await;
    assert_eq!(s1.shutdown().await.dropped, 0);
    assert_eq!(s2.shutdown().await.dropped, 0);
    crate::assert_counters_add_up(&q);
    crate::assert_counters_add_up(&hq);
    let finals: BTreeMap<i64, Final> = ids.iter().map(|id| (*id, Final::Gone)).collect();
    let expect = Expect {
        mode,
        fifo: true,
        max_attempts: None,
        finals,
    };
    let figures = match history.check(&expect) {
        Ok(f) => f,
        Err(problems) => panic!("the history check failed (cuts per kill {cuts:?}):\n{problems}"),
    };
    assert!(terminated > 0, "some connections were terminated");
    // The kills are told apart from claims in flight by the engine's typed claim events: a
    // history where none arrived would check every delivery as if its claim were unknown.
    assert!(
        history.records().iter().all(|r| r.claim.is_some()),
        "every delivery's claim reached the history as an engine event"
    );
    assert!(
        cuts.iter().any(|c| c.in_handler > 0),
        "the kills must reach deliveries in work: cuts per kill {cuts:?}"
    );
    let mut leaks = D::leaks(&victim).await;
    leaks.extend(D::leaks(&helper).await);
    assert!(leaks.is_empty(), "{leaks:?}");
    victim.close().await;
    helper.close().await;
    crate::report(&format!(
        "killed connections {mode} on {}: {terminated} connections terminated in 3 kills, cut per kill: {}; 120 rows in {} deliveries, history check passed on the other {}, no leaks",
        fx.broker.backend().capabilities().database,
        cuts.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        figures.deliveries,
        figures.deliveries - figures.cut,
    ));
    fx.cleanup().await;
}
