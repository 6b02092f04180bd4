//! The PostgreSQL test database: a database of its own per test, brokers with an application
//! name of their own, and probes of `pg_locks` and `pg_stat_activity`.
//!
//! Advisory keys are scoped to a database, and the conformance cases of every mode use the same
//! keys (`key-k0`, ..): in one shared database, tests running side by side would wait on each
//! other's keys and see each other's locks. A database per test (about 0.1 s to create) keeps
//! them apart; tables are unique per test as well.
//!
//! The server comes from `SQLX_BROKER_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`). An unreachable server fails the tests.

#![allow(dead_code)]

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker_core::Broker;
use broker_postgres::{PgBackend, PgBroker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};

/// The server URL (its database is where test databases are created from).
pub(crate) fn base_url() -> String {
    std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

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

/// How long a test waits for a connection while the server has none free (`max_connections`
/// reached, SQLSTATE 53300): other test runs beside this one hold them for a while, and a
/// case that waits them out has lost nothing. The pools wait as long (`acquire_timeout`: sqlx
/// retries that refusal until then, and reports `PoolTimedOut`).
pub(crate) const SERVER_FULL_WAIT: Duration = Duration::from_secs(120);

/// A connection to the base database, for administration and probes. A server with no
/// connection free is asked again every quarter second, up to [`SERVER_FULL_WAIT`].
pub(crate) async fn admin() -> PgConnection {
    let url = base_url();
    let tries = SERVER_FULL_WAIT.as_millis() / 250;
    for _ in 0..tries {
        match tokio::time::timeout(Duration::from_secs(10), PgConnection::connect(&url)).await {
            Ok(Ok(conn)) => return conn,
            Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("53300") => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok(Err(e)) => panic!("PostgreSQL at {url} is unreachable: {e}"),
            Err(_) => panic!("PostgreSQL at {url} did not answer within 10 s"),
        }
    }
    panic!(
        "PostgreSQL at {url} had no connection free for {SERVER_FULL_WAIT:?} (max_connections \
         reached): other test runs on the server hold them; run fewer at once or raise it"
    )
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (url, None),
    };
    let scheme_end = head.find("://").map_or(0, |i| i + 3);
    let host_end = head[scheme_end..]
        .find('/')
        .map_or(head.len(), |i| scheme_end + i);
    let mut out = format!("{}/{database}", &head[..host_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Drops test databases left behind by test processes that are gone (a test that panicked does
/// not clean up). Runs once per process.
async fn sweep_stale_databases(admin: &mut PgConnection) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT datname::text FROM pg_database WHERE datname LIKE 'sb\\_db\\_%'",
            )
            .fetch_all(&mut *admin)
            .await
            .unwrap_or_default();
            for name in names {
                let pid = name.split('_').nth(2).and_then(|p| p.parse::<u32>().ok());
                let gone = pid.is_some_and(|pid| {
                    pid != std::process::id()
                        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
                });
                if gone {
                    let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote(&name));
                    let _ = admin.execute(AssertSqlSafe(sql)).await;
                }
            }
        })
        .await;
}

/// A fresh database for one test; returns its URL.
pub(crate) async fn create_database() -> String {
    let mut admin = admin().await;
    sweep_stale_databases(&mut admin).await;
    let name = broker_testkit::unique_name("db");
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE {}", quote(&name))))
        .await
        .expect("create the test database");
    let _ = admin.close().await;
    with_database(&base_url(), &name)
}

/// Drops a database [`create_database`] made, ending its sessions.
pub(crate) async fn drop_database(url: &str) {
    let Ok(options) = PgConnectOptions::from_str(url) else {
        return;
    };
    let Some(name) = options.get_database().map(str::to_owned) else {
        return;
    };
    if !name.starts_with("sb_db_") {
        return;
    }
    let mut admin = admin().await;
    let _ = admin
        .execute(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote(&name)
        )))
        .await;
    let _ = admin.close().await;
}

/// A broker with a pool of its own on `url`, whose sessions carry an application name no other
/// broker uses (so probes can tell its sessions apart).
pub(crate) async fn connect(url: &str) -> PgBroker {
    connect_with_settings(url, &[]).await
}

/// [`connect`] with run-time settings for each of the pool's sessions, sent at connect
/// (`-c name=value`): the server's own settings stay as they are.
pub(crate) async fn connect_with_settings(url: &str, settings: &[(&str, &str)]) -> PgBroker {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let options = PgConnectOptions::from_str(url)
        .expect("a PostgreSQL URL")
        .options(settings.iter().copied());
    let app = format!(
        "sb_{}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        options.get_database().unwrap_or("")
    );
    let app: String = app.chars().take(63).collect();
    // Ten connections serve eight deliveries in work (row lock and advisory hold one each), the
    // claims and the listener; idle ones close soon, so cases running side by side (the stress
    // case runs five brokers) stay under the server's connection limit. Other test runs on the
    // server can still fill it for a while: an acquire waits that out (see SERVER_FULL_WAIT)
    // rather than failing the case with `PoolTimedOut`.
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .min_connections(0)
        .idle_timeout(Duration::from_secs(5))
        .acquire_timeout(SERVER_FULL_WAIT)
        .connect_with(options.application_name(&app))
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"));
    Broker::new(PgBackend::new(pool))
}

/// The application name of a broker's sessions.
pub(crate) fn app_name(broker: &PgBroker) -> String {
    broker
        .pool()
        .connect_options()
        .get_application_name()
        .unwrap_or_default()
        .to_owned()
}

