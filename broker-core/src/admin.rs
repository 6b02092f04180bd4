//! Operating a queue: what is in it ([`QueueStats`], [`JobInfo`]), and changing rows outside
//! the claim path (requeue dead letters, cancel, run now, purge, pause), each fenced like a
//! settlement so that a delivery in flight is never disturbed.
//!
//! Every operation here runs on the queue's own pool, takes no lock that a claim would wait
//! for, and changes nothing when it refuses.

use std::time::Duration;

use crate::claim_mode::ClaimMode;

/// How many rows of a state, and whether the figure is exact.
///
/// Counts are exact up to [`EXACT_ROWS`] unfinished rows in the table; past that, the states
/// that the claim index cannot count quickly are the planner's estimate (`exact` is false), so
/// that `stats()` stays cheap on a table with a large backlog.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Count {
    /// The number of rows.
    pub rows: u64,
    /// Whether it was counted (true) or estimated by the database's planner (false).
    pub exact: bool,
}

impl Count {
    /// An exact count.
    pub fn exact(rows: u64) -> Self {
        Self { rows, exact: true }
    }

    /// An estimate.
    pub fn estimate(rows: u64) -> Self {
        Self { rows, exact: false }
    }

    /// The sum of two counts, exact when both are.
    pub fn plus(self, other: Count) -> Self {
        Self {
            rows: self.rows.saturating_add(other.rows),
            exact: self.exact && other.exact,
        }
    }

    /// The sum of two optional counts: `None` when both are.
    fn plus_opt(a: Option<Count>, b: Option<Count>) -> Option<Count> {
        match (a, b) {
            (Some(a), Some(b)) => Some(a.plus(b)),
            (a, b) => a.or(b),
        }
    }
}

impl std::fmt::Display for Count {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.exact {
            write!(f, "{}", self.rows)
        } else {
            write!(f, "~{}", self.rows)
        }
    }
}

/// Unfinished rows up to which every count of [`QueueStats`] is exact.
pub const EXACT_ROWS: u64 = 100_000;

/// What a queue holds now, by state, read in one statement (one snapshot of the table and its
/// dead-letter table), so no row is counted twice or missed while deliveries run.
///
/// A row is in exactly one of `due`, `scheduled`, `in_work`, `dead` and `finished`;
/// `retrying` counts the unfinished rows whose attempt is above 1, whatever their state.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueStats {
    /// The table.
    pub table: String,
    /// Its claim mode.
    pub mode: ClaimMode,
    /// Unfinished rows that a claim could take now: due, and held by no delivery.
    pub due: Count,
    /// Unfinished rows due later (scheduled, or retried after a delay), held by no delivery.
    pub scheduled: Count,
    /// Rows a delivery holds now: a lease that has not run out (lease), an advisory key held by
    /// a session (advisory: one row per held key), a row locked by an open transaction (row
    /// lock; see the backend's docs for how exact each database can be).
    pub in_work: Count,
    /// Unfinished rows whose attempt is above 1 (they failed, or a crash spent an attempt).
    pub retrying: Count,
    /// Dead letters (in the dead-letter table, or marked); `None` without a dead-letter target.
    pub dead: Option<Count>,
    /// Acked rows kept with `processed_at`; `None` when an ack deletes the row.
    pub finished: Option<Count>,
    /// The due time (unix ms) of the oldest row that is due now and has a due time: how far
    /// behind the queue runs (see [`lag`](Self::lag)). `None` when no due row has one.
    pub oldest_due_ms: Option<i64>,
    /// The host's clock (unix ms) when the counts were read.
    pub read_at_ms: i64,
    /// Whether the queue is paused, since when and by whom.
    pub paused: Option<Pause>,
    /// The periodic schedules registered for this queue, by name (see
    /// [`ScheduleRow::next_tick_ms`](crate::ScheduleRow::next_tick_ms) for each one's next tick).
    pub schedules: Vec<crate::ScheduleRow>,
    /// The counts of each kind, on a table with a [kind column](crate::TableBuilder::kind),
    /// sorted by kind (rows without a kind first); empty for other tables. Read in the same
    /// statement as the totals, which are their sums (see [`KindStats`]).
    pub kinds: Vec<KindStats>,
}

