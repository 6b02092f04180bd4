//! SQLite test databases (feature `sqlite`): a fresh database file per case in a folder
//! ([`SqlitePlace`]), and the probes the cases ask for.
//!
//! The backend's tests use [`SqliteDb<PerCase>`](PerCase), files in the temp folder;
//! `sqlx-broker check` uses a scratch folder beside the user's database file.

use std::marker::PhantomData;
use std::path::PathBuf;

use broker_core::Broker;
use broker_sqlite::sqlx::{self, AssertSqlSafe};
use broker_sqlite::{SqliteBackend, SqliteBroker};

use crate::TestDb;

/// The folder the case files of a [`SqliteDb`] go in.
pub trait SqlitePlace: Send + Sync + 'static {
    /// The folder; made (with its parents) where it is missing.
    fn folder() -> PathBuf;
}

/// The conformance suite's view of SQLite: a database file of its own per case, in the folder
/// of `P`.
pub struct SqliteDb<P>(PhantomData<P>);

impl<P: SqlitePlace> TestDb for SqliteDb<P> {
    type B = SqliteBackend;
    type Job = crate::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn database() -> String {
        let dir = P::folder();
        std::fs::create_dir_all(&dir).expect("create the folder of the case files");
        let file = dir.join(format!("{}.db", crate::unique_name("db")));
        format!("sqlite://{}", file.display())
    }

    async fn connect(url: &str) -> Broker<SqliteBackend> {
        SqliteBackend::connect(url)
            .await
            .expect("open the case's database")
    }

    async fn key_is_held(broker: &SqliteBroker, key: &str) -> bool {
        broker
            .backend()
            .is_key_held(key)
            .await
            .expect("probe the key")
    }

    async fn kill_connections(_broker: &SqliteBroker) -> Option<usize> {
        // An embedded database has no server connections to kill.
        None
    }

    async fn execute(broker: &SqliteBroker, sql: &str) -> u64 {
        let mut conn = broker.pool().acquire().await.expect("a connection");
        // A read first: a connection whose copy of the schema is older than another
        // connection's DDL reloads it at its next read, but checks a DDL statement against the
        // old copy ("index ... already exists" right after another connection dropped it).
        sqlx::query("SELECT count(*) FROM sqlite_master")
            .execute(&mut *conn)
            .await
            .expect("read the schema");
        sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn slow_down_deletes(broker: &SqliteBroker, table: &str) -> bool {
        // SQLite has no sleep: the trigger sums a table of 200,000 rows (a few milliseconds
        // per deleted row).
        let rows = Self::quote(&format!("{table}_slow_rows"));
        let statements = [
            format!("CREATE TABLE {rows} (x INTEGER)"),
            format!(
                "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 200000) \
                 INSERT INTO {rows} SELECT x FROM c"
            ),
            format!(
                "CREATE TRIGGER {} BEFORE DELETE ON {} BEGIN SELECT sum(x) FROM {rows}; END",
                Self::quote(&format!("{table}_slow")),
                Self::quote(table)
            ),
        ];
        for sql in &statements {
            Self::execute(broker, sql).await;
        }
        true
    }

    async fn leaks(broker: &SqliteBroker) -> Vec<String> {
        // SQLite has no server sessions: what can leak is a key left in the process's key
        // table, or a pool connection never given back.
        let mut leaks = Vec::new();
        let held = broker.backend().held_keys();
        if held > 0 {
            leaks.push(format!("{held} advisory keys still held"));
        }
        // A connection goes back to the pool in a task of its own: give it a moment.
        let pool = broker.pool();
        let in_use = || {
            pool.size()
                .saturating_sub(u32::try_from(pool.num_idle()).unwrap_or(u32::MAX))
        };
        for _ in 0..100 {
            if in_use() == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let in_use = in_use();
        if in_use > 0 {
            leaks.push(format!("{in_use} pool connections still in use"));
        }
        leaks
    }

    async fn drop_database(url: &str) {
        let path = url.trim_start_matches("sqlite://");
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{path}{suffix}"));
        }
    }
}

/// Case files in `sqlx-broker-tests` in the temp folder, as the backend's tests keep them.
pub struct PerCase;

impl SqlitePlace for PerCase {
    fn folder() -> PathBuf {
        std::env::temp_dir().join("sqlx-broker-tests")
    }
}
