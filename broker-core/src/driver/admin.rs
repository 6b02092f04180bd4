//! The operator statements a backend runs for [`Queue`](crate::Queue)'s counts, listings, job
//! control and pauses ([`AdminDriver`]), apart from the claim and settle paths: a backend
//! returns them from [`Backend::admin`](super::Backend::admin), borrowing its pool.

use std::future::Future;

use super::StatsCounts;
use crate::admin::{DeadLetters, JobInfo, JobState, Page, Pause, RowChange};
use crate::error::Result;
use crate::table::TableDescription;

/// What a backend runs for the operator API: counts by state, listings, dead-letter requeue
/// and discard, cancel, run-now, purge, the last error of a row and the pause flags of the
/// control table ([`CONTROL_TABLE`](super::CONTROL_TABLE)).
pub trait AdminDriver: Send + Sync {
    /// Counts `table`'s rows by state in one statement (one snapshot of the table and its
    /// dead-letter table), reading through the claim index and taking no lock a claim would
    /// wait for; see [`QueueStats`](crate::QueueStats) for what each state holds. Counts are
    /// exact up to [`EXACT_ROWS`](crate::admin::EXACT_ROWS) unfinished rows; past that a
    /// backend may estimate the states it cannot count through an index.
    fn stats(
        &self,
        table: &TableDescription,
        now_ms: i64,
    ) -> impl Future<Output = Result<StatsCounts>> + Send;

    /// The rows of `table` in `state`, by id, a page at a time. Of each row's `last_error` the
    /// statement reads `error_chars` + 1 characters at most (cut in SQL, so a long text never
    /// leaves the database whole), which [`JobInfo::with_last_error`] keeps `error_chars` of.
    /// `kind`: only rows whose kind column holds it, compared as bytes (the core passes one
    /// only for a table with a kind column).
    fn list(
        &self,
        table: &TableDescription,
        state: JobState,
        page: Page,
        error_chars: usize,
        kind: Option<&str>,
        now_ms: i64,
    ) -> impl Future<Output = Result<Vec<JobInfo>>> + Send;

    /// Puts dead letters back in the queue, due now with attempt 1 (out of the dead-letter
    /// table, or unmarked), in one transaction; returns how many. Running it again finds
    /// nothing left to move. The core refuses it for a table without a dead-letter target.
    fn requeue_dead(
        &self,
        table: &TableDescription,
        which: &DeadLetters,
        now_ms: i64,
    ) -> impl Future<Output = Result<u64>> + Send;

    /// Deletes dead letters for good; returns how many.
    fn discard_dead(
        &self,
        table: &TableDescription,
        which: &DeadLetters,
    ) -> impl Future<Output = Result<u64>> + Send;

    /// Deletes unfinished row `id` unless a delivery holds it, fenced as a settlement is: a
    /// claim that takes the row first makes this change nothing ([`RowChange::InWork`]), and
    /// the core then asks its holder to cancel it ([`request_cancel`](Self::request_cancel)).
    fn cancel(
        &self,
        table: &TableDescription,
        id: i64,
        now_ms: i64,
    ) -> impl Future<Output = Result<RowChange>> + Send;

    /// Makes unfinished row `id` due now (its due time becomes `now_ms`) unless a delivery
    /// holds it; [`RowChange::Unchanged`] when it is due already.
    fn run_now(
        &self,
        table: &TableDescription,
        id: i64,
        now_ms: i64,
    ) -> impl Future<Output = Result<RowChange>> + Send;

    /// Deletes acked rows whose `processed_at` is before `before_ms`; returns how many. The
    /// core refuses it for a table whose acks delete.
    fn purge_finished(
        &self,
        table: &TableDescription,
        before_ms: i64,
    ) -> impl Future<Output = Result<u64>> + Send;

    /// Writes a handler's error into row `id`'s `last_error` column (in the dead-letter table
    /// when `dead` and the table moves its dead letters), cut to
    /// [`LAST_ERROR_BYTES`](crate::admin::LAST_ERROR_BYTES). Only called for tables with one.
    fn record_error(
        &self,
        table: &TableDescription,
        id: i64,
        error: &str,
        dead: bool,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Pauses (`Some`) or resumes (`None`) the queue `table` in the control table
    /// ([`CONTROL_TABLE`](super::CONTROL_TABLE)); returns whether that changed anything
    /// (pausing a paused queue and resuming a running one change nothing).
    fn set_pause(
        &self,
        table: &str,
        pause: Option<&Pause>,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Whether the queue `table` is paused; `Ok(None)` when it is not, and an error when the
    /// control table is missing.
    fn pause_state(&self, table: &str) -> impl Future<Output = Result<Option<Pause>>> + Send;

    /// Whether the control table ([`CONTROL_TABLE`](super::CONTROL_TABLE)) exists.
    fn has_control_table(&self) -> impl Future<Output = Result<bool>> + Send;

    /// Records a cancel request for row `id` of the queue `table` in the cancel table
    /// ([`CANCEL_TABLE`](super::CANCEL_TABLE)); a request already there stays. Where the
    /// database can push, the same statement tells the table's subscriptions in other processes
    /// ([`Signal::Cancel`](super::Signal::Cancel), sent when it commits).
    fn request_cancel(
        &self,
        table: &str,
        id: i64,
        now_ms: i64,
    ) -> impl Future<Output = Result<()>> + Send;

    /// The rows of the queue `table` with a cancel request, read through the cancel table's
    /// key (the subscriptions run it once per poll interval).
    fn cancel_requests(&self, table: &str) -> impl Future<Output = Result<Vec<i64>>> + Send;

    /// Deletes the cancel request for row `id` of the queue `table`, if there is one.
    fn clear_cancel(&self, table: &str, id: i64) -> impl Future<Output = Result<()>> + Send;
}
