//! The doctor against the real server, directly and through PgBouncer in transaction mode: a
//! healthy deployment passes every check, and each problem is named with its fix.
//!
//! PgBouncer comes from `SQLX_BROKER_PGBOUNCER_URL` (default
//! `postgres://postgres@127.0.0.1:6432/test`, transaction mode, in front of the test server;
//! `.ci/run` installs and starts it). An unreachable PgBouncer fails its test.

mod common;

use std::str::FromStr;

use broker_core::{Broker, ClaimMode, DoctorOptions, DoctorReport, Status};
use broker_postgres::{PgBackend, PgBroker};
use broker_testkit::Fixture;
use common::Pg;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};

use common::{ensure_local_pgbouncer, pgbouncer_url};

/// A broker on the fixture's database through PgBouncer.
async fn through_pgbouncer(fx: &Fixture<Pg>) -> PgBroker {
    let direct = PgConnectOptions::from_str(&fx.url).unwrap();
    let database = direct.get_database().unwrap().to_owned();
    ensure_local_pgbouncer().await;
    let url = pgbouncer_url();
    let options = PgConnectOptions::from_str(&url)
        .expect("a PgBouncer URL")
        .database(&database);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| {
            panic!("PgBouncer at {url} is unreachable ({e}); .ci/run installs and starts it")
        });
    Broker::new(PgBackend::new(pool))
}

fn status(report: &DoctorReport, check: &str) -> Status {
    report
        .check(check)
        .unwrap_or_else(|| panic!("no {check:?} check in:\n{report}"))
        .status
}

fn fix(report: &DoctorReport, check: &str) -> String {
    report
        .check(check)
        .map(|c| c.fix.clone())
        .unwrap_or_default()
}

/// Whether the test server runs autovacuum (this machine's CI server does not, on purpose).
async fn autovacuum_is_on(url: &str) -> bool {
    let mut conn = PgConnection::connect(url).await.unwrap();
    let on: String = sqlx::query_scalar("SELECT current_setting('autovacuum')")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    on == "on"
}

/// A deployment passes every check in every mode; the vacuum check warns exactly when the
/// server runs without autovacuum (as this machine's CI server does), naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_healthy_deployment_passes_every_check_in_every_mode() {
    for mode in [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory] {
        let fx = Fixture::<Pg>::new(mode, |b| b).await;
        let report = fx
            .broker
            .doctor(&fx.table, &DoctorOptions::new().concurrency(4))
            .await;
        if autovacuum_is_on(&fx.url).await {
            assert_eq!(status(&report, "vacuum"), Status::Pass, "{mode}:\n{report}");
            assert_eq!(report.worst(), Status::Pass, "{mode}:\n{report}");
        } else {
            let vacuum = report.check("vacuum").expect("a vacuum check");
            assert_eq!(vacuum.status, Status::Warn, "{mode}:\n{report}");
            assert!(
                vacuum.found.contains("autovacuum is off")
                    && vacuum.fix.contains("autovacuum = on"),
                "{mode}:\n{report}"
            );
            assert!(
                report
                    .checks
                    .iter()
                    .all(|c| c.status == Status::Pass || c.name == "vacuum"),
                "{mode}:\n{report}"
            );
        }
        for check in [
            "server version",
            "pooler",
            "prepared statements",
            "LISTEN",
            "clock",
            "indexes",
            "table and statements",
            "pool size",
            "statistics",
        ] {
            assert_eq!(status(&report, check), Status::Pass, "{mode}:\n{report}");
        }
        fx.cleanup().await;
    }
}

