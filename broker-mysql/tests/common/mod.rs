//! The MariaDB / MySQL test database: a database of its own per test, brokers whose server
//! connections are known by id, and probes of locks, transactions and connections.
//!
//! Advisory keys belong to the database (a key is locked as `"<database>:<key>"`), and the
//! conformance cases of every mode use the same keys (`key-k0`, ..): in one shared database,
//! tests running side by side would wait on each other's keys and see each other's locks. A
//! database per test (a few milliseconds to create) keeps them apart; tables are unique per test
//! as well.
//!
//! The server comes from `SQLX_BROKER_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//! An unreachable server fails the tests; it never skips them.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use broker_core::Broker;
use broker_mysql::{MySqlBackend, MySqlBroker};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, MySqlConnection, MySqlPool};

/// The server URL (test databases are created next to its database).
pub(crate) fn base_url() -> String {
    std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A connection of its own (never a broker's), for administration and probes.
pub(crate) async fn admin() -> MySqlConnection {
    let url = base_url();
    match tokio::time::timeout(Duration::from_secs(10), MySqlConnection::connect(&url)).await {
        Ok(Ok(mut conn)) => {
            // A DROP must never wait a year for a metadata lock a broken test left behind.
            conn.execute("SET SESSION lock_wait_timeout = 20")
                .await
                .expect("set lock_wait_timeout");
            conn
        }
        Ok(Err(e)) => panic!("MariaDB/MySQL at {url} is unreachable: {e}"),
        Err(_) => panic!("MariaDB/MySQL at {url} did not answer within 10 s"),
    }
}

fn quote(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
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

/// Drops test databases left behind by test processes that are gone. Once per process.
async fn sweep_stale_databases(admin: &mut MySqlConnection) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(SCHEMA_NAME AS CHAR) FROM information_schema.SCHEMATA \
                 WHERE SCHEMA_NAME LIKE 'sb\\_db\\_%'",
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
                    let sql = format!("DROP DATABASE IF EXISTS {}", quote(&name));
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
        .execute(AssertSqlSafe(format!(
            "CREATE DATABASE {} CHARACTER SET utf8mb4",
            quote(&name)
        )))
        .await
        .expect("create the test database");
    let _ = admin.close().await;
    with_database(&base_url(), &name)
}

/// Drops a database [`create_database`] made.
pub(crate) async fn drop_database(url: &str) {
    let Ok(options) = MySqlConnectOptions::from_str(url) else {
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
            "DROP DATABASE IF EXISTS {}",
            quote(&name)
        )))
        .await;
    let _ = admin.close().await;
}

type Ids = Arc<Mutex<HashSet<u64>>>;

/// The server connection ids each test pool has opened, by the address of its connect options
/// (a pool hands out the same `Arc` for its whole life).
fn registry() -> &'static Mutex<HashMap<usize, Ids>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Ids>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

fn pool_key(pool: &MySqlPool) -> usize {
    Arc::as_ptr(&pool.connect_options()) as usize
}

/// The server connection ids a pool has opened (closed ones included).
pub(crate) fn connection_ids(pool: &MySqlPool) -> Vec<u64> {
    let ids = registry()
        .lock()
        .unwrap()
        .get(&pool_key(pool))
        .cloned()
        .unwrap_or_default();
    let ids = ids.lock().unwrap();
    ids.iter().copied().collect()
}

/// A broker with a pool of its own on `url` (12 connections: enough for 8 deliveries in work,
/// and four brokers of a stress run stay well under the server's 151), whose server connection
/// ids are recorded as they open.
pub(crate) async fn connect(url: &str) -> MySqlBroker {
    connect_running(url, &[]).await
}

