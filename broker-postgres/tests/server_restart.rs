//! A real PostgreSQL server restart (`pg_ctlcluster .. restart -m fast`) in the middle of a
//! drain (see `broker_testkit::drain_across_a_server_restart`): the subscription recovers by
//! itself, nothing is lost, and in lease mode no handler runs twice.
//!
//! This binary restarts the server every other test uses, so it holds one test per mode, run
//! one after the other, and cargo runs test binaries one at a time. It runs only with
//! `SQLX_BROKER_DISRUPTIVE=1` (`.ci/run` sets it); a plain `cargo test` lists it as ignored.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use broker_core::ClaimMode;
use broker_testkit::cases::drain_across_a_server_restart;
use common::Pg;

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

broker_testkit::disruptive_test!(
    "restarts the PostgreSQL server at SQLX_BROKER_PG_URL (with SQLX_BROKER_PG_RESTART)",
    async fn a_server_restart_mid_drain_loses_nothing_and_reruns_no_lease_handler() {
        drain_across_a_server_restart::<Pg>(ClaimMode::Lease, restart_server).await;
        drain_across_a_server_restart::<Pg>(ClaimMode::RowLock, restart_server).await;
    }
);
