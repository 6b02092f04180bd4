//! How a subscription fits its pool and plans its claims: the concurrency and claim limit a
//! pool can serve ([`fit_to_pool`]), and rows per claim, claims in flight and rows held beyond
//! the worker slots ([`Plan`]). Pure, apart from the warnings it logs.

use super::options::SubscribeOptions;
use crate::claim_mode::ClaimMode;
use crate::driver::Backend;
use crate::mode::QueueInner;
use crate::table::TableDescription;

/// The pool size the engine plans with.
pub(super) fn pool_size<B: Backend>(queue: &QueueInner<B>) -> usize {
    usize::try_from(
        queue
            .shared
            .broker
            .backend
            .pool()
            .options()
            .get_max_connections(),
    )
    .unwrap_or(usize::MAX)
    .max(1)
}

/// The most claims in flight a pool of `pool` connections serves: each claim holds a connection
/// while it runs, and the other half of the pool stays free for settlements and publishes.
fn claims_for_pool(pool: usize) -> usize {
    (pool / 2).max(1)
}

/// Lowers a concurrency the pool cannot serve where every delivery holds a connection (row lock,
/// and advisory keys held on connections, that is where the backend's keys are not
/// `process_local_keys`), and an explicit claim limit above what the pool serves, each with a
/// warning. Beyond the pool, more workers only queue for connections: at concurrency 10,000 on
/// a pool of 5, claims and settlements timed out by the hundred thousand and throughput fell
/// below that of 8 workers. Returns the warnings, for [`Health::warnings`](super::Health::warnings)
/// (and standard error without a `tracing` subscriber).
pub(super) fn fit_to_pool(
    options: &mut SubscribeOptions,
    table: &TableDescription,
    pool: usize,
    process_local_keys: bool,
) -> Vec<String> {
    let mut warnings = Vec::new();
    let holds_connection = match table.mode() {
        ClaimMode::RowLock => true,
        ClaimMode::Advisory => !process_local_keys,
        ClaimMode::Lease => false,
    };
    let most = (pool * 3 / 4).max(1);
    if holds_connection && options.concurrency > most {
        tracing::warn!(
            table = table.name(),
            asked = options.concurrency,
            pool,
            using = most,
            "every delivery in work holds a pool connection in this mode; lowering the concurrency to three quarters of the pool (grow the pool for more)"
        );
        let text = format!(
            "concurrency {} lowered to {most}: in {:?} mode every delivery in work holds one of the pool's {pool} connections; grow the pool (max_connections {}) for more",
            options.concurrency,
            table.mode(),
            options.concurrency.saturating_mul(4).div_ceil(3),
        );
        crate::warnings::report(table.name(), text.clone());
        warnings.push(text);
        options.concurrency = most;
    }
    let claims = claims_for_pool(pool);
    if let Some(n) = options.max_claims_in_flight
        && n > claims
    {
        tracing::warn!(
            table = table.name(),
            asked = n,
            pool,
            using = claims,
            "each claim in flight holds a pool connection; lowering max_claims_in_flight to half the pool"
        );
        let text = format!(
            "max_claims_in_flight {n} lowered to {claims}: each claim in flight holds one of the pool's {pool} connections"
        );
        crate::warnings::report(table.name(), text.clone());
        warnings.push(text);
        options.max_claims_in_flight = Some(claims);
    }
    warnings
}

/// How a subscription claims: rows per claim, claims in flight, and rows held beyond the slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    /// The most rows one claim asks for.
    pub(super) batch: usize,
    /// The most claims in flight.
    pub(super) max_claims: usize,
    /// Claimed rows that may wait for a slot (lease mode only).
    pub(super) prefetch: usize,
}