/// The rows of one kind, by state (see [`QueueStats::kinds`]): each row of the table (and of
/// its dead-letter table) is in exactly one kind, so the states of every kind add up to the
/// queue's counts.
///
/// In advisory mode a held key counts one delivery in work for each kind that has due rows
/// under it (the database tells which keys are held, not which row the holder took), and the
/// rest of those rows as due: a kind's `due + in_work` is always its due rows.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KindStats {
    /// The kind, as the rows carry it; `None` for rows whose kind column is NULL (inserted by
    /// other software).
    pub kind: Option<String>,
    /// Unfinished rows of this kind a claim could take now.
    pub due: Count,
    /// Unfinished rows of this kind due later.
    pub scheduled: Count,
    /// Rows of this kind a delivery holds now.
    pub in_work: Count,
    /// Unfinished rows of this kind whose attempt is above 1.
    pub retrying: Count,
    /// Dead letters of this kind; `None` without a dead-letter target.
    pub dead: Option<Count>,
    /// Acked rows of this kind kept; `None` when an ack deletes the row.
    pub finished: Option<Count>,
}

impl KindStats {
    /// No rows of `kind` yet; backends add what they counted with [`add`](Self::add).
    pub fn new(kind: Option<String>) -> Self {
        Self {
            kind,
            due: Count::exact(0),
            scheduled: Count::exact(0),
            in_work: Count::exact(0),
            retrying: Count::exact(0),
            dead: None,
            finished: None,
        }
    }

    /// The unfinished rows of this kind: due, scheduled and in work.
    pub fn unfinished(&self) -> u64 {
        self.due.rows + self.scheduled.rows + self.in_work.rows
    }

    /// Adds `other`'s counts (of the same kind, or for a total) to these.
    pub fn add(&mut self, other: &KindStats) {
        self.due = self.due.plus(other.due);
        self.scheduled = self.scheduled.plus(other.scheduled);
        self.in_work = self.in_work.plus(other.in_work);
        self.retrying = self.retrying.plus(other.retrying);
        self.dead = Count::plus_opt(self.dead, other.dead);
        self.finished = Count::plus_opt(self.finished, other.finished);
    }
}

impl QueueStats {
    /// The queue's lag: how long the oldest due row has been waiting (its due time to the
    /// reading). Zero for an empty queue, `None` when the due rows have no due time (rows
    /// inserted with a NULL due time by hand).
    pub fn lag(&self) -> Option<Duration> {
        match self.oldest_due_ms {
            Some(due) => Some(Duration::from_millis(
                u64::try_from(self.read_at_ms.saturating_sub(due)).unwrap_or(0),
            )),
            None if self.due.rows == 0 => Some(Duration::ZERO),
            None => None,
        }
    }
}

/// A pause of a queue (see [`Queue::pause`](crate::Queue::pause)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pause {
    /// When it was paused (unix ms, the pausing host's clock).
    pub since_ms: i64,
    /// Who paused it, as the caller said.
    pub by: String,
}

/// The state of a row, for listing rows ([`Queue::jobs`](crate::Queue::jobs)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JobState {
    /// Due now and held by no delivery.
    Due,
    /// Due later.
    Scheduled,
    /// Held by a delivery now.
    InWork,
    /// Unfinished with an attempt above 1.
    Retrying,
    /// Dead-lettered.
    Dead,
    /// Acked and kept (`processed_at`).
    Finished,
}

impl JobState {
    /// Every state, in the order stats and listings show them.
    pub const ALL: [JobState; 6] = [
        JobState::Due,
        JobState::Scheduled,
        JobState::InWork,
        JobState::Retrying,
        JobState::Dead,
        JobState::Finished,
    ];

    /// The state's name as the CLI and the dashboard spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Due => "due",
            Self::Scheduled => "scheduled",
            Self::InWork => "in-work",
            Self::Retrying => "retrying",
            Self::Dead => "dead",
            Self::Finished => "finished",
        }
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for JobState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown state \"{s}\"; use one of: {}",
                    Self::ALL.map(JobState::as_str).join(", ")
                )
            })
    }
}

