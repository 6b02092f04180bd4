//! The conformance suite of sqlx-broker, written once: every backend crate runs it from its own
//! `tests/` against a live database.
//!
//! Cases are ordinary generic async functions in [`cases`]; [`conformance_suite!`] stamps out one
//! `#[tokio::test]` per case (and per claim mode, where a case is about a mode), so each case has
//! its own name, can be filtered (`cargo test lease_`), and fails on its own. What a backend can
//! do comes from its [`Capabilities`](broker_core::Capabilities), never from the database's name.
//!
//! ```text
//! // broker-sqlite/tests/conformance.rs
//! struct Db;
//! impl broker_testkit::TestDb for Db { /* connect, fresh database, key probe */ }
//! broker_testkit::conformance_suite!(Db);
//! ```

pub mod cases;
pub(crate) mod fixture;
pub mod history;

pub use fixture::{
    DbOf, Fixture, Job, JobText, TestDb, UNDECODABLE, claim_one, claim_within, describe, report,
    unique_name, wait_until,
};

/// Stamps one `#[tokio::test]` per conformance case for the [`TestDb`] type `$db`.
#[macro_export]
macro_rules! conformance_suite {
    ($db:ty) => {
        $crate::conformance_suite!(@plain $db;
            modes_follow_the_description,
            every_description_error_is_refused_with_a_clear_message,
            a_missing_table_is_a_schema_error_naming_it,
            a_missing_column_is_a_schema_error_naming_it,
            an_unoffered_mode_is_refused_with_what_to_add,
            renewal_keeps_a_handler_that_runs_three_leases,
            prefetched_rows_keep_their_leases_while_they_wait,
            a_stale_lease_holder_cannot_settle,
            rows_with_one_key_never_overlap_while_other_keys_run,
            a_publish_in_a_rolled_back_transaction_leaves_no_row,
            a_settlement_after_close_is_refused,
            a_publish_wakes_an_idle_subscription,
            row_lock_handler_writes_commit_with_the_ack_only,
            a_null_key_value_is_delivered_under_the_empty_key,
            a_text_attempt_column_is_a_schema_error_naming_it,
        );
        $crate::conformance_suite!(@modes $db;
            first_delivery_reads_attempt_one,
            attempts_count_across_retries,
            a_dropped_delivery_counts_as_its_mode_says,
            ack_deletes_the_row,
            ack_marks_processed_at,
            retry_after_hides_the_row_until_due,
            scheduled_rows_are_not_claimed_early,
            exhausted_rows_move_to_the_dead_letter_table,
            exhausted_rows_get_the_dead_letter_mark,
            two_subscriptions_never_hold_one_row,
            fifo_groups_run_in_order_one_at_a_time,
            higher_priority_runs_first,
            shutdown_leaves_no_row_claimed_and_no_key_held,
            shutdown_deadline_drops_handlers_and_releases_rows,
            a_handler_panic_is_a_retry,
            a_handler_error_is_a_retry,
            a_row_that_does_not_decode_is_retried_not_lost,
            stress_with_random_outcomes_and_kills,
            killed_connections_lose_nothing,
            identifiers_and_values_that_look_like_sql_round_trip,
            a_table_with_only_the_required_columns_works,
        );
        $crate::conformance_suite!(@named $db;
            a_killed_worker_gives_its_rows_back,
        );
        $crate::conformance_suite!(@hardening $db);
    };
    // Bad input and faults (cases/hardening.rs).
    (@hardening $db:ty) => {
        mod hardening {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@plain $db;
                a_batch_publish_with_a_poisoned_last_row_commits_nothing,
                a_take_whose_read_fails_spends_no_attempt,
                option_values_the_engine_cannot_run_with_are_refused,
                claims_that_keep_failing_back_off_and_show_in_health,
                names_longer_than_the_database_keeps_are_refused,
                a_null_payload_is_a_decode_error_unless_the_payload_is_optional,
            );
            $crate::conformance_suite!(@modes $db;
                a_retry_after_duration_max_parks_the_row_far_away,
                a_settlement_that_always_fails_ends_in_the_dead_letters,
                a_settlement_that_always_fails_without_dead_letters_backs_off,
                concurrency_200_drains_like_8_on_the_default_pool,
            );
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_row_deleted_while_leased_is_reported_gone() {
                $crate::cases::a_row_deleted_while_claimed_is_reported_gone::<$db>($crate::__private::ClaimMode::Lease).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_row_deleted_while_its_key_is_held_is_reported_gone() {
                $crate::cases::a_row_deleted_while_claimed_is_reported_gone::<$db>($crate::__private::ClaimMode::Advisory).await;
            }
        }
    };
    (@named $db:ty; $($case:ident),* $(,)?) => {
        mod killed {
            #[allow(unused_imports)]
            use super::*;
            $(
                mod $case {
                    #[allow(unused_imports)]
                    use super::*;
                    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                    async fn row_lock() {
                        $crate::cases::$case::<$db>($crate::__private::ClaimMode::RowLock, concat!(module_path!(), "::row_lock")).await;
                    }
                    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                    async fn lease() {
                        $crate::cases::$case::<$db>($crate::__private::ClaimMode::Lease, concat!(module_path!(), "::lease")).await;
                    }
                    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                    async fn advisory() {
                        $crate::cases::$case::<$db>($crate::__private::ClaimMode::Advisory, concat!(module_path!(), "::advisory")).await;
                    }
                }
            )*
        }
    };
    (@plain $db:ty; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::cases::$case::<$db>().await;
            }
        )*
    };
    (@modes $db:ty; $($case:ident),* $(,)?) => {
        mod row_lock {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    $crate::cases::$case::<$db>($crate::__private::ClaimMode::RowLock).await;
                }
            )*
        }
        mod lease {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    $crate::cases::$case::<$db>($crate::__private::ClaimMode::Lease).await;
                }
            )*
        }
        mod advisory {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    $crate::cases::$case::<$db>($crate::__private::ClaimMode::Advisory).await;
                }
            )*
        }
    };
}

#[doc(hidden)]
pub mod __private {
    pub use broker_core::ClaimMode;
}
