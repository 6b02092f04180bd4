//! The conformance suite of sqlx-broker, written once: every backend crate runs it from its own
//! `tests/` against a live database.
//!
//! Cases are ordinary generic async functions in [`cases`]; [`conformance_suite!`] stamps out one
//! test per case (and per claim mode, where a case is about a mode), so each case has its own
//! name, can be filtered (`cargo test lease_`), and fails on its own, hung ones included: each
//! runs under a time limit. What a backend can do comes from its
//! [`Capabilities`](broker_core::Capabilities), never from the database's name.
//!
//! ```text
//! // broker-sqlite/tests/conformance.rs
//! struct Db;
//! impl broker_testkit::TestDb for Db { /* connect, fresh database, key probe */ }
//! broker_testkit::conformance_suite!(Db);
//! ```

pub mod cases;
pub(crate) mod engine_events;
pub(crate) mod fixture;
pub mod history;
pub mod outage;
pub mod registry;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod pg;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// `url` with its database (the path after the host) replaced by `database`, its query kept.
pub fn url_with_database(url: &str, database: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (url, None),
    };
    let scheme_end = head.find("://").map_or(0, |i| i + 3);
    let host_end = head[scheme_end..]
        .find('/')
        .map_or(head.len(), |i| scheme_end + i);
    let mut out = format!("{}/{database}", &head[..host_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Whether `name` (a [`unique_name`], `sb_<what>_<pid>_..`) was made by another test process
/// that is gone: what a test that panicked left behind, which the next run may drop.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    expect(dead_code, reason = "used by the server backends' test databases")
)]
pub(crate) fn left_by_a_gone_process(name: &str) -> bool {
    let pid = name.split('_').nth(2).and_then(|p| p.parse::<u32>().ok());
    pid.is_some_and(|pid| {
        pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
    })
}

pub use fixture::{
    DbOf, Fixture, Job, JobText, Runs, TestDb, UNDECODABLE, assert_counters_add_up, claim_one,
    claim_within, describe, hold_row_lock_on, report, report_not_run, subscribe_counting,
    unique_name, wait_until, wait_until_rows_gone,
};

