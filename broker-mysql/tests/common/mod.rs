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

/// When each test connection opened, by its server connection id, in microseconds since the
/// epoch on the server's clock: a leak report compares it with the start of a transaction
/// InnoDB lists for that session.
fn connected_at() -> &'static Mutex<HashMap<u64, i64>> {
    static AT: OnceLock<Mutex<HashMap<u64, i64>>> = OnceLock::new();
    AT.get_or_init(Default::default)
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
    let ids: Ids = Arc::default();
    let record = ids.clone();
    let options = MySqlBackend::connect_options(url).expect("a MySQL URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(20))
        .after_connect(move |conn, _meta| {
            let record = record.clone();
            Box::pin(async move {
                let (id, at): (u64, i64) = sqlx::query_as(
                    "SELECT CONNECTION_ID(), CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)",
                )
                .fetch_one(&mut *conn)
                .await?;
                record.lock().unwrap().insert(id);
                connected_at().lock().unwrap().insert(id, at);
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

/// Open transactions of the broker's connections.
pub(crate) async fn open_transactions(broker: &MySqlBroker) -> usize {
    let mut admin = admin().await;
    let mine: HashSet<u64> = connection_ids(broker.pool()).into_iter().collect();
    let open: Vec<u64> = sqlx::query_scalar(
        "SELECT CAST(trx_mysql_thread_id AS UNSIGNED) FROM information_schema.INNODB_TRX",
    )
    .fetch_all(&mut admin)
    .await
    .expect("read INNODB_TRX");
    let _ = admin.close().await;
    open.into_iter().filter(|id| mine.contains(id)).count()
}

/// An open transaction as [`open_transaction_details`] reads it: session, state, age (ms), rows
/// locked, statement, the session's command, state and time in the process list, what InnoDB
/// says of the transaction (isolation, read only, autocommit non-locking, tables, locks), its id
/// and when it began (microseconds since the epoch, server clock).
type TrxRow = (
    u64,
    String,
    i64,
    i64,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    String,
    i64,
);

/// The transactions InnoDB lists now: per transaction the row [`TrxRow`] describes.
async fn innodb_transactions(admin: &mut MySqlConnection) -> Vec<TrxRow> {
    sqlx::query_as(
        "SELECT CAST(t.trx_mysql_thread_id AS UNSIGNED), t.trx_state, \
         CAST(TIMESTAMPDIFF(MICROSECOND, t.trx_started, NOW(6)) / 1000 AS SIGNED), \
         CAST(t.trx_rows_locked AS SIGNED), t.trx_query, p.COMMAND, p.STATE, CAST(p.TIME AS SIGNED), \
         CONCAT('isolation ', t.trx_isolation_level, ', read only ', t.trx_is_read_only, \
         ', autocommit non-locking ', t.trx_autocommit_non_locking, ', tables in use ', \
         t.trx_tables_in_use, ', tables locked ', t.trx_tables_locked, ', lock structs ', \
         t.trx_lock_structs, ', rows modified ', t.trx_rows_modified, ', operation ', \
         IFNULL(t.trx_operation_state, '-')), CAST(t.trx_id AS CHAR), \
         CAST(UNIX_TIMESTAMP(t.trx_started) * 1000000 AS SIGNED) \
         FROM information_schema.INNODB_TRX AS t \
         LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = t.trx_mysql_thread_id",
    )
    .fetch_all(admin)
    .await
    .unwrap_or_default()
}

/// How many transactions InnoDB lists for the session of `conn`, read on that session. InnoDB
/// refreshes the table's cache at most every 100 ms, so this waits that long first.
async fn own_transactions(conn: &mut MySqlConnection) -> Option<i64> {
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query_scalar(
        "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.INNODB_TRX \
         WHERE trx_mysql_thread_id = CONNECTION_ID()",
    )
    .fetch_one(conn)
    .await
    .ok()
}

/// What the open transactions of the broker's sessions are doing: per transaction its session,
/// state, age, rows locked, statement and InnoDB's view of it, when it began against when its
/// session connected, and whether the session is still in the process list (and what it runs
/// there); for each idle pooled session, what it says of its own transaction and whether a
/// transaction InnoDB lists for it ends when the session reads an InnoDB table, then when it
/// rolls back. For a leak report that explains itself.
async fn open_transaction_details(broker: &MySqlBroker) -> String {
    let mut admin = admin().await;
    let mine: HashSet<u64> = connection_ids(broker.pool()).into_iter().collect();
    let rows = innodb_transactions(&mut admin).await;
    let status: Option<(String, String, String)> = sqlx::query_as("SHOW ENGINE INNODB STATUS")
        .fetch_optional(&mut admin)
        .await
        .unwrap_or(None);
    let _ = admin.close().await;
    let connected = connected_at().lock().unwrap().clone();
    let open: String = rows
        .iter()
        .filter(|r| mine.contains(&r.0))
        .map(|(id, state, age_ms, locked, query, command, pstate, time, more, trx, began)| {
            // INNODB_TRX gives the start to the second.
            let since = match connected.get(id) {
                Some(at) => format!(
                    "began in second {}, its session connected at {}.{:06}",
                    began / 1_000_000,
                    at / 1_000_000,
                    at % 1_000_000
                ),
                None => format!(
                    "began in second {}, its session's connect time unknown",
                    began / 1_000_000
                ),
            };
            format!(
                "\n  session {id}: trx {trx} {state} for {age_ms} ms ({since}), {locked} rows locked, statement {query:?} ({}); {}",
                more.clone().unwrap_or_default(),
                match command {
                    Some(c) => format!("in the process list: {c} {pstate:?} for {time:?} s"),
                    None => "not in the process list".to_owned(),
                }
            )
        })
        .collect();
    // InnoDB's own account of those transactions (the monitor's block for each session).
    let mut monitor = String::new();
    if let Some((_, _, text)) = status {
        for block in text.split("---TRANSACTION ").skip(1) {
            let block = block.split("--------\n").next().unwrap_or(block);
            if mine
                .iter()
                .any(|id| block.contains(&format!("thread id {id},")))
            {
                monitor.push_str("\n  monitor: ---TRANSACTION ");
                monitor.push_str(&block.trim_end().replace('\n', "\n    "));
            }
        }
    }
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
    let mut idle = String::new();
    for conn in &mut held {
        let state: Option<(u64, i64, i64)> = sqlx::query_as(
            "SELECT CAST(CONNECTION_ID() AS UNSIGNED), CAST(@@in_transaction AS SIGNED), \
             CAST(@@autocommit AS SIGNED)",
        )
        .fetch_optional(&mut **conn)
        .await
        .unwrap_or(None);
        let Some((id, in_trx, autocommit)) = state else {
            continue;
        };
        idle.push_str(&format!(
            "\n  idle pooled session {id}: in_transaction {in_trx}, autocommit {autocommit}"
        ));
        if !rows.iter().any(|r| r.0 == id) {
            continue;
        }
        // The session has a transaction InnoDB lists: does a read of an InnoDB table on it
        // end it (a transaction InnoDB began but the server never registered), or only a
        // rollback, or neither?
        let before = own_transactions(conn).await;
        let read = sqlx::query("SELECT 1 FROM mysql.innodb_table_stats LIMIT 1")
            .fetch_optional(&mut **conn)
            .await
            .map(drop);
        let after_read = own_transactions(conn).await;
        let rollback = conn.execute("ROLLBACK").await.map(drop);
        let after_rollback = own_transactions(conn).await;
        idle.push_str(&format!(
            "; its own view of INNODB_TRX: {before:?} transactions, {after_read:?} after an \
             InnoDB read ({read:?}), {after_rollback:?} after ROLLBACK ({rollback:?})"
        ));
    }
    drop(held);
    format!("{open}{idle}{monitor}")
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
