//! A real MariaDB (or MySQL) server restart in the middle of a drain (see
//! `broker_testkit::cases::drain_across_a_server_restart`): the subscription recovers by itself,
//! nothing is lost, and in lease mode no handler runs twice.
//!
//! This binary restarts the server every other test uses, so it holds one test per mode, run
//! one after the other, and cargo runs test binaries one at a time. It runs only with
//! `SQLX_BROKER_DISRUPTIVE=1` (`.ci/run` sets it); a plain `cargo test` lists it as ignored.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use broker_core::ClaimMode;
use broker_testkit::cases::drain_across_a_server_restart;
use common::MySql;

/// Whether the server answers a ping.
fn server_is_up() -> bool {
    Command::new("mariadb-admin")
        .args([
            "-h",
            "127.0.0.1",
            "-P",
            "3306",
            "-u",
            "root",
            "--connect-timeout=2",
            "ping",
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Restarts the MariaDB server the tests use with the shell command in
/// `SQLX_BROKER_MYSQL_RESTART` (default: `mariadb-admin shutdown`, a wait until the old process
/// has exited, since the shutdown returns before it has, then `/usr/sbin/mariadbd` started again
/// in the background, as `.ci/run` starts it), and returns once it answers again.
///
/// The default goes by the server's own pid file, not the process name: the Galera nodes that
/// `.ci/galera.sh` starts are `mariadbd` processes too, and a wait for "no mariadbd" (or a
/// `start-stop-daemon` matched on the executable alone) would wait for them, or find them and
/// start nothing.
fn restart_server() -> Duration {
    let command = std::env::var("SQLX_BROKER_MYSQL_RESTART").unwrap_or_else(|_| {
        "pidfile=$(mariadb -h 127.0.0.1 -P 3306 -u root -N -B -e 'SELECT @@pid_file') && \
         pid=$(cat \"$pidfile\") && \
         mariadb-admin -h 127.0.0.1 -P 3306 -u root shutdown && \
         while kill -0 \"$pid\" 2>/dev/null; do sleep 0.1; done && \
         start-stop-daemon --start --oknodo --background --pidfile \"$pidfile\" \
           --exec /usr/sbin/mariadbd"
            .to_owned()
    });
    let started = Instant::now();
    let status = Command::new("sh")
        .args(["-c", &command])
        .status()
        .expect("run the restart command");
    assert!(
        status.success(),
        "`{command}` failed: {status}; set SQLX_BROKER_MYSQL_RESTART to a shell command that restarts the test server"
    );
    for _ in 0..600 {
        if server_is_up() {
            return started.elapsed();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("MariaDB did not come back within 60 s of `{command}`");
}

broker_testkit::disruptive_test!(
    "restarts the MariaDB server at SQLX_BROKER_MYSQL_URL (with SQLX_BROKER_MYSQL_RESTART)",
    async fn a_server_restart_mid_drain_loses_nothing_and_reruns_no_lease_handler() {
        drain_across_a_server_restart::<MySql>(ClaimMode::Lease, restart_server).await;
        drain_across_a_server_restart::<MySql>(ClaimMode::RowLock, restart_server).await;
    }
);
