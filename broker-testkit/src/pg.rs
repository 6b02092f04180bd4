//! PostgreSQL test databases (feature `postgres`): brokers whose sessions carry an application
//! name of their own, the probes of `pg_locks` and `pg_stat_activity` the cases ask for, and a
//! [`TestDb`] for every place a run may work in ([`PgPlace`]).
//!
//! The backend's tests use [`PgDb<PerCase>`](PerCase): a database of their own per test case
//! on the server of `SQLX_BROKER_PG_URL`. `sqlx-broker check` uses a place of its own (a
//! scratch schema on the user's server).

use std::marker::PhantomData;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker_core::Broker;
use broker_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use broker_postgres::sqlx::{self, AssertSqlSafe, Connection, Executor, PgConnection};
use broker_postgres::{PgBackend, PgBroker};

use crate::TestDb;

/// Where the cases of a [`PgDb`] work, and how its sessions are named.
pub trait PgPlace: Send + Sync + 'static {
    /// The start of the application name of every broker session (`<prefix><n>_<database>`);
    /// unique to the process, so its sessions can be found and ended.
    fn app_prefix() -> String;
    /// The URL the probes (and [`kill_connections`]) connect to.
    fn admin_url() -> String;
    /// The URL a case's brokers connect to; see [`TestDb::database`].
    fn database() -> impl Future<Output = String> + Send;
    /// Removes what [`database`](Self::database) made; see [`TestDb::drop_database`].
    fn drop_database(url: &str) -> impl Future<Output = ()> + Send {
        let _ = url;
        async {}
    }
    /// Run-time settings of each broker session, sent at connect (`-c name=value`).
    const SETTINGS: &'static [(&'static str, &'static str)] = &[];
}

/// How long a probe or a pool waits for a connection while the server has none free
/// (`max_connections` reached, SQLSTATE 53300): other runs on the server hold them for a while,
/// and a case that waits them out has lost nothing.
pub const SERVER_FULL_WAIT: Duration = Duration::from_secs(120);

/// `name` quoted as a PostgreSQL identifier.
pub fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A connection of its own to `url`, for administration and probes. A server with no
/// connection free is asked again every quarter second, up to [`SERVER_FULL_WAIT`].
///
/// # Panics
/// Where the server is unreachable or stays full.
pub async fn admin_at(url: &str) -> PgConnection {
    let tries = SERVER_FULL_WAIT.as_millis() / 250;
    for _ in 0..tries {
        match tokio::time::timeout(Duration::from_secs(20), PgConnection::connect(url)).await {
            Ok(Ok(conn)) => return conn,
            Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("53300") => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok(Err(e)) => panic!("PostgreSQL is unreachable: {e}"),
            Err(_) => panic!("PostgreSQL did not answer within 20 s"),
        }
    }
    panic!(
        "PostgreSQL had no connection free for {SERVER_FULL_WAIT:?} (max_connections reached): \
         other runs on the server hold them; run fewer at once or raise it"
    )
}

/// A broker with a pool of its own on `url`, whose sessions carry an application name no other
/// broker uses (`<prefix><n>_<database>`, cut to 63 bytes) and the run-time `settings`.
///
/// # Panics
/// Where `url` is no PostgreSQL URL or the server is unreachable.
pub async fn connect_named(url: &str, prefix: &str, settings: &[(&str, &str)]) -> PgBroker {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let options = PgConnectOptions::from_str(url)
        .expect("a PostgreSQL URL")
        .options(settings.iter().copied());
    let app = format!(
        "{prefix}{}_{}",
        NEXT.fetch_add(1, Ordering::Relaxed),
        options.get_database().unwrap_or("")
    );
    let app: String = app.chars().take(63).collect();
    // Ten connections serve eight deliveries in work (row lock and advisory hold one each), the
    // claims and the listener; idle ones close soon, so cases running side by side (the stress
    // case runs five brokers) stay under the server's connection limit. Other runs on the
    // server can still fill it for a while: an acquire waits that out (SERVER_FULL_WAIT)
    // rather than failing the case with `PoolTimedOut`.
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .min_connections(0)
        .idle_timeout(Duration::from_secs(5))
        .acquire_timeout(SERVER_FULL_WAIT)
        .connect_with(options.application_name(&app))
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL is unreachable: {e}"));
    Broker::new(PgBackend::new(pool))
}

/// The application name of a broker's sessions.
pub fn app_name(broker: &PgBroker) -> String {
    broker
        .pool()
        .connect_options()
        .get_application_name()
        .unwrap_or_default()
        .to_owned()
}

/// Whether any session in the broker's database holds the advisory key `key` now.
pub async fn key_is_held(broker: &PgBroker, key: &str) -> bool {
    broker
        .backend()
        .is_key_held(key)
        .await
        .expect("probe the key")
}

/// Terminates every session of the broker's pool (by its application name) from a session on
/// `admin_url`; returns how many. From PostgreSQL 14 on it waits (up to 5 s each) until the
/// sessions are gone, so their locks are free when it returns; before, it only signals them.
pub async fn kill_connections(admin_url: &str, broker: &PgBroker) -> usize {
    let mut admin = admin_at(admin_url).await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT CASE WHEN current_setting('server_version_num')::int >= 140000 \
                THEN pg_terminate_backend(pid, 5000) ELSE pg_terminate_backend(pid) END \
         FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(app_name(broker))
    .fetch_all(&mut admin)
    .await
    .expect("terminate the broker's sessions");
    let _ = admin.close().await;
    killed.into_iter().filter(|k| *k).count()
}

