//! Every row lock and lease conformance case through PgBouncer in transaction mode (`SQLX_BROKER_PGBOUNCER_URL`,
//! default `postgres://postgres@127.0.0.1:6432/test`; `.ci/run` installs and starts it, and the
//! tests start it with `.ci/pgbouncer.sh` when nothing answers at the default). The backend finds
//! the pooler at the first prepare: statements go unnamed, wake-ups poll, advisory tables are
//! refused with the pooler message. Each test's database is made directly on the server and
//! reached through PgBouncer.

mod common;

use std::str::FromStr;
use std::time::Duration;

use broker_core::{Broker, ClaimMode, SqlxBrokerError};
use broker_postgres::{PgBackend, PgBroker};
use broker_testkit::Fixture;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::{ensure_local_pgbouncer, pgbouncer_url};

/// `url` (a direct one) with PgBouncer's host and port, same database.
fn through_pgbouncer(url: &str) -> String {
    let database = PgConnectOptions::from_str(url)
        .unwrap()
        .get_database()
        .unwrap()
        .to_owned();
    let base = pgbouncer_url();
    let cut = base.rfind('/').expect("a PgBouncer URL with a database");
    format!("{}/{database}", &base[..cut])
}

/// `url` (through PgBouncer) with the server's host and port, same database.
fn direct(url: &str) -> String {
    let database = PgConnectOptions::from_str(url)
        .unwrap()
        .get_database()
        .unwrap()
        .to_owned();
    let base = common::base_url();
    let cut = base.rfind('/').expect("a PostgreSQL URL with a database");
    format!("{}/{database}", &base[..cut])
}

/// The conformance suite's view of PostgreSQL through PgBouncer.
pub(crate) struct PgBouncer;

impl broker_testkit::TestDb for PgBouncer {
    type B = PgBackend;
    type Job = broker_testkit::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn database() -> String {
        ensure_local_pgbouncer().await;
        through_pgbouncer(&common::create_database().await)
    }

    async fn connect(url: &str) -> PgBroker {
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(5))
            .acquire_timeout(Duration::from_secs(20))
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("PgBouncer at {url} is unreachable: {e}"));
        Broker::new(PgBackend::new(pool))
    }

    async fn key_is_held(broker: &PgBroker, key: &str) -> bool {
        common::key_is_held(broker, key).await
    }

    async fn kill_connections(_broker: &PgBroker) -> Option<usize> {
        // The broker's connections end at PgBouncer; killing server sessions would cut other
        // clients' transactions too. The direct suite covers killed connections.
        None
    }

    async fn leaks(broker: &PgBroker) -> Vec<String> {
        // Server sessions belong to PgBouncer: what the broker can leak is pool connections.
        // A connection dropped inside a transaction goes back to the pool after its rollback,
        // which sqlx runs on a task of its own: give that a moment, a leak stays for good.
        let pool = broker.pool();
        let in_use = || {
            usize::try_from(pool.size())
                .unwrap_or(usize::MAX)
                .saturating_sub(pool.num_idle())
        };
        for _ in 0..50 {
            if in_use() == 0 {
                return Vec::new();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        vec![format!("{} pool connections in use after 5 s", in_use())]
    }

    async fn execute(broker: &PgBroker, sql: &str) -> u64 {
        // The simple protocol: one message, which the pooler passes through whole.
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(broker.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn drop_database(url: &str) {
        common::drop_database(&direct(url)).await;
    }
}

// Every row lock and lease case of the conformance suite, stress and killed workers included
// (killed server connections are the direct suite's: see `kill_connections`).
broker_testkit::conformance_suite!(@mode PgBouncer; row_lock; no);
broker_testkit::conformance_suite!(@mode PgBouncer; lease; no);

// Periodic schedules through the pooler: every schedule statement (register, record a tick,
// list) follows the backend's `prepared` setting, as every other statement does.
mod periodic {
    #[allow(unused_imports)]
    use super::*;
    broker_testkit::conformance_suite!(@plain PgBouncer;
        bad_schedules_are_refused_with_a_clear_error,
        four_brokers_on_one_schedule_publish_each_tick_once_with_one_killed_and_restarted,
        missed_ticks_are_skipped_by_default_and_run_latest_publishes_the_latest_once,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_advisory_table_is_refused_with_the_pooler_message() {
    let url = PgBouncer::database().await;
    let broker = <PgBouncer as broker_testkit::TestDb>::connect(&url).await;
    let table = broker_testkit::describe(&broker_testkit::unique_name("ad"), ClaimMode::Advisory)
        .build()
        .unwrap();
    broker.create_tables(&table).await.unwrap();
    let err = broker
        .queue::<broker_testkit::Job>(table.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, SqlxBrokerError::Unsupported { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("transaction-mode pooler") && msg.contains("session-mode"),
        "{msg}"
    );
    assert!(
        !broker.backend().capabilities().cross_process_wakeups,
        "LISTEN is off behind the pooler"
    );
    let _ = broker.drop_tables(&table).await;
    broker.close().await;
    PgBouncer::drop_database(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_queue_said_to_be_behind_a_pooler_prepares_without_the_check() {
    let mut fx = Fixture::<PgBouncer>::new(ClaimMode::Lease, |b| b).await;
    let pool = fx.broker.pool().clone();
    let broker = Broker::new(PgBackend::new(pool).behind_transaction_pooler());
    let q = broker
        .queue::<broker_testkit::Job>(fx.table.clone())
        .await
        .unwrap();
    let ids = fx.publish(&q, 3).await;
    let got = broker_testkit::claim_one(&q).await;
    assert_eq!(got.id(), ids[0]);
    got.ack().await.unwrap();
    let _ = fx.other_queue().await;
    fx.cleanup().await;
}

use broker_core::Backend as _;
use broker_testkit::TestDb as _;