/// Payload text a listing returns at most, in bytes; longer payloads are cut (at a character
/// boundary) and marked [`JobInfo::payload_cut`].
pub const PAYLOAD_PREVIEW_BYTES: usize = 4096;

/// Error text a `last_error` column keeps at most, in bytes (cut at a character boundary).
pub const LAST_ERROR_BYTES: usize = 1000;

/// Characters of a row's `last_error` that a listing ([`Queue::jobs`](crate::Queue::jobs))
/// reads, as much as a listing shows: the database cuts the text (other software may have
/// written megabytes), and [`JobInfo::last_error_cut`] says it did.
pub const LAST_ERROR_PREVIEW_CHARS: usize = 160;

/// Characters of a row's `last_error` that the one-row read ([`Queue::job`](crate::Queue::job))
/// reads at most: all of what the broker writes ([`LAST_ERROR_BYTES`]), and a bounded prefix of
/// what other software wrote. The database cuts the text; [`JobInfo::last_error_cut`] says it
/// did.
pub const LAST_ERROR_READ_CHARS: usize = 16_384;

/// One row, as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobInfo {
    /// The row id.
    pub id: i64,
    /// The attempt column, which counts as the claim mode says: in lease and advisory modes
    /// the claim adds one, so a row in work on its first delivery (or acked and kept after
    /// it) reads 2 where that delivery's [`Job::attempt`](crate::Job::attempt) read 1; in row
    /// lock mode it moves only when the row is put back. See docs/operating.md.
    pub attempt: i64,
    /// The state the listing asked for.
    pub state: JobState,
    /// The due time (unix ms), if set.
    pub due_ms: Option<i64>,
    /// The lease expiry (unix ms), if set.
    pub locked_until_ms: Option<i64>,
    /// When the row was dead-lettered or acked (unix ms), where the table records it.
    pub finished_ms: Option<i64>,
    /// The advisory key, in advisory mode.
    pub key: Option<String>,
    /// The group, on a table with groups.
    pub group: Option<String>,
    /// The payload as text, cut to [`PAYLOAD_PREVIEW_BYTES`] (bytes payloads show as hex).
    pub payload: Option<String>,
    /// Whether the payload was cut.
    pub payload_cut: bool,
    /// The handler's last error, where the table has a `last_error` column, cut to
    /// [`LAST_ERROR_PREVIEW_CHARS`] in a listing and to [`LAST_ERROR_READ_CHARS`] in a one-row
    /// read.
    pub last_error: Option<String>,
    /// Whether the last error was cut.
    pub last_error_cut: bool,
    /// The row's kind, on a table with a [kind column](crate::TableBuilder::kind).
    pub kind: Option<String>,
}

impl JobInfo {
    /// A row with only its id, attempt and state; backends fill the rest.
    pub fn new(id: i64, attempt: i64, state: JobState) -> Self {
        Self {
            id,
            attempt,
            state,
            due_ms: None,
            locked_until_ms: None,
            finished_ms: None,
            key: None,
            group: None,
            payload: None,
            payload_cut: false,
            last_error: None,
            last_error_cut: false,
            kind: None,
        }
    }

    /// Sets the last error from a read of at most `chars` + 1 characters, keeping `chars` of
    /// them and saying whether there were more (backends read one character past what they keep,
    /// so that a text of exactly `chars` is not marked cut).
    pub fn with_last_error(mut self, text: Option<String>, chars: usize) -> Self {
        if let Some(mut t) = text {
            if let Some((end, _)) = t.char_indices().nth(chars) {
                t.truncate(end);
                self.last_error_cut = true;
            }
            self.last_error = Some(t);
        }
        self
    }

    /// Sets the payload preview, cutting it to [`PAYLOAD_PREVIEW_BYTES`].
    pub fn with_payload(mut self, text: Option<String>) -> Self {
        if let Some(mut t) = text {
            if t.len() > PAYLOAD_PREVIEW_BYTES {
                t.truncate(floor_char_boundary(&t, PAYLOAD_PREVIEW_BYTES));
                self.payload_cut = true;
            }
            self.payload = Some(t);
        }
        self
    }
}

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetters {
    /// These ids (at least one).
    Ids(Vec<i64>),
    /// Those whose last error contains this text (the table needs a `last_error` column).
    ErrorContains(String),
    /// All of them.
    All,
}

