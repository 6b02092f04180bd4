//! MariaDB / MySQL test databases (feature `mysql`): brokers whose server connections are
//! known by id, the probes of the process list and InnoDB's transactions the cases ask for,
//! and a [`TestDb`] for every place a run may work in ([`MySqlPlace`]).
//!
//! The backend's tests use [`MySqlDb<PerCase>`](PerCase): a database of their own per test
//! case on the server of `SQLX_BROKER_MYSQL_URL`. `sqlx-broker check` uses a place of its own
//! (a scratch database on the user's server).

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use broker_core::Broker;
use broker_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use broker_mysql::sqlx::{self, AssertSqlSafe, Connection, Executor, MySqlConnection, MySqlPool};
use broker_mysql::{MySqlBackend, MySqlBroker};

use crate::TestDb;

/// Where the cases of a [`MySqlDb`] work.
pub trait MySqlPlace: Send + Sync + 'static {
    /// The URL the probes (and [`kill_connections`]) connect to.
    fn admin_url() -> String;
    /// The URL a case's brokers connect to; see [`TestDb::database`].
    fn database() -> impl Future<Output = String> + Send;
    /// Removes what [`database`](Self::database) made; see [`TestDb::drop_database`].
    fn drop_database(url: &str) -> impl Future<Output = ()> + Send {
        let _ = url;
        async {}
    }
    /// How long a broker's pool waits for a connection.
    const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(20);
}