/// [`connect`] whose sessions each run `statements` once connected (session settings: the
/// server's own stay as they are).
pub(crate) async fn connect_running(url: &str, statements: &'static [&'static str]) -> MySqlBroker {
    let ids: Ids = Arc::default();
    let record = ids.clone();
    let options = MySqlBackend::connect_options(url).expect("a MySQL URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(20))
        .after_connect(move |conn, _meta| {
            let record = record.clone();
            Box::pin(async move {
                for sql in statements {
                    conn.execute(*sql).await?;
                }
                let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                    .fetch_one(&mut *conn)
                    .await?;
                record.lock().unwrap().insert(id);
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("MariaDB/MySQL at {url} is unreachable: {e}"));
    registry().lock().unwrap().insert(pool_key(&pool), ids);
    Broker::new(MySqlBackend::new(pool))
}

/// Whether any session holds the advisory key `key` in the broker's database now.
pub(crate) async fn key_is_held(broker: &MySqlBroker, key: &str) -> bool {
    broker
        .backend()
        .is_key_held(key)
        .await
        .expect("probe the key")
}

/// The ids of the pool's connections that are still open on the server.
async fn live_ids(admin: &mut MySqlConnection, pool: &MySqlPool) -> Vec<u64> {
    let mine: HashSet<u64> = connection_ids(pool).into_iter().collect();
    let live: Vec<u64> =
        sqlx::query_scalar("SELECT CAST(ID AS UNSIGNED) FROM information_schema.PROCESSLIST")
            .fetch_all(&mut *admin)
            .await
            .expect("read the process list");
    live.into_iter().filter(|id| mine.contains(id)).collect()
}

/// `KILL`s every open server connection of the broker's pool from another session; returns how
/// many.
pub(crate) async fn kill_connections(broker: &MySqlBroker) -> usize {
    let mut admin = admin().await;
    let mut killed = Vec::new();
    for id in live_ids(&mut admin, broker.pool()).await {
        if admin
            .execute(AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .await
            .is_ok()
        {
            killed.push(id);
        }
    }
    // KILL only flags the session; it ends when its thread next looks. Wait (up to 5 s) until
    // the killed sessions are gone, so the kill is over when this returns, as PostgreSQL's
    // pg_terminate_backend(pid, timeout) does: a fault injector then knows when it struck.
    for _ in 0..250 {
        let live: HashSet<u64> =
            sqlx::query_scalar("SELECT CAST(ID AS UNSIGNED) FROM information_schema.PROCESSLIST")
                .fetch_all(&mut admin)
                .await
                .expect("read the process list")
                .into_iter()
                .collect();
        if killed.iter().all(|id| !live.contains(id)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = admin.close().await;
    killed.len()
}

/// The transactions InnoDB has open now, as its monitor (`SHOW ENGINE INNODB STATUS`) lists
/// them: per transaction the session it runs on and the monitor's lines for it.
///
/// Not `information_schema.INNODB_TRX`: InnoDB fills that table from a cache it refreshes only
/// once nobody has read the table for 100 ms, so a probe polling it every 50 ms (or several
/// tests polling side by side) keeps reading the transactions of the first read long after
/// they ended. That is how an idle session that said it was in no transaction came to be
/// reported with one for seconds (#35). The monitor reads the transaction list each time.
async fn innodb_transactions(admin: &mut MySqlConnection) -> Vec<(u64, String)> {
    let status: (String, String, String) = sqlx::query_as("SHOW ENGINE INNODB STATUS")
        .fetch_one(admin)
        .await
        .expect("SHOW ENGINE INNODB STATUS");
    active_transactions(&status.2)
}

/// The open transactions in the text of an InnoDB monitor: each `---TRANSACTION` block that is
/// `ACTIVE` (MySQL also lists sessions' transactions that are `not started`), with the session
/// its `thread id` line names.
pub(crate) fn active_transactions(monitor: &str) -> Vec<(u64, String)> {
    let Some(list) = monitor
        .split("LIST OF TRANSACTIONS FOR EACH SESSION:")
        .nth(1)
    else {
        return Vec::new();
    };
    // The list ends at the next section's rule.
    let list = list.split("\n--------\n").next().unwrap_or(list);
    list.split("---TRANSACTION ")
        .skip(1)
        .filter(|block| block.lines().next().is_some_and(|l| l.contains("ACTIVE")))
        .filter_map(|block| {
            let (_, rest) = block.split_once("thread id ")?;
            let id = rest
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()?;
            Some((id, block.trim_end().to_owned()))
        })
        .collect()
}

/// Open transactions of the broker's connections.
pub(crate) async fn open_transactions(broker: &MySqlBroker) -> usize {
    open_transactions_of(broker).await.len()
}

/// The open transactions of the broker's connections: session and the monitor's lines.
async fn open_transactions_of(broker: &MySqlBroker) -> Vec<(u64, String)> {
    let mut admin = admin().await;
    let mine: HashSet<u64> = connection_ids(broker.pool()).into_iter().collect();
    let open = innodb_transactions(&mut admin).await;
    let _ = admin.close().await;
    open.into_iter()
        .filter(|(id, _)| mine.contains(id))
        .collect()
}

/// What the open transactions of the broker's sessions are doing: the monitor's lines for each
/// (state, age, locks, the session and its statement), whether the session is still in the
/// process list (and what it runs there), and what each idle pooled session says of its own
/// transaction. For a leak report that explains itself.
async fn open_transaction_details(broker: &MySqlBroker) -> String {
    let open = open_transactions_of(broker).await;
    let mut admin = admin().await;
    let mut out = String::new();
    for (id, lines) in &open {
        let process: Option<(String, Option<String>, i64)> = sqlx::query_as(
            "SELECT COMMAND, STATE, CAST(TIME AS SIGNED) FROM information_schema.PROCESSLIST \
             WHERE ID = ?",
        )
        .bind(id)
        .fetch_optional(&mut admin)
        .await
        .unwrap_or(None);
        let process = match process {
            Some((c, state, time)) => format!("in the process list: {c} {state:?} for {time} s"),
            None => "not in the process list".to_owned(),
        };
        out.push_str(&format!(
            "\n  session {id} ({process}): ---TRANSACTION {}",
            lines.replace('\n', "\n    ")
        ));
    }
    let _ = admin.close().await;
    // Which of them sit idle in the pool, and what each idle connection's session says of
    // its own transaction: an idle pooled session inside a transaction was given back
    // unfinished; an open transaction on no idle connection is on one held outside the pool.
    let pool = broker.pool();
    let mut held = Vec::new();
    for _ in 0..pool.num_idle() {
        match tokio::time::timeout(Duration::from_secs(5), pool.acquire()).await {
            Ok(Ok(conn)) => held.push(conn),
            _ => break,
        }
    }
    for conn in &mut held {
        let state: Option<(u64, i64, i64)> = sqlx::query_as(
            "SELECT CAST(CONNECTION_ID() AS UNSIGNED), CAST(@@in_transaction AS SIGNED), \
             CAST(@@autocommit AS SIGNED)",
        )
        .fetch_optional(&mut **conn)
        .await
        .unwrap_or(None);
        if let Some((id, in_trx, autocommit)) = state {
            out.push_str(&format!(
                "\n  idle pooled session {id}: in_transaction {in_trx}, autocommit {autocommit}"
            ));
        }
    }
    out
}

/// What the broker leaves behind: connections of its pool still in use, open transactions of
/// its sessions, and idle pooled connections that still hold a user lock (which a `GET_LOCK` on
/// them would take again, re-entrantly). Waits up to 5 s for connections on their way back to
/// the pool.
pub(crate) async fn leaks(broker: &MySqlBroker) -> Vec<String> {
    let pool = broker.pool();
    let mut polls = 0;
    let mut out;
    loop {
        polls += 1;
        out = Vec::new();
        if !pool.is_closed() {
            let in_use = (pool.size() as usize).saturating_sub(pool.num_idle());
            if in_use > 0 {
                out.push(format!("{in_use} connections of the pool in use"));
            }
        }
        let open = open_transactions(broker).await;
        if open > 0 {
            if polls > 100 {
                out.push(format!(
                    "{open} open transactions:{}",
                    open_transaction_details(broker).await
                ));
            } else {
                out.push(format!("{open} open transactions"));
            }
        }
        if out.is_empty() || polls > 100 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if out.is_empty() && !pool.is_closed() {
        // Hold every idle connection at once, so each is probed.
        let mut held = Vec::new();
        for _ in 0..pool.num_idle() {
            match tokio::time::timeout(Duration::from_secs(5), pool.acquire()).await {
                Ok(Ok(conn)) => held.push(conn),
                _ => break,
            }
        }
        for conn in &mut held {
            let released: Option<i64> =
                sqlx::query_scalar("SELECT CAST(RELEASE_ALL_LOCKS() AS SIGNED)")
                    .fetch_one(&mut **conn)
                    .await
                    .unwrap_or(None);
            if released.unwrap_or(0) > 0 {
                out.push(format!(
                    "an idle connection held {} user locks",
                    released.unwrap_or(0)
                ));
            }
        }
    }
    out
}

/// The test database of the conformance suite.
pub(crate) struct MySql;

/// MariaDB / MySQL whose brokers' sessions read a backslash in a string literal as itself
/// (`NO_BACKSLASH_ESCAPES` added to the session's `sql_mode`), the other way a server may read
/// literals. Otherwise [`MySql`].
pub(crate) struct MySqlNoBackslashEscapes;

impl broker_testkit::TestDb for MySqlNoBackslashEscapes {
    type B = MySqlBackend;
    type Job = broker_testkit::Job;
    type Text = String;

    async fn database() -> String {
        create_database().await
    }

    async fn connect(url: &str) -> Broker<MySqlBackend> {
        let broker = connect_running(
            url,
            &["SET SESSION sql_mode = CONCAT(@@SESSION.sql_mode, ',NO_BACKSLASH_ESCAPES')"],
        )
        .await;
        let mode: String = sqlx::query_scalar("SELECT CAST(@@SESSION.sql_mode AS CHAR)")
            .fetch_one(broker.pool())
            .await
            .expect("read sql_mode");
        assert!(mode.contains("NO_BACKSLASH_ESCAPES"), "{mode}");
        broker
    }

    async fn key_is_held(broker: &MySqlBroker, key: &str) -> bool {
        key_is_held(broker, key).await
    }

    async fn kill_connections(broker: &MySqlBroker) -> Option<usize> {
        Some(kill_connections(broker).await)
    }

    fn quote(name: &str) -> String {
        <MySql as broker_testkit::TestDb>::quote(name)
    }

    async fn execute(broker: &MySqlBroker, sql: &str) -> u64 {
        <MySql as broker_testkit::TestDb>::execute(broker, sql).await
    }

    async fn leaks(broker: &MySqlBroker) -> Vec<String> {
        leaks(broker).await
    }

    async fn drop_database(url: &str) {
        drop_database(url).await;
    }
}

impl broker_testkit::TestDb for MySql {
    type B = MySqlBackend;
    type Job = broker_testkit::Job;
    type Text = String;
    // The live server here is MariaDB, which acks many rows with `DELETE .. RETURNING`.
    const BATCHED_ACKS: bool = true;

    async fn hold_row_lock(
        broker: &MySqlBroker,
        sql: &str,
    ) -> Option<Box<dyn std::any::Any + Send>> {
        Some(broker_testkit::hold_row_lock_on(broker.pool(), sql).await)
    }

    async fn session_id(conn: &mut sqlx::MySqlConnection) -> Option<i64> {
        let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
            .fetch_one(conn)
            .await
            .expect("CONNECTION_ID()");
        Some(id)
    }

    async fn database() -> String {
        create_database().await
    }

    async fn connect(url: &str) -> Broker<MySqlBackend> {
        connect(url).await
    }

    async fn key_is_held(broker: &MySqlBroker, key: &str) -> bool {
        key_is_held(broker, key).await
    }

    async fn kill_connections(broker: &MySqlBroker) -> Option<usize> {
        Some(kill_connections(broker).await)
    }

    fn quote(name: &str) -> String {
        format!("`{}`", name.replace('`', "``"))
    }

    fn outdated_claim_index(table: &str) -> Vec<String> {
        vec![format!(
            "ALTER TABLE {} DROP INDEX sqlx_broker_claim, ADD INDEX sqlx_broker_claim (`id`)",
            Self::quote(table)
        )]
    }

    fn drop_key_index(table: &str) -> Vec<String> {
        vec![format!(
            "ALTER TABLE {} DROP INDEX sqlx_broker_key",
            Self::quote(table)
        )]
    }

    fn drop_unique_index(table: &str) -> Vec<String> {
        vec![format!(
            "ALTER TABLE {} DROP INDEX sqlx_broker_unique",
            Self::quote(table)
        )]
    }

    async fn execute(broker: &MySqlBroker, sql: &str) -> u64 {
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(broker.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn leaks(broker: &MySqlBroker) -> Vec<String> {
        leaks(broker).await
    }

    async fn drop_database(url: &str) {
        drop_database(url).await;
    }

    async fn slow_down_deletes(broker: &MySqlBroker, table: &str) -> bool {
        let sql = format!(
            "CREATE TRIGGER `{trigger}` BEFORE DELETE ON `{table}` FOR EACH ROW SET @sqlx_broker_slow = SLEEP(0.02)",
            trigger = format!("{table}_slow").replace('`', "``"),
            table = table.replace('`', "``"),
        );
        broker
            .pool()
            .execute(sqlx::AssertSqlSafe(sql))
            .await
            .expect("create the slow-delete trigger");
        true
    }
}
