//! A real PostgreSQL server restart (`pg_ctlcluster .. restart -m fast`) in the middle of a
//! drain: the subscription recovers by itself, nothing is lost, and in lease mode no handler
//! runs twice, because the acks the restart cut run again on fresh connections while their
//! leases hold. Row lock's transactions die with the server, so its rows come back at once and
//! the handlers the restart cut run again; nothing is lost there either.
//!
//! This binary restarts the server every other test uses, so it holds one test per mode, run
//! one after the other, and cargo runs test binaries one at a time.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use broker_core::ClaimMode;
use broker_testkit::{Fixture, Runs, TestDb, subscribe_counting, wait_until, wait_until_rows_gone};
use common::Pg;

const ROWS: usize = 300;

/// Restarts the PostgreSQL server the tests use, fast (active sessions are terminated), with
/// the shell command in `SQLX_BROKER_PG_RESTART` (default: `pg_ctlcluster` on the newest
/// Debian-style cluster under /etc/postgresql), and returns once it accepts connections again.
fn restart_server() -> Duration {
    let command = std::env::var("SQLX_BROKER_PG_RESTART").unwrap_or_else(|_| {
        let version = std::fs::read_dir("/etc/postgresql")
            .ok()
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .max()
            .expect(
                "no cluster under /etc/postgresql: set SQLX_BROKER_PG_RESTART to a shell command that restarts the test server (e.g. `pg_ctl -D <data dir> restart -m fast`)",
            );
        format!("pg_ctlcluster --skip-systemctl-redirect {version} main restart -m fast")
    });
    let started = Instant::now();
    let status = Command::new("sh")
        .args(["-c", &command])
        .status()
        .expect("run the restart command");
    assert!(status.success(), "`{command}` failed: {status}");
    for _ in 0..300 {
        let ready = Command::new("pg_isready")
            .args(["-q", "-h", "127.0.0.1", "-p", "5432"])
            .status()
            .is_ok_and(|s| s.success());
        if ready {
            return started.elapsed();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("PostgreSQL did not come back within 30 s of `{command}`");
}

async fn drain_across_a_restart(mode: ClaimMode) {
    let fx = Fixture::<Pg>::new(mode, |b| {
        if mode == ClaimMode::Lease {
            // Long enough to outlast the restart, so every cut ack can still land in time.
            b.lease_seconds(15)
        } else {
            b
        }
    })
    .await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, ROWS).await;
    // Slow deletes (a trigger): most acks are on the wire when the server stops, so the restart
    // cuts statements mid-flight, not only idle connections (a pool acquire waits out a down
    // server by itself).
    assert!(Pg::slow_down_deletes(&fx.broker, fx.table.name()).await);
    // Long enough that the restart finds handlers in work, whose acks then meet the restart.
    let (sub, runs) = subscribe_counting::<Pg>(&q, Duration::from_millis(100));
    let ran = |runs: &Runs| runs.lock().unwrap().len();
    wait_until("a third of the drain", Duration::from_secs(60), || {
        let runs = runs.clone();
        async move { ran(&runs) >= ROWS / 3 }
    })
    .await;
    let in_work = q.metrics().in_work;
    assert!(in_work > 0, "the restart must find handlers in work");
    let down_for = tokio::task::spawn_blocking(restart_server).await.unwrap();
    // Rows whose claim died with the server come back when their lease runs out (lease) or at
    // once (row lock); the table says when every row is done.
    wait_until_rows_gone::<Pg>(&q, &ids, Duration::from_secs(90)).await;
    let report = sub.shutdown().await;
    assert_eq!(report.dropped, 0);
    broker_testkit::assert_counters_add_up(&q);
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), ROWS, "every row ran");
    let reruns: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    let m = q.metrics();
    if mode == ClaimMode::Lease {
        assert!(
            reruns.is_empty(),
            "lease handlers ran again after the restart although their acks could run again in time: {reruns:?} ({m:?})"
        );
    }
    broker_testkit::report(&format!(
        "PostgreSQL server restart under a {mode} drain: {ROWS} rows, {in_work} in work at the restart, server back after {:.1} s, {} handlers ran twice, {} claim errors, {} settlements failed, nothing lost",
        down_for.as_secs_f64(),
        reruns.len(),
        m.claim_errors,
        m.settle_failed,
    ));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_restart_mid_drain_loses_nothing_and_reruns_no_lease_handler() {
    drain_across_a_restart(ClaimMode::Lease).await;
    drain_across_a_restart(ClaimMode::RowLock).await;
}
