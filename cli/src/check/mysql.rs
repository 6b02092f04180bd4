//! MariaDB / MySQL for `check`: a scratch database of its own (or, where the user may not
//! create one, tables of this run's own names in the URL's database), brokers whose server
//! connections are known by id, and the probes the cases ask for.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use broker_core::Broker;
use broker_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use broker_mysql::sqlx::{self, AssertSqlSafe, Connection, Executor, MySqlConnection, MySqlPool};
use broker_mysql::{MySqlBackend, MySqlBroker};

use super::{Place, Scratch, scratch_name};

fn quote(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

async fn connect_one(url: &str) -> Result<MySqlConnection, String> {
    let options = MySqlBackend::connect_options(url).map_err(|e| e.to_string())?;
    match tokio::time::timeout(
        Duration::from_secs(20),
        MySqlConnection::connect_with(&options),
    )
    .await
    {
        Ok(Ok(mut c)) => {
            // A DROP never waits long for a metadata lock a case left behind.
            let _ = c.execute("SET SESSION lock_wait_timeout = 20").await;
            Ok(c)
        }
        Ok(Err(e)) => Err(format!("cannot connect: {e}")),
        Err(_) => Err("the server did not answer within 20 s".to_owned()),
    }
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

/// The statements whose refusal says a right is missing: what the cases do to a table of
/// their own (create, index, trigger, alter, drop).
async fn probe_table_rights(conn: &mut MySqlConnection, db: &str) -> Result<(), String> {
    let t = format!(
        "{}.{}",
        quote(db),
        quote(&format!("{}_probe", scratch_name()))
    );
    let steps = [
        (
            "CREATE",
            format!("CREATE TABLE {t} (id BIGINT PRIMARY KEY, v INT)"),
        ),
        ("INDEX", format!("CREATE INDEX probe_v ON {t} (v)")),
        ("ALTER", format!("ALTER TABLE {t} ADD COLUMN w INT")),
        (
            "TRIGGER",
            format!(
                "CREATE TRIGGER {}.{} BEFORE DELETE ON {t} FOR EACH ROW SET @sqlx_broker_probe = 1",
                quote(db),
                quote(&format!("{}_probe_t", scratch_name()))
            ),
        ),
    ];
    let mut failed = None;
    for (right, sql) in &steps {
        if let Err(e) = conn.execute(AssertSqlSafe(sql.clone())).await {
            failed = Some(format!("{right} ({e})"));
            break;
        }
    }
    let dropped = conn
        .execute(AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
        .await;
    match (failed, dropped) {
        (Some(f), _) => Err(f),
        (None, Err(e)) => Err(format!("DROP ({e})")),
        (None, Ok(_)) => Ok(()),
    }
}

/// Checks the rights `check` needs and makes its scratch database, or says what to grant.
pub(super) async fn prepare(url: &str) -> Result<Scratch, String> {
    let mut conn = connect_one(url).await?;
    let (user, version, current): (String, String, Option<String>) = sqlx::query_as(
        "SELECT CAST(CURRENT_USER() AS CHAR), CAST(VERSION() AS CHAR), CAST(DATABASE() AS CHAR)",
    )
    .fetch_one(&mut conn)
    .await
    .map_err(|e| format!("reading the user: {e}"))?;
    let server = format!("MySQL/MariaDB {version}, as {user}");
    let grant_user = match user.split_once('@') {
        Some((u, h)) => format!("'{u}'@'{h}'"),
        None => format!("'{user}'"),
    };
    let name = scratch_name();
    let own = conn
        .execute(AssertSqlSafe(format!(
            "CREATE DATABASE {} CHARACTER SET utf8mb4",
            quote(&name)
        )))
        .await;
    let mut why_not_own = match own {
        Ok(_) => match probe_table_rights(&mut conn, &name).await {
            Ok(()) => {
                let _ = conn.close().await;
                return Ok(Scratch {
                    server,
                    url: with_database(url, &name),
                    admin_url: url.to_owned(),
                    place: Place::MyDatabase(name),
                });
            }
            Err(right) => {
                let _ = conn
                    .execute(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {}",
                        quote(&name)
                    )))
                    .await;
                format!("it may create a database but not {right} in it")
            }
        },
        Err(e) => format!("it may not create a database ({e})"),
    };
    // The fallback: tables of this run's own names in the URL's database, where it may
    // create them and the broker's shared tables are not.
    if let Some(db) = current.clone() {
        let shared: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME IN (?, ?, ?)",
        )
        .bind(super::SHARED_TABLES[0])
        .bind(super::SHARED_TABLES[1])
        .bind(super::SHARED_TABLES[2])
        .fetch_all(&mut conn)
        .await
        .map_err(|e| format!("listing tables: {e}"))?;
        if shared.is_empty() {
            match probe_table_rights(&mut conn, &db).await {
                Ok(()) => {
                    let before = own_tables(&mut conn).await?;
                    let _ = conn.close().await;
                    return Ok(Scratch {
                        server,
                        url: url.to_owned(),
                        admin_url: url.to_owned(),
                        place: Place::MyPrefix {
                            database: db,
                            before,
                        },
                    });
                }
                Err(right) => {
                    why_not_own.push_str(&format!(
                        ", nor {right} in its database `{db}` (the fallback)"
                    ));
                }
            }
        } else {
            why_not_own.push_str(&format!(
                "; it would fall back to tables of its own in `{db}`, but the broker's shared tables ({}) are there and the cases would write to them",
                shared.join(", ")
            ));
        }
    }
    let _ = conn.close().await;
    let fallback = match &current {
        Some(db) => format!(
            ", or let it make tables of its own in `{db}`: GRANT CREATE, DROP, ALTER, INDEX, TRIGGER, SELECT, INSERT, UPDATE, DELETE ON {}.* TO {grant_user}",
            quote(db)
        ),
        None => String::new(),
    };
    Err(format!(
        "user {user} cannot run the check: {why_not_own}. `sqlx-broker check` runs its cases in a scratch database it creates and drops (named sqlx_broker_check_..). Grant it with GRANT ALL ON `sqlx\\_broker\\_check\\_%`.* TO {grant_user}{fallback}"
    ))
}