/// Whether any session in the broker's database holds the advisory key `key` now.
pub(crate) async fn key_is_held(broker: &PgBroker, key: &str) -> bool {
    broker
        .backend()
        .is_key_held(key)
        .await
        .expect("probe the key")
}

/// Terminates every session of the broker's pool (by its application name) from another
/// session; returns how many. From PostgreSQL 14 on it waits (up to 5 s each) until the sessions
/// are gone, so their locks are free when it returns; before, it only signals them.
pub(crate) async fn kill_connections(broker: &PgBroker) -> usize {
    let mut admin = admin().await;
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&mut admin)
        .await
        .expect("read the server version");
    let terminate = if version >= 140_000 {
        "pg_terminate_backend(pid, 5000)"
    } else {
        "pg_terminate_backend(pid)"
    };
    let killed: Vec<bool> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {terminate} FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()"
    )))
    .bind(app_name(broker))
    .fetch_all(&mut admin)
    .await
    .expect("terminate the broker's sessions");
    let _ = admin.close().await;
    killed.into_iter().filter(|k| *k).count()
}

/// Advisory locks held by the broker's sessions.
pub(crate) async fn advisory_locks_of(app: &str) -> i64 {
    let mut admin = admin().await;
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND a.application_name = $1",
    )
    .bind(app)
    .fetch_one(&mut admin)
    .await
    .expect("probe pg_locks");
    let _ = admin.close().await;
    n
}

/// Sessions of the broker's pool that sit in an open transaction.
pub(crate) async fn open_transactions_of(app: &str) -> i64 {
    let mut admin = admin().await;
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(app)
    .fetch_one(&mut admin)
    .await
    .expect("probe pg_stat_activity");
    let _ = admin.close().await;
    n
}

/// What the broker leaves behind that it should not: advisory locks, open transactions, pool
/// connections in use. Connections go back to the pool in tasks of their own, so this waits up
/// to 3 s for the figures to settle before it reports them.
pub(crate) async fn leaks(broker: &PgBroker) -> Vec<String> {
    let app = app_name(broker);
    let mut polls = 0;
    loop {
        polls += 1;
        let mut out = Vec::new();
        let locks = advisory_locks_of(&app).await;
        if locks > 0 {
            out.push(format!("{locks} advisory locks held"));
        }
        let open = open_transactions_of(&app).await;
        if open > 0 {
            out.push(format!("{open} sessions idle in transaction"));
        }
        let pool = broker.pool();
        if !pool.is_closed() {
            let in_use = usize::try_from(pool.size())
                .unwrap_or(usize::MAX)
                .saturating_sub(pool.num_idle());
            if in_use > 0 {
                out.push(format!("{in_use} pool connections in use"));
            }
        }
        if out.is_empty() || polls > 60 {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The conformance suite's view of PostgreSQL.
pub(crate) struct Pg;

/// PostgreSQL whose brokers' sessions read a backslash in a plain string literal as an escape
/// (`standard_conforming_strings` off, set per session at connect), so `'a\'b'` is one
/// literal there and a literal that only doubles quotes ends early. Otherwise [`Pg`].
pub(crate) struct PgBackslashEscapes;

impl broker_testkit::TestDb for PgBackslashEscapes {
    type B = PgBackend;
    type Job = broker_testkit::Job;
    type Text = String;

    async fn database() -> String {
        create_database().await
    }

    async fn connect(url: &str) -> Broker<PgBackend> {
        let broker = connect_with_settings(url, &[("standard_conforming_strings", "off")]).await;
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
        Some(kill_connections(broker).await)
    }

    async fn execute(broker: &PgBroker, sql: &str) -> u64 {
        <Pg as broker_testkit::TestDb>::execute(broker, sql).await
    }

    async fn leaks(broker: &PgBroker) -> Vec<String> {
        leaks(broker).await
    }

    async fn drop_database(url: &str) {
        drop_database(url).await;
    }
}

impl broker_testkit::TestDb for Pg {
    type B = PgBackend;
    type Job = broker_testkit::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn hold_row_lock(broker: &PgBroker, sql: &str) -> Option<Box<dyn std::any::Any + Send>> {
        Some(broker_testkit::hold_row_lock_on(broker.pool(), sql).await)
    }

    async fn session_id(conn: &mut sqlx::PgConnection) -> Option<i64> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("pg_backend_pid()");
        Some(i64::from(pid))
    }

    async fn database() -> String {
        create_database().await
    }

    async fn connect(url: &str) -> Broker<PgBackend> {
        connect(url).await
    }

    async fn key_is_held(broker: &PgBroker, key: &str) -> bool {
        key_is_held(broker, key).await
    }

    async fn kill_connections(broker: &PgBroker) -> Option<usize> {
        Some(kill_connections(broker).await)
    }

    async fn execute(broker: &PgBroker, sql: &str) -> u64 {
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(broker.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn leaks(broker: &PgBroker) -> Vec<String> {
        leaks(broker).await
    }

    async fn drop_database(url: &str) {
        drop_database(url).await;
    }

    async fn slow_down_deletes(broker: &PgBroker, table: &str) -> bool {
        let function = format!("{}_slow_delete", table);
        let statements = [
            format!(
                "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN PERFORM pg_sleep(0.02); RETURN OLD; END $$",
                f = quote(&function)
            ),
            format!(
                "CREATE TRIGGER {t} BEFORE DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION {f}()",
                t = quote(&format!("{table}_slow")),
                table = quote(table),
                f = quote(&function)
            ),
        ];
        for sql in statements {
            broker
                .pool()
                .execute(AssertSqlSafe(sql))
                .await
                .expect("create the slow-delete trigger");
        }
        true
    }
}