/// Stamps one `#[test]` per conformance case for the [`TestDb`] type `$db`, each run on a
/// multi-threaded tokio runtime under a time limit (`SQLX_BROKER_CASE_TIMEOUT`, default 300 s;
/// `SQLX_BROKER_LONG_CASE_TIMEOUT`, default 900 s, for the stress, kill and schedule cases).
///
/// The backend says what it offers, and only that is stamped, so no case returns early on a mode
/// that does not apply:
///
/// ```text
/// broker_testkit::conformance_suite!(Pg);   // every mode, server connections to kill
/// broker_testkit::conformance_suite!(Sqlite; modes: [lease, advisory]; server_connections: no);
/// ```
///
/// Each mode gets a module (`row_lock::`, `lease::`, `advisory::`) with the mode cases, the
/// fencing cases where the mode fences settlements (lease, advisory), the row-lock-only cases in
/// `row_lock::`, and the killed-connections case where the database has server connections.
/// `the_suite_covers_what_the_backend_offers` fails when the list and the backend's
/// [`Capabilities`](broker_core::Capabilities) disagree, and
/// `an_unoffered_mode_is_refused_with_what_to_add` checks the refusal of a mode left out.
#[macro_export]
macro_rules! conformance_suite {
    ($db:ty) => {
        $crate::conformance_suite!($db; modes: [row_lock, lease, advisory]; server_connections: yes);
    };
    ($db:ty; modes: [$($mode:ident),+ $(,)?]; server_connections: $server:ident) => {
        $crate::conformance_suite!(@plain $db;
            modes_follow_the_description,
            every_description_error_is_refused_with_a_clear_message,
            a_missing_table_is_a_schema_error_naming_it,
            claim_indexes_follow_the_claim_order,
            an_outdated_claim_index_is_named_with_the_statements_that_replace_it,
            a_missing_column_is_a_schema_error_naming_it,
            an_unoffered_mode_is_refused_with_what_to_add,
            renewal_keeps_a_handler_that_runs_three_leases,
            prefetched_rows_keep_their_leases_while_they_wait,
            rows_with_one_key_never_overlap_while_other_keys_run,
            rows_of_other_keys_are_claimed_past_many_rows_of_a_held_key,
            the_key_walk_passes_a_held_key_of_any_length,
            a_missing_key_index_is_named_with_the_statement_that_makes_it,
            a_publish_in_a_rolled_back_transaction_leaves_no_row,
            a_settlement_after_close_is_refused,
            a_publish_wakes_an_idle_subscription,
            a_null_key_value_is_delivered_under_the_empty_key,
            a_text_attempt_column_is_a_schema_error_naming_it,
            a_pause_from_another_broker_stops_claims_and_a_resume_restarts_them,
            bad_operations_are_refused_and_change_nothing,
            rows_are_listed_by_state_a_page_at_a_time_and_old_finished_rows_purged,
            a_last_error_column_that_is_not_text_is_a_schema_error_naming_it,
            every_missing_column_is_named,
            rows_that_do_not_decode_show_in_health,
            options_lowered_to_fit_the_pool_show_in_health,
            an_error_backoff_on_a_table_without_a_due_column_shows_in_health,
            close_before_shutdown_waits_for_the_handlers,
            the_shutdown_report_counts_only_deliveries_in_work_at_the_stop,
            the_doctor_fails_a_missing_table_and_passes_no_index_check_on_it,
            a_missing_advisory_key_column_is_named_by_its_role,
        );
        #[test]
        fn the_suite_covers_what_the_backend_offers() {
            $crate::__private::run_case(
                concat!(module_path!(), "::the_suite_covers_what_the_backend_offers"),
                async {
                    let modes = [$($crate::__private::mode(stringify!($mode))),+];
                    $crate::cases::the_suite_covers_what_the_backend_offers::<$db>(
                        &modes,
                        stringify!($server) == "yes",
                    )
                    .await;
                },
            );
        }
        $crate::conformance_suite!(@register $db; the_suite_covers_what_the_backend_offers; None; |_path| {
            ::std::boxed::Box::pin(async {
                let modes = [$($crate::__private::mode(stringify!($mode))),+];
                $crate::cases::the_suite_covers_what_the_backend_offers::<$db>(
                    &modes,
                    stringify!($server) == "yes",
                )
                .await;
            })
        });
        $( $crate::conformance_suite!(@mode $db; $mode; $server); )+
        // Bad input and faults that are about no one mode (cases/hardening.rs).
        mod hardening {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@plain $db;
                a_batch_publish_with_a_poisoned_last_row_commits_nothing,
                a_take_whose_read_fails_spends_no_attempt,
                option_values_the_engine_cannot_run_with_are_refused,
                claims_that_keep_failing_back_off_and_show_in_health,
                a_statement_that_waits_shows_in_health_before_it_fails,
                names_longer_than_the_database_keeps_are_refused,
                a_null_payload_is_a_decode_error_unless_the_payload_is_optional,
                names_and_key_pieces_that_end_string_literals_work_in_every_statement,
                a_long_last_error_is_cut_when_read_and_the_read_says_so,
                a_payload_type_the_column_cannot_read_is_refused_naming_the_column,
                the_ddl_helper_refuses_what_create_tables_refuses_with_the_same_error,
            );
        }
        // Job kinds (cases/kinds.rs).
        mod kinds {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@plain $db;
                what_kinds_cannot_run_with_is_refused_with_what_to_change,
                a_job_whose_kind_attempts_crashes_spent_is_dead_lettered_unrun,
                a_job_timeout_without_its_column_is_refused_with_what_to_add,
                a_layer_around_the_workers_sees_each_jobs_kind_and_outcome,
                a_kind_is_its_exact_name_whatever_the_columns_collation,
                a_schedule_publishes_a_kind_that_its_worker_runs,
            );
        }
        // Job kinds in stats, listings and the doctor (cases/kinds_ops.rs).
        mod kinds_ops {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@plain $db;
                the_doctor_names_kinds_no_worker_knows,
            );
            $( $crate::conformance_suite!(@kinds_ops $db; $mode); )+
        }
        // Snooze (cases/snooze.rs).
        mod snooze {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@plain $db;
                what_a_table_cannot_snooze_with_is_refused_with_what_to_add,
            );
        }
        $crate::conformance_suite!(@server_plain $db; $server);
        // Unique keys and periodic schedules that are about no one mode (cases/unique.rs,
        // cases/periodic.rs).
        mod unique_and_periodic {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@plain $db;
                bad_unique_keys_are_refused_with_what_to_change,
                the_doctor_fails_a_table_without_its_unique_index,
                bad_schedules_are_refused_with_a_clear_error,
                four_brokers_on_one_schedule_publish_each_tick_once_with_one_killed_and_restarted,
                missed_ticks_are_skipped_by_default_and_run_latest_publishes_the_latest_once,
            );
            #[test]
            fn four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled() {
                const NAME: &str = concat!(module_path!(), "::four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled");
                $crate::__private::run_case(
                    NAME,
                    $crate::cases::four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled::<$db>(NAME),
                );
            }
            $crate::conformance_suite!(@register $db;
                four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled; None; |path| {
                    ::std::boxed::Box::pin(
                        $crate::cases::four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled::<$db>(path),
                    )
                });
        }
    };
    (@mode $db:ty; $mode:ident; $server:ident) => {
        mod $mode {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@each $db; $mode;
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
                a_wake_up_during_a_claim_in_flight_is_not_lost,
                fifo_groups_run_side_by_side,
                a_fifo_retry_keeps_its_group_waiting,
                a_fifo_delayed_retry_blocks_later_rows_of_its_group,
                a_fifo_group_moves_on_past_processed_and_dead_rows,
                a_fifo_row_inserted_by_plain_sql_waits_for_its_head,
                a_fifo_group_that_empties_and_fills_again_keeps_its_order,
                a_walk_that_starts_after_the_last_group_goes_on_from_the_first,
                higher_priority_runs_first,
                shutdown_leaves_no_row_claimed_and_no_key_held,
                shutdown_deadline_drops_handlers_and_releases_rows,
                a_stopped_subscription_gives_its_kept_connections_back_at_once,
                rows_inserted_by_plain_sql_into_a_busy_queue_run_without_waiting_for_the_poll,
                a_row_given_back_behind_the_head_is_the_next_claims_first,
                stats_count_every_row_once_while_workers_drain,
                cancel_and_run_now_are_refused_for_a_row_in_work_and_applied_otherwise,
                a_requeued_dead_letter_runs_again_reading_attempt_one,
                a_handler_panic_is_a_retry,
                a_handler_error_is_a_retry,
                a_row_that_does_not_decode_is_retried_not_lost,
                identifiers_and_values_that_look_like_sql_round_trip,
                a_table_with_only_the_required_columns_works,
                a_retry_after_duration_max_parks_the_row_far_away,
                a_settlement_that_always_fails_ends_in_the_dead_letters,
                a_settlement_that_always_fails_without_dead_letters_backs_off,
                concurrency_200_drains_like_8_on_the_default_pool,
                settlement_and_shutdown_leave_nothing_held_in_mode,
                fifo_settlement_and_shutdown_leave_nothing_held,
            );
            #[test]
            fn a_killed_worker_gives_its_rows_back() {
                const NAME: &str = concat!(module_path!(), "::a_killed_worker_gives_its_rows_back");
                $crate::__private::run_case(
                    NAME,
                    $crate::cases::a_killed_worker_gives_its_rows_back::<$db>($crate::__private::mode(stringify!($mode)), NAME),
                );
            }
            #[test]
            fn stress_with_random_outcomes_and_kills() {
                const NAME: &str = concat!(module_path!(), "::stress_with_random_outcomes_and_kills");
                $crate::__private::run_case(
                    NAME,
                    $crate::cases::stress_with_random_outcomes_and_kills::<$db>($crate::__private::mode(stringify!($mode)), NAME),
                );
            }
            $crate::conformance_suite!(@register $db; a_killed_worker_gives_its_rows_back;
                Some(stringify!($mode)); |path| {
                    ::std::boxed::Box::pin($crate::cases::a_killed_worker_gives_its_rows_back::<$db>(
                        $crate::__private::mode(stringify!($mode)), path,
                    ))
                });
            $crate::conformance_suite!(@register $db; stress_with_random_outcomes_and_kills;
                Some(stringify!($mode)); |path| {
                    ::std::boxed::Box::pin($crate::cases::stress_with_random_outcomes_and_kills::<$db>(
                        $crate::__private::mode(stringify!($mode)), path,
                    ))
                });
            // Snooze (cases/snooze.rs).
            $crate::conformance_suite!(@each $db; $mode;
                a_snooze_spends_no_attempt,
                a_snoozed_row_waits_for_its_delay,
                snoozes_past_max_snoozes_end_in_the_dead_letters,
                a_snoozed_fifo_head_keeps_its_group_waiting_across_brokers,
            );
            // Operator signals across processes (cases/signals_process.rs).
            #[test]
            fn operator_signals_reach_a_subscription_in_another_process() {
                const NAME: &str = concat!(module_path!(), "::operator_signals_reach_a_subscription_in_another_process");
                $crate::__private::run_case(
                    NAME,
                    $crate::cases::operator_signals_reach_a_subscription_in_another_process::<$db>($crate::__private::mode(stringify!($mode)), NAME),
                );
            }
            $crate::conformance_suite!(@register $db; operator_signals_reach_a_subscription_in_another_process;
                Some(stringify!($mode)); |path| {
                    ::std::boxed::Box::pin($crate::cases::operator_signals_reach_a_subscription_in_another_process::<$db>(
                        $crate::__private::mode(stringify!($mode)), path,
                    ))
                });
            // Job kinds (cases/kinds.rs).
            $crate::conformance_suite!(@each $db; $mode;
                many_kinds_in_one_table_run_on_their_workers,
                a_row_of_an_unknown_kind_is_left_for_a_process_that_knows_it,
                a_kinds_max_attempts_and_timeout_apply_to_its_jobs,
                a_kinds_group_priority_and_unique_key_come_from_its_arguments,
                a_jobs_own_timeout_applies_in_place_of_the_subscriptions,
                a_fifo_group_is_one_order_across_kinds,
            );
            // Operator signals (cases/signals.rs).
            $crate::conformance_suite!(@each $db; $mode;
                no_handler_starts_after_a_pause_returns,
                a_pause_through_another_broker_reaches_this_one,
                run_now_starts_a_scheduled_row_promptly,
                a_subscription_stopped_while_paused_gives_its_waiting_rows_back,
                dead_letters_requeued_through_another_broker_run_promptly,
            );
            $crate::conformance_suite!(@only $db; $mode);
            $crate::conformance_suite!(@server $db; $mode; $server);
            // Middleware (cases/middleware.rs).
            $crate::conformance_suite!(@each $db; $mode;
                a_layer_sees_each_job_before_and_after_with_its_outcome_or_error,
                a_layer_decides_the_outcome_and_may_answer_without_the_handler,
                a_service_whose_readiness_fails_retries_the_row,
            );
            // Unique keys and schedules in each mode (cases/unique.rs, cases/periodic.rs).
            $crate::conformance_suite!(@each $db; $mode;
                a_duplicate_key_returns_the_existing_row_alone_in_a_batch_and_in_a_transaction,
                eight_brokers_publishing_one_key_at_once_make_one_row,
                a_finished_row_frees_its_key,
                two_brokers_on_one_schedule_publish_each_tick_once_while_workers_ack,
                eight_publishers_of_one_key_beside_an_acking_worker_never_fail,
            );
            // Cancelling a running job (cases/cancel.rs).
            $crate::conformance_suite!(@each $db; $mode;
                a_cancel_from_another_broker_signals_the_running_handler_and_the_row_never_runs_again,
                a_handler_that_ignores_a_cancel_is_dropped_after_the_grace,
            );
            #[test]
            fn a_row_whose_holder_is_killed_while_a_cancel_is_pending_never_runs_again() {
                const NAME: &str = concat!(module_path!(), "::a_row_whose_holder_is_killed_while_a_cancel_is_pending_never_runs_again");
                $crate::__private::run_case(
                    NAME,
                    $crate::cases::a_row_whose_holder_is_killed_while_a_cancel_is_pending_never_runs_again::<$db>($crate::__private::mode(stringify!($mode)), NAME),
                );
            }
            $crate::conformance_suite!(@register $db; a_row_whose_holder_is_killed_while_a_cancel_is_pending_never_runs_again;
                Some(stringify!($mode)); |path| {
                    ::std::boxed::Box::pin($crate::cases::a_row_whose_holder_is_killed_while_a_cancel_is_pending_never_runs_again::<$db>(
                        $crate::__private::mode(stringify!($mode)), path,
                    ))
                });
            // Timeouts (cases/timeouts.rs).
            $crate::conformance_suite!(@each $db; $mode;
                a_hung_handler_is_signalled_then_dropped_after_the_grace_and_retried,
                a_handler_that_watches_its_cancel_signal_returns_early_and_still_timed_out,
                a_timed_out_delivery_and_the_rows_next_delivery_never_overlap,
            );
        }
    };
    // Job kinds in stats and listings, in each mode (cases/kinds_ops.rs).
    (@kinds_ops $db:ty; $mode:ident) => {
        mod $mode {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@each $db; $mode;
                counts_by_kind_add_up_while_subscriptions_drain,
            );
        }
    };
    // Cases of one mode only: row lock's transaction, the fences of lease and advisory.
    (@only $db:ty; row_lock) => {
        $crate::conformance_suite!(@plain $db;
            a_layered_transaction_handler_commits_with_the_ack_only,
            row_lock_handler_writes_commit_with_the_ack_only,
            a_subscribed_handler_writes_through_its_transaction,
            a_busy_subscription_claims_on_its_last_connection_and_gives_it_back_when_idle,
        );
        // Timeouts (cases/timeouts.rs).
        $crate::conformance_suite!(@plain $db;
            a_timed_out_handlers_transaction_writes_roll_back,
            a_handler_timed_out_holding_its_transaction_has_the_connection_closed,
        );
        $crate::conformance_suite!(@each $db; row_lock;
            fifo_groups_take_turns,
            a_head_past_many_groups_without_one_is_claimed,
        );
    };
    (@only $db:ty; lease) => {
        $crate::conformance_suite!(@each $db; lease;
            a_stale_holder_cannot_renew,
            an_ack_whose_reply_was_lost_counts_as_acked,
            acks_that_finish_together_are_each_fenced_on_their_own_token,
            a_stale_ack_in_a_shared_ack_statement_is_refused_alone,
            a_renewal_run_again_after_it_landed_keeps_the_lease,
            a_row_deleted_while_claimed_is_reported_gone,
            subscribe_with_transaction_outside_row_lock_is_refused,
            fifo_groups_take_turns,
            a_head_past_many_groups_without_one_is_claimed,
        );
        $crate::conformance_suite!(@fenced $db; lease);
    };
    (@only $db:ty; advisory) => {
        $crate::conformance_suite!(@each $db; advisory;
            advisory_claims_past_heads_in_work_take_only_heads,
            a_row_passed_over_for_its_held_key_is_claimed_once_the_key_is_free,
            a_held_key_with_only_scheduled_rows_counts_each_row_once,
            keys_that_share_a_long_prefix_are_held_at_once,
            a_key_lock_dropped_without_unlocking_frees_its_key,
            an_advisory_take_rechecks_that_its_row_is_still_the_groups_head,
            a_row_deleted_while_claimed_is_reported_gone,
            subscribe_with_transaction_outside_row_lock_is_refused,
        );
        $crate::conformance_suite!(@fenced $db; advisory);
    };
    (@fenced $db:ty; $mode:ident) => {
        $crate::conformance_suite!(@each $db; $mode;
            a_stale_holder_cannot_ack_by_delete,
            a_stale_holder_cannot_mark_processed,
            a_stale_holder_cannot_retry,
            a_stale_holder_cannot_retry_without_a_due_column,
            a_stale_holder_cannot_retry_after_a_delay,
            a_stale_holder_cannot_move_to_the_dead_letter_table,
            a_stale_holder_cannot_mark_dead,
            a_stale_holder_cannot_snooze,
        );
    };
    (@server $db:ty; $mode:ident; yes) => {
        $crate::conformance_suite!(@each $db; $mode;
            killed_connections_lose_nothing,
            a_shutdown_while_the_server_is_gone_returns_within_its_deadline,
            a_fifo_row_committed_late_with_an_earlier_id_waits_for_the_row_in_work,
        );
        $crate::conformance_suite!(@server_only $db; $mode);
    };
    // Killed connections of one mode only.
    (@server_only $db:ty; row_lock) => {
        $crate::conformance_suite!(@each $db; row_lock;
            a_killed_row_lock_connection_returns_the_row_at_once_without_an_attempt,
        );
    };
    (@server_only $db:ty; advisory) => {
        $crate::conformance_suite!(@each $db; advisory;
            a_killed_key_connection_frees_the_key_and_the_stale_delivery_cannot_settle,
        );
    };
    (@server_only $db:ty; lease) => {
        $crate::conformance_suite!(@each $db; lease;
            a_settlement_gives_up_when_its_lease_runs_out_while_the_server_is_gone,
            an_ack_stuck_behind_a_row_lock_does_not_hold_up_the_others,
            a_settlement_run_again_after_a_cut_leaves_another_claims_row_alone,
        );
    };
    (@server $db:ty; $mode:ident; no) => {};
    // Faults that need server connections and are about no one mode.
    (@server_plain $db:ty; yes) => {
        $crate::conformance_suite!(@plain $db;
            lease_settlements_survive_killed_connections_without_reruns,
            an_idle_subscription_shuts_down_within_its_deadline_while_the_server_is_gone,
        );
    };
    (@server_plain $db:ty; no) => {};
    (@each $db:ty; $mode:ident; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::__private::run_case(
                    concat!(module_path!(), "::", stringify!($case)),
                    $crate::cases::$case::<$db>($crate::__private::mode(stringify!($mode))),
                );
            }
            $crate::conformance_suite!(@register $db; $case; Some(stringify!($mode)); |_path| {
                ::std::boxed::Box::pin($crate::cases::$case::<$db>(
                    $crate::__private::mode(stringify!($mode)),
                ))
            });
        )*
    };
    (@plain $db:ty; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::__private::run_case(
                    concat!(module_path!(), "::", stringify!($case)),
                    $crate::cases::$case::<$db>(),
                );
            }
            $crate::conformance_suite!(@register $db; $case; None; |_path| {
                ::std::boxed::Box::pin($crate::cases::$case::<$db>())
            });
        )*
    };
    // Enters a stamped case in the registry ([`registry`](crate::registry)) beside its test, so
    // `sqlx-broker check` runs the very cases the tests run. `$run` is a closure from the case's
    // test path to its future.
    (@register $db:ty; $case:ident; $mode:expr; $run:expr) => {
        $crate::__private::inventory::submit! {
            $crate::registry::Case {
                db: $crate::__private::type_id::<$db>,
                path: concat!(module_path!(), "::", stringify!($case)),
                mode: $mode,
                group: || $crate::__private::group_of(&$crate::cases::$case::<$db>),
                run: $run,
            }
        }
    };
}