async fn count_of(admin_url: &str, sql: &'static str, app: &str) -> i64 {
    let mut admin = admin_at(admin_url).await;
    let n = sqlx::query_scalar(sql)
        .bind(app)
        .fetch_one(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let _ = admin.close().await;
    n
}

/// Advisory locks held by the sessions named `app`.
pub async fn advisory_locks_of(admin_url: &str, app: &str) -> i64 {
    count_of(
        admin_url,
        "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND a.application_name = $1",
        app,
    )
    .await
}

/// Sessions named `app` that sit in an open transaction.
pub async fn open_transactions_of(admin_url: &str, app: &str) -> i64 {
    count_of(
        admin_url,
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
        app,
    )
    .await
}

/// What the broker leaves behind that it should not: advisory locks, open transactions, pool
/// connections in use. Connections go back to the pool in tasks of their own, so this waits up
/// to 3 s for the figures to settle before it reports them.
pub async fn leaks(admin_url: &str, broker: &PgBroker) -> Vec<String> {
    let app = app_name(broker);
    let mut polls = 0;
    loop {
        polls += 1;
        let mut out = Vec::new();
        let locks = advisory_locks_of(admin_url, &app).await;
        if locks > 0 {
            out.push(format!("{locks} advisory locks held"));
        }
        let open = open_transactions_of(admin_url, &app).await;
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

/// Runs `sql` on the broker's pool; returns the rows it touched.
///
/// # Panics
/// Where the statement fails.
pub async fn execute(broker: &PgBroker, sql: &str) -> u64 {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(broker.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .rows_affected()
}

/// The conformance suite's view of PostgreSQL, its cases working in the place `P`.
pub struct PgDb<P>(PhantomData<P>);

impl<P: PgPlace> TestDb for PgDb<P> {
    type B = PgBackend;
    type Job = crate::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn hold_row_lock(broker: &PgBroker, sql: &str) -> Option<Box<dyn std::any::Any + Send>> {
        Some(crate::hold_row_lock_on(broker.pool(), sql).await)
    }

    async fn session_id(conn: &mut PgConnection) -> Option<i64> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("pg_backend_pid()");
        Some(i64::from(pid))
    }

    async fn database() -> String {
        P::database().await
    }

    async fn connect(url: &str) -> PgBroker {
        connect_named(url, &P::app_prefix(), P::SETTINGS).await
    }

    async fn key_is_held(broker: &PgBroker, key: &str) -> bool {
        key_is_held(broker, key).await
    }

    async fn kill_connections(broker: &PgBroker) -> Option<usize> {
        Some(kill_connections(&P::admin_url(), broker).await)
    }

    async fn execute(broker: &PgBroker, sql: &str) -> u64 {
        execute(broker, sql).await
    }

    async fn leaks(broker: &PgBroker) -> Vec<String> {
        leaks(&P::admin_url(), broker).await
    }

    async fn drop_database(url: &str) {
        P::drop_database(url).await;
    }

    async fn slow_down_deletes(broker: &PgBroker, table: &str) -> bool {
        let function = format!("{table}_slow_delete");
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

/// A database of its own per test case, on the server of `SQLX_BROKER_PG_URL` (default
/// `postgres://postgres@127.0.0.1:5432/test`), sessions named `sb_<pid>_..`.
///
/// Advisory keys are scoped to a database, and the cases of every mode use the same keys: in
/// one shared database, tests running side by side would wait on each other's keys and see
/// each other's locks. A database per test (about 0.1 s to create) keeps them apart.
pub struct PerCase;

impl PgPlace for PerCase {
    fn app_prefix() -> String {
        format!("sb_{}_", std::process::id())
    }

    fn admin_url() -> String {
        base_url()
    }

    async fn database() -> String {
        create_database().await
    }

    async fn drop_database(url: &str) {
        drop_database(url).await;
    }
}

/// The server URL of the per-case databases (`SQLX_BROKER_PG_URL`); its database is where they
/// are created from.
pub fn base_url() -> String {
    std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A connection to [`base_url`], for administration and probes.
pub async fn admin() -> PgConnection {
    admin_at(&base_url()).await
}

/// A fresh database for one test on [`base_url`]'s server (first dropping those that test
/// processes now gone left behind); returns its URL.
pub async fn create_database() -> String {
    let mut admin = admin().await;
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT datname::text FROM pg_database WHERE datname LIKE 'sb\\_db\\_%'",
            )
            .fetch_all(&mut admin)
            .await
            .unwrap_or_default();
            for name in names.iter().filter(|n| crate::left_by_a_gone_process(n)) {
                let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote(name));
                let _ = admin.execute(AssertSqlSafe(sql)).await;
            }
        })
        .await;
    let name = crate::unique_name("db");
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE {}", quote(&name))))
        .await
        .expect("create the test database");
    let _ = admin.close().await;
    crate::url_with_database(&base_url(), &name)
}

/// Drops a database [`create_database`] made, ending its sessions; leaves any other alone.
pub async fn drop_database(url: &str) {
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