/// `name` quoted as a MariaDB / MySQL identifier.
pub fn quote(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// A connection of its own to `url` (never a broker's), for administration and probes, with
/// UTC as its time zone (as [`MySqlBackend::connect_options`]) and a `lock_wait_timeout` of
/// 20 s (a DROP never waits long for a metadata lock a broken case left behind).
pub async fn admin_at(url: &str) -> Result<MySqlConnection, String> {
    let options = MySqlBackend::connect_options(url).map_err(|e| e.to_string())?;
    match tokio::time::timeout(
        Duration::from_secs(20),
        MySqlConnection::connect_with(&options),
    )
    .await
    {
        Ok(Ok(mut conn)) => {
            conn.execute("SET SESSION lock_wait_timeout = 20")
                .await
                .map_err(|e| format!("setting lock_wait_timeout: {e}"))?;
            Ok(conn)
        }
        Ok(Err(e)) => Err(format!("cannot connect: {e}")),
        Err(_) => Err("the server did not answer within 20 s".to_owned()),
    }
}

async fn probe_connection(url: &str) -> MySqlConnection {
    admin_at(url)
        .await
        .unwrap_or_else(|e| panic!("MariaDB/MySQL: a probe connection: {e}"))
}

type Ids = Arc<Mutex<HashSet<u64>>>;

/// The server connection ids each pool of [`connect_running`] has opened, by the address of
/// its connect options (a pool hands out the same `Arc` for its whole life).
fn registry() -> &'static Mutex<HashMap<usize, Ids>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Ids>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

fn pool_key(pool: &MySqlPool) -> usize {
    Arc::as_ptr(&pool.connect_options()) as usize
}

/// The server connection ids a pool of [`connect_running`] has opened (closed ones included).
pub fn connection_ids(pool: &MySqlPool) -> HashSet<u64> {
    let ids = registry()
        .lock()
        .unwrap()
        .get(&pool_key(pool))
        .cloned()
        .unwrap_or_default();
    let ids = ids.lock().unwrap();
    ids.clone()
}

/// The server connection ids every pool of [`connect_running`] in this process has opened.
pub fn all_connection_ids() -> HashSet<u64> {
    registry()
        .lock()
        .unwrap()
        .values()
        .flat_map(|ids| ids.lock().unwrap().iter().copied().collect::<Vec<_>>())
        .collect()
}

/// A broker with a pool of its own on `url` (12 connections: enough for 8 deliveries in work,
/// and four brokers of a stress run stay well under the server's 151), whose sessions each run
/// `statements` once connected (session settings: the server's own stay as they are) and whose
/// server connection ids are recorded as they open.
///
/// # Panics
/// Where `url` is no MySQL URL or the server is unreachable.
pub async fn connect_running(
    url: &str,
    statements: &'static [&'static str],
    acquire_timeout: Duration,
) -> MySqlBroker {
    let ids: Ids = Arc::default();
    let record = ids.clone();
    let options: MySqlConnectOptions = MySqlBackend::connect_options(url).expect("a MySQL URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(acquire_timeout)
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
        .unwrap_or_else(|e| panic!("MariaDB/MySQL is unreachable: {e}"));
    registry().lock().unwrap().insert(pool_key(&pool), ids);
    Broker::new(MySqlBackend::new(pool))
}

/// Whether any session holds the advisory key `key` in the broker's database now.
pub async fn key_is_held(broker: &MySqlBroker, key: &str) -> bool {
    broker
        .backend()
        .is_key_held(key)
        .await
        .expect("probe the key")
}

async fn live_ids(admin: &mut MySqlConnection) -> HashSet<u64> {
    sqlx::query_scalar("SELECT CAST(ID AS UNSIGNED) FROM information_schema.PROCESSLIST")
        .fetch_all(admin)
        .await
        .expect("read the process list")
        .into_iter()
        .collect()
}

/// `KILL`s every open server connection of the broker's pool from a session on `admin_url`;
/// returns how many.
pub async fn kill_connections(admin_url: &str, broker: &MySqlBroker) -> usize {
    let mut admin = probe_connection(admin_url).await;
    let mine = connection_ids(broker.pool());
    let mut killed = Vec::new();
    for id in live_ids(&mut admin).await.intersection(&mine) {
        if admin
            .execute(AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .await
            .is_ok()
        {
            killed.push(*id);
        }
    }
    // KILL only flags the session; it ends when its thread next looks. Wait (up to 5 s) until
    // the killed sessions are gone, so the kill is over when this returns, as PostgreSQL's
    // pg_terminate_backend(pid, timeout) does: a fault injector then knows when it struck.
    for _ in 0..250 {
        let live = live_ids(&mut admin).await;
        if killed.iter().all(|id| !live.contains(id)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = admin.close().await;
    killed.len()
}

/// The transactions InnoDB has open now, as its monitor (`SHOW ENGINE INNODB STATUS`) lists
/// them: per transaction the session it runs on and the monitor's lines for it; `None` where
/// the user may not read the monitor (it needs the PROCESS right).
///
/// Not `information_schema.INNODB_TRX`: InnoDB fills that table from a cache it refreshes only
/// once nobody has read the table for 100 ms, so a probe polling it every 50 ms (or several
/// tests polling side by side) keeps reading the transactions of the first read long after
/// they ended (#35). The monitor reads the transaction list each time.
async fn innodb_transactions(admin: &mut MySqlConnection) -> Option<Vec<(u64, String)>> {
    let status: (String, String, String) = sqlx::query_as("SHOW ENGINE INNODB STATUS")
        .fetch_one(admin)
        .await
        .ok()?;
    Some(active_transactions(&status.2))
}

/// The open transactions in the text of an InnoDB monitor: each `---TRANSACTION` block that is
/// `ACTIVE` (MySQL also lists sessions' transactions that are `not started`), with the session
/// its `thread id` line names.
pub fn active_transactions(monitor: &str) -> Vec<(u64, String)> {
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

/// The open transactions of the broker's connections (session and the monitor's lines);
/// `None` where the monitor may not be read.
async fn open_transactions_of(admin_url: &str, broker: &MySqlBroker) -> Option<Vec<(u64, String)>> {
    let mut admin = probe_connection(admin_url).await;
    let mine = connection_ids(broker.pool());
    let open = innodb_transactions(&mut admin).await;
    let _ = admin.close().await;
    Some(
        open?
            .into_iter()
            .filter(|(id, _)| mine.contains(id))
            .collect(),
    )
}

/// How many transactions of the broker's connections are open (0 where InnoDB's monitor may
/// not be read).
pub async fn open_transactions(admin_url: &str, broker: &MySqlBroker) -> usize {
    open_transactions_of(admin_url, broker)
        .await
        .map_or(0, |open| open.len())
}

/// Holds every idle connection of the pool at once, so each is probed.
async fn hold_idle(pool: &MySqlPool) -> Vec<sqlx::pool::PoolConnection<sqlx::MySql>> {
    let mut held = Vec::new();
    for _ in 0..pool.num_idle() {
        match tokio::time::timeout(Duration::from_secs(5), pool.acquire()).await {
            Ok(Ok(conn)) => held.push(conn),
            _ => break,
        }
    }
    held
}

/// What the open transactions of the broker's sessions are doing: the monitor's lines for each
/// (state, age, locks, the session and its statement), whether the session is still in the
/// process list (and what it runs there), and what each idle pooled session says of its own
/// transaction. For a leak report that explains itself.
async fn open_transaction_details(admin_url: &str, broker: &MySqlBroker) -> String {
    let open = open_transactions_of(admin_url, broker)
        .await
        .unwrap_or_default();
    let mut admin = probe_connection(admin_url).await;
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
    // What each idle connection's session says of its own transaction: an idle pooled session
    // inside a transaction was given back unfinished; an open transaction on no idle
    // connection is on one held outside the pool.
    for conn in &mut hold_idle(broker.pool()).await {
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
/// its sessions (where InnoDB's monitor may be read), and idle pooled connections that still
/// hold a user lock (which a `GET_LOCK` on them would take again, re-entrantly). Waits up to
/// 5 s for connections on their way back to the pool.
pub async fn leaks(admin_url: &str, broker: &MySqlBroker) -> Vec<String> {
    let pool = broker.pool();
    let mut polls = 0;
    let mut out;
    loop {
        polls += 1;
        out = Vec::new();
        if !pool.is_closed() {
            let in_use = usize::try_from(pool.size())
                .unwrap_or(usize::MAX)
                .saturating_sub(pool.num_idle());
            if in_use > 0 {
                out.push(format!("{in_use} connections of the pool in use"));
            }
        }
        let open = open_transactions(admin_url, broker).await;
        if open > 0 {
            if polls > 100 {
                out.push(format!(
                    "{open} open transactions:{}",
                    open_transaction_details(admin_url, broker).await
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
        for conn in &mut hold_idle(pool).await {
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

/// Runs `sql` on the broker's pool; returns the rows it touched.
///
/// # Panics
/// Where the statement fails.
pub async fn execute(broker: &MySqlBroker, sql: &str) -> u64 {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(broker.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .rows_affected()
}

/// The conformance suite's view of MariaDB / MySQL, its cases working in the place `P`.
pub struct MySqlDb<P>(PhantomData<P>);

impl<P: MySqlPlace> TestDb for MySqlDb<P> {
    type B = MySqlBackend;
    type Job = crate::Job;
    type Text = String;
    // The live server here is MariaDB, which acks many rows with `DELETE .. RETURNING`.
    const BATCHED_ACKS: bool = true;

    async fn hold_row_lock(
        broker: &MySqlBroker,
        sql: &str,
    ) -> Option<Box<dyn std::any::Any + Send>> {
        Some(crate::hold_row_lock_on(broker.pool(), sql).await)
    }

    async fn session_id(conn: &mut MySqlConnection) -> Option<i64> {
        let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
            .fetch_one(conn)
            .await
            .expect("CONNECTION_ID()");
        Some(id)
    }

    async fn database() -> String {
        P::database().await
    }

    async fn connect(url: &str) -> MySqlBroker {
        connect_running(url, &[], P::ACQUIRE_TIMEOUT).await
    }

    async fn key_is_held(broker: &MySqlBroker, key: &str) -> bool {
        key_is_held(broker, key).await
    }

    async fn kill_connections(broker: &MySqlBroker) -> Option<usize> {
        Some(kill_connections(&P::admin_url(), broker).await)
    }

    fn quote(name: &str) -> String {
        quote(name)
    }

    fn outdated_claim_index(table: &str) -> Vec<String> {
        vec![format!(
            "ALTER TABLE {} DROP INDEX sqlx_broker_claim, ADD INDEX sqlx_broker_claim (`id`)",
            quote(table)
        )]
    }

    fn drop_key_index(table: &str) -> Vec<String> {
        vec![format!(
            "ALTER TABLE {} DROP INDEX sqlx_broker_key",
            quote(table)
        )]
    }

    fn drop_unique_index(table: &str) -> Vec<String> {
        vec![format!(
            "ALTER TABLE {} DROP INDEX sqlx_broker_unique",
            quote(table)
        )]
    }

    async fn execute(broker: &MySqlBroker, sql: &str) -> u64 {
        execute(broker, sql).await
    }

    async fn leaks(broker: &MySqlBroker) -> Vec<String> {
        leaks(&P::admin_url(), broker).await
    }

    async fn drop_database(url: &str) {
        P::drop_database(url).await;
    }

    async fn slow_down_deletes(broker: &MySqlBroker, table: &str) -> bool {
        let sql = format!(
            "CREATE TRIGGER {} BEFORE DELETE ON {} FOR EACH ROW SET @sqlx_broker_slow = SLEEP(0.02)",
            quote(&format!("{table}_slow")),
            quote(table),
        );
        broker
            .pool()
            .execute(AssertSqlSafe(sql))
            .await
            .expect("create the slow-delete trigger");
        true
    }
}

/// A database of its own per test case, on the server of `SQLX_BROKER_MYSQL_URL` (default
/// `mysql://root@127.0.0.1:3306/test`).
///
/// Advisory keys belong to the database (a key is locked as `"<database>:<key>"`), and the
/// cases of every mode use the same keys: in one shared database, tests running side by side
/// would wait on each other's keys and see each other's locks. A database per test (a few
/// milliseconds to create) keeps them apart.
pub struct PerCase;

impl MySqlPlace for PerCase {
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

/// The server URL of the per-case databases (`SQLX_BROKER_MYSQL_URL`); they are created next
/// to its database.
pub fn base_url() -> String {
    std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A connection to [`base_url`], for administration and probes.
///
/// # Panics
/// Where the server is unreachable.
pub async fn admin() -> MySqlConnection {
    let url = base_url();
    admin_at(&url)
        .await
        .unwrap_or_else(|e| panic!("MariaDB/MySQL at {url}: {e}"))
}

/// A fresh database for one test on [`base_url`]'s server (first dropping those that test
/// processes now gone left behind); returns its URL.
pub async fn create_database() -> String {
    let mut admin = admin().await;
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(SCHEMA_NAME AS CHAR) FROM information_schema.SCHEMATA \
                 WHERE SCHEMA_NAME LIKE 'sb\\_db\\_%'",
            )
            .fetch_all(&mut admin)
            .await
            .unwrap_or_default();
            for name in names.iter().filter(|n| crate::left_by_a_gone_process(n)) {
                let sql = format!("DROP DATABASE IF EXISTS {}", quote(name));
                let _ = admin.execute(AssertSqlSafe(sql)).await;
            }
        })
        .await;
    let name = crate::unique_name("db");
    admin
        .execute(AssertSqlSafe(format!(
            "CREATE DATABASE {} CHARACTER SET utf8mb4",
            quote(&name)
        )))
        .await
        .expect("create the test database");
    let _ = admin.close().await;
    crate::url_with_database(&base_url(), &name)
}

/// Drops a database [`create_database`] made; leaves any other alone.
pub async fn drop_database(url: &str) {
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