/// The variable that lets tests restart, stop or reconfigure the servers they are given
/// (`SQLX_BROKER_DISRUPTIVE=1`; `.ci/run` sets it). A plain `cargo test` never does.
pub const DISRUPTIVE: &str = "SQLX_BROKER_DISRUPTIVE";

/// Stamps a test that restarts, stops or reconfigures a server the user gave (not one the tests
/// started themselves): `$what` says what it does to which server, e.g. `"restarts the
/// PostgreSQL server at SQLX_BROKER_PG_URL"`.
///
/// Built without `SQLX_BROKER_DISRUPTIVE=1` the test is ignored, and `cargo test` lists it as
/// `ignored, not run: it restarts, stops or reconfigures a server ..; set
/// SQLX_BROKER_DISRUPTIVE=1 to run it`; run anyway (`-- --include-ignored`) without the
/// variable, it fails naming `$what`. With the variable, it runs under the long cases' time
/// limit.
///
/// ```text
/// broker_testkit::disruptive_test!("restarts the PostgreSQL server at SQLX_BROKER_PG_URL",
///     async fn a_server_restart_mid_drain_loses_nothing() { /* .. */ });
/// ```
#[cfg(sqlx_broker_disruptive)]
#[macro_export]
macro_rules! disruptive_test {
    ($what:literal, async fn $name:ident() $body:block) => {
        #[test]
        fn $name() {
            $crate::__private::run_disruptive(
                concat!(module_path!(), "::", stringify!($name)),
                $what,
                async move $body,
            );
        }
    };
}