impl Plan {
    /// The plan for `options` on `table` with a pool of `pool` connections (after
    /// [`fit_to_pool`]).
    pub(super) fn new(options: &SubscribeOptions, table: &TableDescription, pool: usize) -> Self {
        let mode = table.mode();
        // Row lock claims one row per transaction, and an advisory claim locks and takes one
        // key after another, so those modes run one single-row claim per slot side by side
        // (advisory claims share their candidate reads); lease claims take a batch in one
        // statement.
        let batch = match mode {
            ClaimMode::RowLock | ClaimMode::Advisory => 1,
            ClaimMode::Lease => options.batch_size.unwrap_or(options.concurrency),
        };
        // Enough claims in flight to fill every slot: one per batch of slots, and a single one
        // for a single worker, which on SQLite would only contend with itself for the one
        // writer.
        let max_claims = options.max_claims_in_flight.unwrap_or_else(|| {
            options
                .concurrency
                .div_ceil(batch)
                .clamp(1, options.concurrency)
                .min(claims_for_pool(pool))
        });
        // Rows this subscription holds: in work, waiting for a slot, or asked for by a claim in
        // flight. A lease costs nothing while it waits (renewal keeps it), so lease mode claims
        // whole batches and holds up to two beyond the slots: the next batch is claimed while
        // the last one still feeds the slots, and no slot waits for a claim. Small batches hold
        // at least one row per slot beyond them: a row keeps its place in the window until its
        // ack's statement returns, and acks wait for the one in flight (they share it), so with
        // two single-row batches the window filled with rows waiting for their ack and the
        // claims stalled (lease, batch 1, PostgreSQL: 0.87-0.94 of the hand-written loop at 4-8
        // workers with two, 1.03-1.20 with one per slot, alternating runs). A row lock or a
        // key holds a connection, so those modes hold no more rows than slots. Neither do FIFO
        // tables: while a group's head is in work a claim finds nothing in that group, so
        // claims beside the rows in work mostly come back empty, having scanned the group and
        // contended with the others.
        let prefetch = if mode == ClaimMode::Lease && !table.fifo() {
            (2 * batch).max(options.concurrency)
        } else {
            0
        };
        Self {
            batch,
            max_claims,
            prefetch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::ColumnType;

    fn lease() -> TableDescription {
        TableDescription::builder("jobs")
            .locked_until("locked_until")
            .build()
            .unwrap()
    }

    fn fifo_lease() -> TableDescription {
        TableDescription::builder("jobs")
            .locked_until("locked_until")
            .group("grp")
            .fifo(true)
            .build()
            .unwrap()
    }

    fn row_lock() -> TableDescription {
        TableDescription::builder("jobs").build().unwrap()
    }

    fn advisory() -> TableDescription {
        TableDescription::builder("jobs")
            .column("account", ColumnType::Text)
            .advisory_lock("account-{account}")
            .build()
            .unwrap()
    }

    fn plan(options: SubscribeOptions, table: &TableDescription, pool: usize) -> Plan {
        Plan::new(&options, table, pool)
    }

    #[test]
    fn lease_claims_take_a_batch_of_the_concurrency_and_prefetch_two_batches() {
        let p = plan(SubscribeOptions::new().concurrency(8), &lease(), 10);
        assert_eq!(
            p,
            Plan {
                batch: 8,
                max_claims: 1,
                prefetch: 16
            }
        );
    }

    #[test]
    fn small_lease_batches_prefetch_at_least_one_row_per_slot() {
        let p = plan(
            SubscribeOptions::new().concurrency(8).batch_size(2),
            &lease(),
            20,
        );
        assert_eq!(
            p,
            Plan {
                batch: 2,
                max_claims: 4,
                prefetch: 8
            }
        );
    }

    #[test]
    fn fifo_lease_tables_hold_no_rows_beyond_the_slots() {
        let p = plan(SubscribeOptions::new().concurrency(8), &fifo_lease(), 10);
        assert_eq!(p.prefetch, 0);
        assert_eq!(p.batch, 8);
    }

    #[test]
    fn row_lock_and_advisory_claims_take_one_row_each_side_by_side() {
        for table in [row_lock(), advisory()] {
            let p = plan(
                SubscribeOptions::new().concurrency(4).batch_size(50),
                &table,
                20,
            );
            assert_eq!(
                p,
                Plan {
                    batch: 1,
                    max_claims: 4,
                    prefetch: 0
                },
                "{:?}",
                table.mode()
            );
        }
    }

    #[test]
    fn claims_in_flight_default_to_half_the_pool_at_most() {
        let p = plan(SubscribeOptions::new().concurrency(16), &row_lock(), 6);
        assert_eq!(p.max_claims, 3);
        let p = plan(SubscribeOptions::new().concurrency(16), &row_lock(), 1);
        assert_eq!(p.max_claims, 1, "a pool of one still claims");
    }

    #[test]
    fn a_single_worker_runs_one_claim() {
        let p = plan(SubscribeOptions::new(), &row_lock(), 10);
        assert_eq!(p.max_claims, 1);
    }

    #[test]
    fn an_explicit_claim_limit_is_kept() {
        let p = plan(
            SubscribeOptions::new()
                .concurrency(16)
                .max_claims_in_flight(7),
            &row_lock(),
            4,
        );
        assert_eq!(p.max_claims, 7, "fit_to_pool lowers it, not the plan");
    }

    #[test]
    fn a_row_lock_concurrency_beyond_the_pool_is_lowered_to_three_quarters_of_it() {
        let mut options = SubscribeOptions::new().concurrency(100);
        let warnings = fit_to_pool(&mut options, &row_lock(), 8, false);
        assert_eq!(options.concurrency, 6);
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].starts_with("concurrency 100 lowered to 6"),
            "{warnings:?}"
        );
        assert!(warnings[0].contains("max_connections 134"), "{warnings:?}");
    }

    #[test]
    fn advisory_keys_held_on_connections_lower_the_concurrency_and_process_local_keys_do_not() {
        let mut options = SubscribeOptions::new().concurrency(100);
        assert_eq!(fit_to_pool(&mut options, &advisory(), 8, false).len(), 1);
        assert_eq!(options.concurrency, 6);
        let mut options = SubscribeOptions::new().concurrency(100);
        assert!(fit_to_pool(&mut options, &advisory(), 8, true).is_empty());
        assert_eq!(options.concurrency, 100);
    }

    #[test]
    fn a_lease_concurrency_is_not_bound_by_the_pool() {
        let mut options = SubscribeOptions::new().concurrency(100);
        assert!(fit_to_pool(&mut options, &lease(), 8, false).is_empty());
        assert_eq!(options.concurrency, 100);
    }

    #[test]
    fn a_claim_limit_beyond_half_the_pool_is_lowered() {
        let mut options = SubscribeOptions::new().max_claims_in_flight(6);
        let warnings = fit_to_pool(&mut options, &lease(), 8, false);
        assert_eq!(options.max_claims_in_flight, Some(4));
        assert_eq!(
            warnings,
            [
                "max_claims_in_flight 6 lowered to 4: each claim in flight holds one of the pool's 8 connections"
            ]
        );
    }

    #[test]
    fn options_the_pool_serves_pass_without_a_warning() {
        let mut options = SubscribeOptions::new()
            .concurrency(6)
            .max_claims_in_flight(4);
        assert!(fit_to_pool(&mut options, &row_lock(), 8, false).is_empty());
        assert_eq!(options.concurrency, 6);
        assert_eq!(options.max_claims_in_flight, Some(4));
    }
}
