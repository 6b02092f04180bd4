//! The whole conformance suite against SQLite: each test gets a database file of its own.

use broker_core::Broker;
use broker_sqlite::{SqliteBackend, SqliteBroker};

struct Sqlite;

impl broker_testkit::TestDb for Sqlite {
    type B = SqliteBackend;
    type Job = broker_testkit::Job;
    type Text = String;

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
        broker.backend().is_key_held(key)
    }

    async fn drop_database(url: &str) {
        let path = url.trim_start_matches("sqlite://");
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{path}{suffix}"));
        }
    }
}

broker_testkit::conformance_suite!(Sqlite);