/// A page of a listing: rows with ids after `after` (none: from the first), at most `limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    /// Only rows with a larger id.
    pub after: Option<i64>,
    /// At most this many rows (1 to [`Page::MAX`]).
    pub limit: usize,
}

impl Page {
    /// The largest page.
    pub const MAX: usize = 1000;

    /// The first `limit` rows.
    pub fn first(limit: usize) -> Self {
        Self { after: None, limit }
    }

    /// The `limit` rows after id `after`.
    pub fn after(after: i64, limit: usize) -> Self {
        Self {
            after: Some(after),
            limit,
        }
    }
}

/// What a backend found when it tried to change one row (see the driver's admin calls).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RowChange {
    /// Changed.
    Done,
    /// Nothing to change: the row already is as asked (run now on a due row).
    Unchanged,
    /// No such row (or not in the state the operation needs).
    NotFound,
    /// A delivery holds the row; what holds it.
    InWork(String),
}

/// What [`Queue::cancel`](crate::Queue::cancel) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cancelled {
    /// No delivery held the row: it was deleted.
    Removed,
    /// A delivery held the row: the request was recorded and its holder signalled. The holder
    /// raises the handler's cancel signal, waits the subscription's grace, and deletes the row
    /// (see docs/timeouts-and-cancelling.md, "Cancelling a running job").
    Signalled,
}

/// `s` cut to at most `max` bytes at a character boundary.
pub(crate) fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut i = max;
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// An error text cut to [`LAST_ERROR_BYTES`].
pub fn last_error_text(error: &str) -> &str {
    &error[..floor_char_boundary(error, LAST_ERROR_BYTES)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_cut_at_a_character_boundary() {
        let s = "é".repeat(600); // 1,200 bytes
        let cut = last_error_text(&s);
        assert!(cut.len() <= LAST_ERROR_BYTES);
        assert_eq!(cut.len(), 1000);
        let info = JobInfo::new(1, 1, JobState::Due).with_payload(Some("ü".repeat(3000)));
        assert!(info.payload_cut);
        assert!(info.payload.unwrap().len() <= PAYLOAD_PREVIEW_BYTES);
        let info = JobInfo::new(1, 1, JobState::Due).with_last_error(Some("ü".repeat(5)), 4);
        assert_eq!(
            (info.last_error.as_deref(), info.last_error_cut),
            (Some("üüüü"), true)
        );
        let info = JobInfo::new(1, 1, JobState::Due).with_last_error(Some("ü".repeat(4)), 4);
        assert_eq!(
            (info.last_error.as_deref(), info.last_error_cut),
            (Some("üüüü"), false)
        );
    }

    #[test]
    fn states_parse_from_their_names_and_unknown_ones_are_named() {
        for st in JobState::ALL {
            assert_eq!(st.as_str().parse::<JobState>().unwrap(), st);
        }
        let e = "doing".parse::<JobState>().unwrap_err();
        assert!(e.contains("doing") && e.contains("in-work"), "{e}");
    }

    #[test]
    fn the_lag_is_the_age_of_the_oldest_due_row() {
        let mut s = QueueStats {
            table: "t".into(),
            mode: ClaimMode::Lease,
            due: Count::exact(3),
            scheduled: Count::default(),
            in_work: Count::default(),
            retrying: Count::default(),
            dead: None,
            finished: None,
            oldest_due_ms: Some(1_000),
            read_at_ms: 4_500,
            paused: None,
            schedules: Vec::new(),
            kinds: Vec::new(),
        };
        assert_eq!(s.lag(), Some(Duration::from_millis(3_500)));
        s.oldest_due_ms = None;
        assert_eq!(s.lag(), None);
        s.due = Count::exact(0);
        assert_eq!(s.lag(), Some(Duration::ZERO));
    }
}
