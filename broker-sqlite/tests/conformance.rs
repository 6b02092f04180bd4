//! The whole conformance suite against SQLite: each test gets a database file of its own
//! (`broker_testkit::sqlite`, its files in the temp folder).

type Sqlite = broker_testkit::sqlite::SqliteDb<broker_testkit::sqlite::PerCase>;

broker_testkit::conformance_suite!(Sqlite; modes: [lease, advisory]; server_connections: no);