/// Tables of the current database whose names the cases of this process make, and the
/// broker's shared tables.
async fn own_tables(conn: &mut MySqlConnection) -> Result<Vec<String>, String> {
    sqlx::query_scalar(
        "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND (TABLE_NAME LIKE ? OR TABLE_NAME IN (?, ?, ?))",
    )
    .bind(super::own_pattern())
    .bind(super::SHARED_TABLES[0])
    .bind(super::SHARED_TABLES[1])
    .bind(super::SHARED_TABLES[2])
    .fetch_all(conn)
    .await
    .map_err(|e| format!("listing tables: {e}"))
}

/// Ends this run's connections and drops what it made.
pub(super) async fn clean(scratch: &Scratch) -> Result<String, String> {
    let mut conn = connect_one(&scratch.admin_url).await?;
    let mine: HashSet<u64> = registry()
        .lock()
        .unwrap()
        .values()
        .flat_map(|ids| ids.lock().unwrap().iter().copied().collect::<Vec<_>>())
        .collect();
    for id in mine {
        let _ = conn
            .execute(AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .await;
    }
    let done = match &scratch.place {
        Place::MyDatabase(name) => {
            conn.execute(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {}",
                quote(name)
            )))
            .await
            .map_err(|e| format!("dropping the scratch database {name}: {e}"))?;
            let left: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?",
            )
            .bind(name)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
            if left > 0 {
                return Err(format!("the scratch database {name} is still there"));
            }
            format!("database {name} dropped")
        }
        Place::MyPrefix { database, before } => {
            let now = own_tables(&mut conn).await?;
            let made: Vec<_> = now.iter().filter(|t| !before.contains(t)).collect();
            for t in &made {
                conn.execute(AssertSqlSafe(format!("DROP TABLE IF EXISTS {}", quote(t))))
                    .await
                    .map_err(|e| format!("dropping {t}: {e}"))?;
            }
            format!(
                "{} tables of this run dropped from database {database}",
                made.len()
            )
        }
        _ => unreachable!("a MySQL scratch place"),
    };
    let _ = conn.close().await;
    Ok(done)
}