/// See the other definition: this one is built without `SQLX_BROKER_DISRUPTIVE=1`.
#[cfg(not(sqlx_broker_disruptive))]
#[macro_export]
macro_rules! disruptive_test {
    ($what:literal, async fn $name:ident() $body:block) => {
        #[test]
        // A literal: libtest drops a reason made by a macro.
        #[ignore = "not run: it restarts, stops or reconfigures a server the tests were given; set SQLX_BROKER_DISRUPTIVE=1 to run it (.ci/run does)"]
        fn $name() {
            $crate::__private::run_disruptive(
                concat!(module_path!(), "::", stringify!($name)),
                $what,
                async move $body,
            );
        }
    };
}

#[doc(hidden)]
pub mod __private {
    use std::future::Future;
    use std::time::Duration;

    pub use broker_core::ClaimMode;
    pub use inventory;

    /// The [`TypeId`](std::any::TypeId) of a test database, for the registry's entries.
    pub fn type_id<D: 'static>() -> std::any::TypeId {
        std::any::TypeId::of::<D>()
    }

    /// The file of `cases/` a case function is written in (`"fencing"` for
    /// `cases::fencing::a_stale_holder_cannot_ack_by_delete`): its guarantee group. Read from
    /// the function's type name, which names the module it is defined in; `"other"` where that
    /// name says nothing.
    pub fn group_of<F>(_case: &F) -> &'static str {
        let name = std::any::type_name::<F>();
        name.split("::cases::")
            .nth(1)
            .and_then(|rest| rest.split("::").next())
            .filter(|g| !g.contains('<') && !g.is_empty())
            .unwrap_or("other")
    }

    /// Runs one stamped case, `name` its full test path, as `#[tokio::test(flavor =
    /// "multi_thread", worker_threads = 4)]` would, under the case's time limit
    /// ([`case_limit`]): a case still running then fails, naming itself and the variable that
    /// raises the limit, instead of hanging the run.
    ///
    /// The case runs as a task of its own, so the limit holds even while the case blocks a
    /// worker thread; the runtime is then given 10 s to stop before the test fails.
    pub fn run_case(name: &'static str, case: impl Future<Output = ()> + Send + 'static) {
        match try_run_case(name, case) {
            Ok(()) => {}
            Err(CaseFailed::Panicked(payload)) => std::panic::resume_unwind(payload),
            Err(CaseFailed::Other(message)) => panic!("{message}"),
        }
    }

    pub use crate::registry::CaseFailed;

    /// [`run_case`] returning how the case failed instead of panicking, for a runner that goes
    /// on to the next case (`sqlx-broker check`).
    pub fn try_run_case(
        name: &'static str,
        case: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), CaseFailed> {
        let (limit, variable) = case_limit(name);
        // Its threads carry the case's name, so a panic in the case's task names the case.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name(name)
            .enable_all()
            .build()
            .expect("a runtime for the case");
        let ended =
            runtime.block_on(async { tokio::time::timeout(limit, tokio::spawn(case)).await });
        runtime.shutdown_timeout(Duration::from_secs(10));
        match ended {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if e.is_panic() => Err(CaseFailed::Panicked(e.into_panic())),
            Ok(Err(e)) => Err(CaseFailed::Other(format!("{name}: {e}"))),
            Err(_) => Err(CaseFailed::Other(format!(
                "{name} did not finish within its limit of {} s: it hangs, or this machine is \
                 too slow for it; set {variable}=<seconds> to give it longer",
                limit.as_secs()
            ))),
        }
    }

    /// Whether the case at test path `name` is one of the long ones (stress, kills, schedules
    /// of many brokers), which `sqlx-broker check --quick` leaves out.
    pub fn is_long_case(name: &str) -> bool {
        LONG_CASES.contains(&name.rsplit("::").next().unwrap_or(name))
    }

    /// Runs a [`disruptive_test!`](crate::disruptive_test) under the long cases' limit, once the
    /// user has said it may disrupt the server (`$SQLX_BROKER_DISRUPTIVE` is `1` now, too).
    pub fn run_disruptive(
        name: &'static str,
        what: &str,
        case: impl Future<Output = ()> + Send + 'static,
    ) {
        assert!(
            std::env::var(crate::DISRUPTIVE).is_ok_and(|v| v == "1"),
            "{name} was not run: it {what}; set {}=1 to run it",
            crate::DISRUPTIVE
        );
        run_case(name, case);
    }

    /// Cases that run for a while by design (stress, kills, schedules of many brokers): their
    /// limit is [`LONG_CASE_TIMEOUT`]'s; every other case gets [`CASE_TIMEOUT`]'s.
    const LONG_CASES: &[&str] = &[
        "stress_with_random_outcomes_and_kills",
        "a_killed_worker_gives_its_rows_back",
        "operator_signals_reach_a_subscription_in_another_process",
        "killed_connections_lose_nothing",
        "lease_settlements_survive_killed_connections_without_reruns",
        "four_brokers_on_one_schedule_publish_each_tick_once_with_one_killed_and_restarted",
        "four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled",
        "two_brokers_on_one_schedule_publish_each_tick_once_while_workers_ack",
        "missed_ticks_are_skipped_by_default_and_run_latest_publishes_the_latest_once",
        "eight_brokers_publishing_one_key_at_once_make_one_row",
        "concurrency_200_drains_like_8_on_the_default_pool",
        "a_server_restart_mid_drain_loses_nothing_and_reruns_no_lease_handler",
    ];

    /// The variable with an ordinary case's limit in seconds (default 300: most cases take a
    /// few seconds, and a loaded 2-core machine can make that a minute).
    pub const CASE_TIMEOUT: &str = "SQLX_BROKER_CASE_TIMEOUT";
    /// The variable with a long case's limit in seconds (default 900: the stress case takes
    /// about a minute on a quiet 2-core machine).
    pub const LONG_CASE_TIMEOUT: &str = "SQLX_BROKER_LONG_CASE_TIMEOUT";

    /// The time limit of the case at test path `name`, and the variable that sets it.
    pub fn case_limit(name: &str) -> (Duration, &'static str) {
        let case = name.rsplit("::").next().unwrap_or(name);
        let (variable, default) = if LONG_CASES.contains(&case) {
            (LONG_CASE_TIMEOUT, 900)
        } else {
            (CASE_TIMEOUT, 300)
        };
        let seconds = match std::env::var(variable) {
            Ok(v) => v
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|s| *s > 0)
                .unwrap_or_else(|| {
                    panic!(
                        "{variable}={v:?}: give the limit as a whole number of seconds, e.g. 600"
                    )
                }),
            Err(_) => default,
        };
        (Duration::from_secs(seconds), variable)
    }

    /// The mode a module of the suite is named after.
    pub fn mode(name: &str) -> ClaimMode {
        match name {
            "row_lock" => ClaimMode::RowLock,
            "lease" => ClaimMode::Lease,
            "advisory" => ClaimMode::Advisory,
            other => panic!("no claim mode is called {other}: use row_lock, lease or advisory"),
        }
    }
}
