//! The PostgreSQL test database: `broker_testkit::pg` with a database of its own per test
//! (`PerCase`), under the names the tests use, and PgBouncer.
//!
//! The server comes from `SQLX_BROKER_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`). An unreachable server fails the tests.

#![allow(dead_code)]

use broker_postgres::{PgBackend, PgBroker};
use broker_testkit::TestDb;
use broker_testkit::pg::{PerCase, PgPlace};
// Each test file uses some of them.
#[allow(unused_imports)]
pub(crate) use broker_testkit::pg::{
    admin, app_name, base_url, create_database, drop_database, key_is_held,
};

/// The conformance suite's view of PostgreSQL: a database per test case.
pub(crate) type Pg = broker_testkit::pg::PgDb<PerCase>;

/// PgBouncer in transaction mode in front of the server (`SQLX_BROKER_PGBOUNCER_URL`, default
/// `postgres://postgres@127.0.0.1:6432/test`).
pub(crate) fn pgbouncer_url() -> String {
    std::env::var("SQLX_BROKER_PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".to_owned())
}

/// Starts the local PgBouncer with the repository's script (`.ci/pgbouncer.sh`, which installs
/// it if missing) when no URL is set, so `cargo test --workspace` works on a fresh machine as it
/// does in CI. Runs once per process.
pub(crate) async fn ensure_local_pgbouncer() {
    static STARTED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    if std::env::var_os("SQLX_BROKER_PGBOUNCER_URL").is_some() {
        return;
    }
    STARTED
        .get_or_init(|| async {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../.ci/pgbouncer.sh");
            let status = tokio::task::spawn_blocking(move || {
                std::process::Command::new("bash").arg(script).status()
            })
            .await
            .expect("the script's task")
            .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
            assert!(
                status.success(),
                "{script} could not start PgBouncer ({status}; its output is above): install \
                 pgbouncer (as root: apt-get install -y pgbouncer), or set \
                 SQLX_BROKER_PGBOUNCER_URL to a PgBouncer in transaction mode"
            );
        })
        .await;
}

/// A broker with a pool of its own on `url`, whose sessions carry an application name no other
/// broker uses (so probes can tell its sessions apart).
pub(crate) async fn connect(url: &str) -> PgBroker {
    Pg::connect(url).await
}

/// Terminates every session of the broker's pool; returns how many.
pub(crate) async fn kill_connections(broker: &PgBroker) -> usize {
    broker_testkit::pg::kill_connections(&base_url(), broker).await
}

/// Advisory locks held by the sessions named `app`.
pub(crate) async fn advisory_locks_of(app: &str) -> i64 {
    broker_testkit::pg::advisory_locks_of(&base_url(), app).await
}

/// Sessions named `app` that sit in an open transaction.
pub(crate) async fn open_transactions_of(app: &str) -> i64 {
    broker_testkit::pg::open_transactions_of(&base_url(), app).await
}

/// What the broker leaves behind that it should not (see `broker_testkit::pg::leaks`).
pub(crate) async fn leaks(broker: &PgBroker) -> Vec<String> {
    Pg::leaks(broker).await
}

/// PostgreSQL whose brokers' sessions read a backslash in a plain string literal as an escape
/// (`standard_conforming_strings` off, set per session at connect), so `'a\'b'` is one
/// literal there and a literal that only doubles quotes ends early. Otherwise [`Pg`].
pub(crate) struct PgBackslashEscapes;

impl TestDb for PgBackslashEscapes {
    type B = PgBackend;
    type Job = broker_testkit::Job;
    type Text = String;

    async fn database() -> String {
        create_database().await
    }

    async fn connect(url: &str) -> PgBroker {
        let broker = broker_testkit::pg::connect_named(
            url,
            &PerCase::app_prefix(),
            &[("standard_conforming_strings", "off")],
        )
        .await;
        let setting: String = sqlx::query_scalar("SHOW standard_conforming_strings")
            .fetch_one(broker.pool())
            .await
            .expect("read standard_conforming_strings");
        assert_eq!(setting, "off", "the session setting took");
        broker
    }

    async fn key_is_held(broker: &PgBroker, key: &str) -> bool {
        key_is_held(broker, key).await
    }

    async fn kill_connections(broker: &PgBroker) -> Option<usize> {
        Pg::kill_connections(broker).await
    }

    async fn execute(broker: &PgBroker, sql: &str) -> u64 {
        Pg::execute(broker, sql).await
    }

    async fn leaks(broker: &PgBroker) -> Vec<String> {
        Pg::leaks(broker).await
    }

    async fn drop_database(url: &str) {
        drop_database(url).await;
    }
}
