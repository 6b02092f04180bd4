//! The whole conformance suite against SQLite: each test gets a database file of its own.

use broker_core::Broker;
use broker_sqlite::{SqliteBackend, SqliteBroker};

struct Sqlite;

impl broker_testkit::TestDb for Sqlite {
    type B = SqliteBackend;
    type Job = broker_testkit::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn database() -> String {
        let dir = std::env::temp_dir().join("sqlx-broker-tests");
        std::fs::create_dir_all(&dir).expect("create the test folder");
        let file = dir.join(format!("{}.db", broker_testkit::unique_name("db")));
        format!("sqlite://{}", file.display())
    }

    async fn connect(url: &str) -> Broker<SqliteBackend> {
        SqliteBackend::connect(url)
            .await
            .expect("open the test database")
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
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn slow_down_deletes(broker: &SqliteBroker, table: &str) -> bool {
        // SQLite has no sleep: the trigger sums a table of 500,000 rows (a few milliseconds
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

broker_testkit::conformance_suite!(Sqlite; modes: [lease, advisory]; server_connections: no);