/// A broker whose role does not own the queue table cannot analyze it, so statistics a burst
/// leaves stale wait for autovacuum: the doctor says so and how to fix it. (The owner passes, in
/// the healthy deployment above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_role_that_may_not_analyze_the_table_is_warned_with_its_fix() {
    let fx = Fixture::<Pg>::new(ClaimMode::Lease, |b| b).await;
    let role = broker_testkit::unique_name("worker");
    let mut admin = PgConnection::connect(&fx.url).await.unwrap();
    for sql in [
        format!("CREATE ROLE \"{role}\" LOGIN"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO \"{role}\""
        ),
        format!("GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO \"{role}\""),
    ] {
        admin.execute(AssertSqlSafe(sql)).await.unwrap();
    }
    let options = PgConnectOptions::from_str(&fx.url).unwrap().username(&role);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let broker = Broker::new(PgBackend::new(pool));
    let report = broker.doctor(&fx.table, &DoctorOptions::new()).await;
    assert_eq!(status(&report, "statistics"), Status::Warn, "{report}");
    assert!(
        fix(&report, "statistics").contains("owner"),
        "the fix names the table's owner:\n{report}"
    );
    broker.close().await;
    for sql in [
        format!("DROP OWNED BY \"{role}\""),
        format!("DROP ROLE \"{role}\""),
    ] {
        admin.execute(AssertSqlSafe(sql)).await.unwrap();
    }
    admin.close().await.unwrap();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_that_cuts_row_lock_deliveries_is_named_with_its_fix() {
    let fx = Fixture::<Pg>::new(ClaimMode::RowLock, |b| b).await;
    let mut conn = PgConnection::connect(&fx.url).await.unwrap();
    let database = PgConnectOptions::from_str(&fx.url)
        .unwrap()
        .get_database()
        .unwrap()
        .to_owned();
    conn.execute(AssertSqlSafe(format!(
        "ALTER DATABASE \"{database}\" SET idle_in_transaction_session_timeout = '5s'"
    )))
    .await
    .unwrap();
    conn.close().await.unwrap();
    // New sessions get the setting.
    let broker = common::connect(&fx.url).await;
    let report = broker.doctor(&fx.table, &DoctorOptions::new()).await;
    let check = "setting idle_in_transaction_session_timeout";
    assert_eq!(status(&report, check), Status::Warn, "{report}");
    assert!(
        fix(&report, check).contains("idle_in_transaction_session_timeout = 0"),
        "{report}"
    );
    // Lease mode holds no transaction, so the doctor does not look.
    broker.close().await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_claim_index_is_named_with_the_statement_that_creates_it() {
    // A priority table: a plain one claims through the primary key and gets no claim index.
    let fx = Fixture::<Pg>::new(ClaimMode::Lease, |b| b.priority("priority")).await;
    let index = format!("{}_claim", fx.table.name());
    fx.broker
        .pool()
        .execute(AssertSqlSafe(format!("DROP INDEX \"{index}\"")))
        .await
        .unwrap();
    let report = fx.broker.doctor(&fx.table, &DoctorOptions::new()).await;
    assert_eq!(status(&report, "indexes"), Status::Warn, "{report}");
    let fix = fix(&report, "indexes");
    assert!(
        fix.starts_with("CREATE INDEX") && fix.contains(&index),
        "{report}"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_that_cannot_hold_every_delivery_fails_in_the_modes_that_hold_connections() {
    // The test pools hold ten connections.
    for (mode, want) in [
        (ClaimMode::RowLock, Status::Fail),
        (ClaimMode::Advisory, Status::Fail),
        (ClaimMode::Lease, Status::Pass),
    ] {
        let fx = Fixture::<Pg>::new(mode, |b| b).await;
        let report = fx
            .broker
            .doctor(&fx.table, &DoctorOptions::new().concurrency(32))
            .await;
        assert_eq!(status(&report, "pool size"), want, "{mode}:\n{report}");
        if want == Status::Fail {
            assert!(
                fix(&report, "pool size").contains("max_connections"),
                "{report}"
            );
        }
        fx.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn behind_pgbouncer_in_transaction_mode_the_doctor_names_the_pooler_and_what_breaks() {
    for mode in [ClaimMode::Lease, ClaimMode::Advisory] {
        let fx = Fixture::<Pg>::new(mode, |b| b).await;
        let broker = through_pgbouncer(&fx).await;
        let report = broker.doctor(&fx.table, &DoctorOptions::new()).await;
        let pooler = report.check("pooler").unwrap();
        assert!(pooler.found.contains("transaction-mode pooler"), "{report}");
        let want = if mode == ClaimMode::Advisory {
            Status::Fail
        } else {
            Status::Warn
        };
        assert_eq!(pooler.status, want, "{mode}:\n{report}");
        assert_eq!(
            status(&report, "prepared statements"),
            Status::Warn,
            "{report}"
        );
        assert!(
            fix(&report, "prepared statements").contains("session-mode pooler"),
            "{report}"
        );
        assert_eq!(status(&report, "LISTEN"), Status::Warn, "{report}");
        // The claim's indexes are read through the pooler too (the DDL helper made them).
        assert_eq!(status(&report, "indexes"), Status::Pass, "{report}");
        if mode == ClaimMode::Advisory {
            assert_eq!(report.worst(), Status::Fail, "{report}");
            // The doctor does not prepare through a deployment that failed a check.
            assert_eq!(
                status(&report, "table and statements"),
                Status::Warn,
                "{report}"
            );
        } else {
            // Lease works through the pooler: the table prepares, unnamed.
            assert_eq!(report.worst(), Status::Warn, "{report}");
            assert_eq!(
                status(&report, "table and statements"),
                Status::Pass,
                "{report}"
            );
        }
        broker.close().await;
        fx.cleanup().await;
    }
}
