//! The doctor on SQLite: a pool opened as the backend opens it passes, one without WAL and a
//! busy timeout is told how to open it, and advisory tables are reminded that keys stay in the
//! process.

use broker_core::{Broker, ColumnType, DoctorOptions, Status, TableDescription};
use broker_sqlite::SqliteBackend;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

fn file(name: &str) -> String {
    let dir = std::env::temp_dir().join("sqlx-broker-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}.db", broker_testkit::unique_name(name)));
    format!("sqlite://{}", path.display())
}

fn table(advisory: bool) -> TableDescription {
    let b = TableDescription::builder(broker_testkit::unique_name("doc"))
        .payload("payload", ColumnType::Text);
    if advisory {
        b.column("k", ColumnType::Text).advisory_lock("k-{k}")
    } else {
        b.locked_until("locked_until")
    }
    .build()
    .unwrap()
}

#[tokio::test]
async fn a_pool_opened_by_the_backend_passes_and_advisory_keys_are_flagged_as_process_local() {
    let broker = SqliteBackend::connect(&file("doc")).await.unwrap();
    let lease = table(false);
    broker.create_tables(&lease).await.unwrap();
    let report = broker.doctor(&lease, &DoctorOptions::new()).await;
    assert_eq!(report.worst(), Status::Pass, "{report}");
    let advisory = table(true);
    broker.create_tables(&advisory).await.unwrap();
    let report = broker.doctor(&advisory, &DoctorOptions::new()).await;
    assert_eq!(
        report.check("advisory keys").unwrap().status,
        Status::Warn,
        "{report}"
    );
    assert_eq!(report.worst(), Status::Warn, "{report}");
    broker.close().await;
}

#[tokio::test]
async fn a_pool_without_wal_or_a_busy_timeout_is_told_how_to_open_it() {
    let options: SqliteConnectOptions = file("doc").parse().unwrap();
    let pool = SqlitePoolOptions::new()
        .connect_with(
            options
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Delete)
                .busy_timeout(std::time::Duration::ZERO),
        )
        .await
        .unwrap();
    let broker = Broker::new(SqliteBackend::new(pool));
    let lease = table(false);
    broker.create_tables(&lease).await.unwrap();
    let report = broker.doctor(&lease, &DoctorOptions::new()).await;
    for check in ["journal mode", "busy timeout"] {
        let c = report.check(check).unwrap();
        assert_eq!(c.status, Status::Warn, "{report}");
        assert!(c.fix.contains("connect_options"), "{report}");
    }
    broker.close().await;
}
