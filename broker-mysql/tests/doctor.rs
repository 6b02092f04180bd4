//! The doctor against the live MariaDB: a healthy deployment passes every check, and each
//! problem is named with its fix.

mod common;

use broker_core::{ClaimMode, DoctorOptions, DoctorReport, Status};
use broker_testkit::Fixture;
use common::MySql;
use sqlx::{AssertSqlSafe, Executor};

fn status(report: &DoctorReport, check: &str) -> Status {
    report
        .check(check)
        .unwrap_or_else(|| panic!("no {check:?} check in:\n{report}"))
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_healthy_deployment_passes_every_check_in_every_mode() {
    for mode in [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory] {
        let fx = Fixture::<MySql>::new(mode, |b| b).await;
        let report = fx
            .broker
            .doctor(&fx.table, &DoctorOptions::new().concurrency(4))
            .await;
        assert_eq!(report.worst(), Status::Pass, "{mode}:\n{report}");
        for check in [
            "server version",
            "cluster",
            "session",
            "isolation level",
            "clock",
            "indexes",
            "table and statements",
            "pool size",
        ] {
            assert_eq!(status(&report, check), Status::Pass, "{mode}:\n{report}");
        }
        fx.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_claim_index_and_a_small_pool_are_named_with_their_fixes() {
    // A table whose acks mark `processed_at` gets a claim index (otherwise the primary key is
    // the claim order).
    let fx = Fixture::<MySql>::new(ClaimMode::RowLock, |b| b.processed_at("done_at")).await;
    fx.broker
        .pool()
        .execute(AssertSqlSafe(format!(
            "ALTER TABLE `{}` DROP INDEX sqlx_broker_claim",
            fx.table.name()
        )))
        .await
        .unwrap();
    let report = fx
        .broker
        .doctor(&fx.table, &DoctorOptions::new().concurrency(64))
        .await;
    let indexes = report.check("indexes").unwrap();
    assert_eq!(indexes.status, Status::Warn, "{report}");
    assert!(indexes.found.contains("sqlx_broker_claim"), "{report}");
    let pool = report.check("pool size").unwrap();
    assert_eq!(pool.status, Status::Fail, "{report}");
    assert!(pool.fix.contains("max_connections"), "{report}");
    fx.cleanup().await;
}
