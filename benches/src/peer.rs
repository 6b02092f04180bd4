//! The peer: [ruststream-sqlx](https://crates.io/crates/ruststream-sqlx) 0.7, a crate that also
//! serves work from a service's SQL tables, draining the same table shape and row count on
//! PostgreSQL in its row lock and lease forms, with an instant-ack handler and the same worker
//! count. Its tables have fixed names (the crate names a table at compile time); each run
//! creates its table with sqlx-broker's DDL, fills it, and drops it.
//!
//! Its codec is JSON, so the peer's rows hold the JSON string `"job-i"` where the other sides
//! hold `job-i`: same column, same type, two bytes longer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker_core::{Broker, ClaimMode, NewJob};
use broker_postgres::PgBackend;
use chrono::{DateTime, Utc};
use ruststream_sqlx::prelude::*;
use serde::Deserialize;
use sqlx::postgres::PgPoolOptions;

use crate::BoxError;
use crate::drain::{self, RunLimits, RunResult};
use crate::scenario::Scenario;
use crate::timed::Timed;

const ROW_LOCK_TABLE: &str = "sxb_bench_peer_row_lock";
const LEASE_TABLE: &str = "sxb_bench_peer_lease";

/// Rows the peer's handlers acked, read by the run's watcher.
static ACKED: AtomicU64 = AtomicU64::new(0);

/// A row of the row lock table.
#[derive(Inbox, sqlx::FromRow)]
#[inbox(table = "sxb_bench_peer_row_lock")]
struct RowLockJob {
    #[field(id, generated)]
    id: i64,
    #[field(attempt, generated)]
    attempt: i32,
    #[field(payload)]
    payload: String,
}

/// A row of the lease table.
#[derive(Inbox, sqlx::FromRow)]
#[inbox(table = "sxb_bench_peer_lease")]
struct LeaseJob {
    #[field(id, generated)]
    id: i64,
    #[field(attempt, generated)]
    attempt: i32,
    #[field(locked_until)]
    locked_until: Option<DateTime<Utc>>,
    #[field(payload)]
    payload: String,
}

/// The message both tables carry.
#[derive(Debug, Deserialize)]
struct Job(#[allow(dead_code, reason = "decoded as the other sides decode the payload")] String);

#[subscriber(InboxQueue::<RowLockJob>::new("bench_row_lock"))]
async fn ack_row_lock(_job: &Job) -> HandlerOutcome {
    ACKED.fetch_add(1, Ordering::Relaxed);
    HandlerOutcome::ack()
}

#[subscriber(InboxQueue::<LeaseJob>::new("bench_lease"))]
async fn ack_lease(_job: &Job) -> HandlerOutcome {
    ACKED.fetch_add(1, Ordering::Relaxed);
    HandlerOutcome::ack()
}

/// Whether the peer runs `scenario`: PostgreSQL row lock and lease tables without FIFO groups,
/// one row per claim.
pub fn covers(scenario: &Scenario) -> bool {
    scenario.db == crate::scenario::Db::Postgres
        && scenario.fifo_groups.is_none()
        && scenario.batch == 1
        && matches!(scenario.mode, ClaimMode::RowLock | ClaimMode::Lease)
}

/// Drains a filled table with ruststream-sqlx, timed as the other sides are.
pub async fn run(
    broker: &Broker<Timed<PgBackend>>,
    scenario: &Scenario,
    limits: RunLimits,
) -> Result<RunResult, BoxError> {
    if !covers(scenario) {
        return Err(format!("{}: the peer does not run this scenario", scenario.id()).into());
    }
    let name = match scenario.mode {
        ClaimMode::RowLock => ROW_LOCK_TABLE,
        _ => LEASE_TABLE,
    };
    let table = drain::describe(name, scenario.mode, None)?;
    // A table left by an interrupted run would hold extra rows.
    broker.drop_tables(&table).await?;
    broker.create_tables(&table).await?;
    let result = async {
        let mut conn = broker.pool().acquire().await?;
        let rows = usize::try_from(limits.rows)?;
        for start in (0..rows).step_by(500) {
            let jobs: Vec<NewJob<String>> = (start..(start + 500).min(rows))
                .map(|i| NewJob::new(format!("\"job-{i}\"")))
                .collect();
            broker_core::Backend::publish(broker.backend(), &mut *conn, &table, &jobs).await?;
        }
        drop(conn);
        let workers = std::num::NonZeroUsize::new(scenario.workers.max(1))
            .ok_or("workers must be at least 1")?;
        // Its own pool, as large as the other sides' (16), so no side waits for connections
        // another holds.
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with((*broker.pool().connect_options()).clone())
            .await?;
        // Closed explicitly after the run: the peer keeps clones of its pool after shutdown, and
        // a full run (three repetitions of every scenario) otherwise left 16 idle sessions per
        // peer run open until PostgreSQL's connection limit refused new ones.
        let peer_pool = pool.clone();
        let peer = SqlxBroker::new(pool);
        let mode = scenario.mode;
        let app = RustStream::new(AppInfo::new("sqlx-broker-bench", "0.1.0")).with_broker(
            peer,
            move |b| match mode {
                ClaimMode::RowLock => {
                    b.include(ack_row_lock.workers(workers));
                }
                _ => {
                    b.include(ack_lease.workers(workers));
                }
            },
        );
        let base = ACKED.load(Ordering::Relaxed);
        let running = app.start().await?;
        let result = drain::watch_count(limits, || ACKED.load(Ordering::Relaxed) - base).await;
        tokio::time::timeout(Duration::from_secs(30), running.shutdown())
            .await
            .map_err(|_| "ruststream-sqlx did not shut down within 30 s")??;
        peer_pool.close().await;
        Ok::<_, BoxError>(result)
    }
    .await;
    let dropped = broker.drop_tables(&table).await;
    let result = result?;
    dropped?;
    Ok(result)
}
