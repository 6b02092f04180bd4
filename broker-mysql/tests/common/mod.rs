//! The MariaDB / MySQL test database: `broker_testkit::mysql` with a database of its own per
//! test (`PerCase`), under the names the tests use.
//!
//! The server comes from `SQLX_BROKER_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//! An unreachable server fails the tests; it never skips them.

#![allow(dead_code)]

use std::time::Duration;

use broker_mysql::{MySqlBackend, MySqlBroker};
use broker_testkit::TestDb;
use broker_testkit::mysql::PerCase;
// Each test file uses some of them.
#[allow(unused_imports)]
pub(crate) use broker_testkit::mysql::{
    active_transactions, admin, base_url, create_database, drop_database, key_is_held,
};

/// The conformance suite's view of MariaDB / MySQL: a database per test case.
pub(crate) type MySql = broker_testkit::mysql::MySqlDb<PerCase>;

/// A broker with a pool of its own on `url`, whose server connection ids are recorded as they
/// open.
pub(crate) async fn connect(url: &str) -> MySqlBroker {
    MySql::connect(url).await
}

/// `KILL`s every open server connection of the broker's pool; returns how many.
pub(crate) async fn kill_connections(broker: &MySqlBroker) -> usize {
    broker_testkit::mysql::kill_connections(&base_url(), broker).await
}

/// Open transactions of the broker's connections.
pub(crate) async fn open_transactions(broker: &MySqlBroker) -> usize {
    broker_testkit::mysql::open_transactions(&base_url(), broker).await
}

/// What the broker leaves behind (see `broker_testkit::mysql::leaks`).
pub(crate) async fn leaks(broker: &MySqlBroker) -> Vec<String> {
    MySql::leaks(broker).await
}

/// MariaDB / MySQL whose brokers' sessions read a backslash in a string literal as itself
/// (`NO_BACKSLASH_ESCAPES` added to the session's `sql_mode`), the other way a server may read
/// literals. Otherwise [`MySql`].
pub(crate) struct MySqlNoBackslashEscapes;

impl TestDb for MySqlNoBackslashEscapes {
    type B = MySqlBackend;
    type Job = broker_testkit::Job;
    type Text = String;

    async fn database() -> String {
        create_database().await
    }

    async fn connect(url: &str) -> MySqlBroker {
        let broker = broker_testkit::mysql::connect_running(
            url,
            &["SET SESSION sql_mode = CONCAT(@@SESSION.sql_mode, ',NO_BACKSLASH_ESCAPES')"],
            Duration::from_secs(20),
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
        MySql::kill_connections(broker).await
    }

    fn quote(name: &str) -> String {
        MySql::quote(name)
    }

    async fn execute(broker: &MySqlBroker, sql: &str) -> u64 {
        MySql::execute(broker, sql).await
    }

    async fn leaks(broker: &MySqlBroker) -> Vec<String> {
        MySql::leaks(broker).await
    }

    async fn drop_database(url: &str) {
        drop_database(url).await;
    }
}