type Ids = Arc<Mutex<HashSet<u64>>>;

/// The server connection ids each pool of this run has opened, by its connect options' address.
fn registry() -> &'static Mutex<HashMap<usize, Ids>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Ids>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

fn pool_key(pool: &MySqlPool) -> usize {
    Arc::as_ptr(&pool.connect_options()) as usize
}

fn connection_ids(pool: &MySqlPool) -> HashSet<u64> {
    let ids = registry()
        .lock()
        .unwrap()
        .get(&pool_key(pool))
        .cloned()
        .unwrap_or_default();
    let ids = ids.lock().unwrap();
    ids.clone()
}

async fn connect(url: &str) -> MySqlBroker {
    let ids: Ids = Arc::default();
    let record = ids.clone();
    let options: MySqlConnectOptions = MySqlBackend::connect_options(url).expect("a MySQL URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(60))
        .after_connect(move |conn, _meta| {
            let record = record.clone();
            Box::pin(async move {
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

async fn admin() -> MySqlConnection {
    connect_one(&super::scratch_url())
        .await
        .unwrap_or_else(|e| panic!("a probe connection: {e}"))
}

async fn live_ids(admin: &mut MySqlConnection) -> HashSet<u64> {
    sqlx::query_scalar("SELECT CAST(ID AS UNSIGNED) FROM information_schema.PROCESSLIST")
        .fetch_all(admin)
        .await
        .expect("read the process list")
        .into_iter()
        .collect()
}

/// The sessions with an open transaction, from InnoDB's monitor; `None` where the user may not
/// read it (it needs the PROCESS right).
async fn sessions_in_transaction(admin: &mut MySqlConnection) -> Option<HashSet<u64>> {
    let status: (String, String, String) = sqlx::query_as("SHOW ENGINE INNODB STATUS")
        .fetch_one(admin)
        .await
        .ok()?;
    let list = status
        .2
        .split("LIST OF TRANSACTIONS FOR EACH SESSION:")
        .nth(1)?;
    let list = list.split("\n--------\n").next().unwrap_or(list);
    Some(
        list.split("---TRANSACTION ")
            .skip(1)
            .filter(|block| block.lines().next().is_some_and(|l| l.contains("ACTIVE")))
            .filter_map(|block| {
                let (_, rest) = block.split_once("thread id ")?;
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            })
            .collect(),
    )
}

/// The check's view of MariaDB / MySQL: the scratch database.
pub(crate) struct CheckMySql;

impl broker_testkit::TestDb for CheckMySql {
    type B = MySqlBackend;
    type Job = broker_testkit::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn database() -> String {
        super::scratch_url()
    }

    async fn connect(url: &str) -> Broker<MySqlBackend> {
        connect(url).await
    }

    async fn key_is_held(broker: &MySqlBroker, key: &str) -> bool {
        broker
            .backend()
            .is_key_held(key)
            .await
            .expect("probe the key")
    }

    async fn kill_connections(broker: &MySqlBroker) -> Option<usize> {
        let mut admin = admin().await;
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
        for _ in 0..250 {
            let live = live_ids(&mut admin).await;
            if killed.iter().all(|id| !live.contains(id)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = admin.close().await;
        Some(killed.len())
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

    async fn execute(broker: &MySqlBroker, sql: &str) -> u64 {
        sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(broker.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn leaks(broker: &MySqlBroker) -> Vec<String> {
        let pool = broker.pool();
        let mut out = Vec::new();
        for polls in 0..=100 {
            out.clear();
            if !pool.is_closed() {
                let in_use = (pool.size() as usize).saturating_sub(pool.num_idle());
                if in_use > 0 {
                    out.push(format!("{in_use} connections of the pool in use"));
                }
            }
            let mut admin = admin().await;
            let open = sessions_in_transaction(&mut admin).await;
            let _ = admin.close().await;
            if let Some(open) = open {
                let n = open.intersection(&connection_ids(pool)).count();
                if n > 0 {
                    out.push(format!("{n} open transactions"));
                }
            }
            if out.is_empty() || polls == 100 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if out.is_empty() && !pool.is_closed() {
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
