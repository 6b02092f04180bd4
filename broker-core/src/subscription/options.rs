//! How a subscription runs: the options a user sets, and the checks that refuse values the
//! engine cannot run with.

use std::time::Duration;

use crate::error::SqlxBrokerError;

/// The shortest [`SubscribeOptions::poll_interval`] accepted: an idle subscription claims at
/// most 20 times a second.
pub const MIN_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The default [`SubscribeOptions::poll_cooldown`]: a busy subscription that drained its table
/// looks again after 25 ms.
pub const DEFAULT_POLL_COOLDOWN: Duration = Duration::from_millis(25);

/// The default [`SubscribeOptions::cancel_grace`]: a timed-out handler has 5 s to return after
/// its cancel signal before its future is dropped.
pub const DEFAULT_CANCEL_GRACE: Duration = Duration::from_secs(5);

/// How a subscription runs.
#[derive(Debug, Clone)]
#[must_use]
pub struct SubscribeOptions {
    pub(super) name: String,
    pub(super) concurrency: usize,
    pub(super) batch_size: Option<usize>,
    pub(super) poll_interval: Duration,
    pub(super) poll_cooldown: Duration,
    pub(super) shutdown_timeout: Duration,
    pub(super) error_backoff: Duration,
    pub(super) error_backoff_max: Duration,
    /// Whether `error_backoff` was set (the default's 1 s applies quietly).
    pub(super) error_backoff_set: bool,
    pub(super) max_claims_in_flight: Option<usize>,
    pub(super) timeout: Option<Duration>,
    pub(super) cancel_grace: Duration,
    pub(super) max_snoozes: Option<u32>,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        Self {
            name: "subscription".into(),
            concurrency: 1,
            batch_size: None,
            poll_interval: Duration::from_secs(1),
            poll_cooldown: DEFAULT_POLL_COOLDOWN,
            shutdown_timeout: Duration::from_secs(30),
            error_backoff: Duration::from_secs(1),
            error_backoff_max: Duration::from_secs(300),
            error_backoff_set: false,
            max_claims_in_flight: None,
            timeout: None,
            cancel_grace: DEFAULT_CANCEL_GRACE,
            max_snoozes: None,
        }
    }
}

impl SubscribeOptions {
    /// The defaults: 1 delivery in work, batches as large as the concurrency, a 1 s poll, a 30 s
    /// shutdown deadline, and an error backoff of 1 s doubling to 5 min.
    pub fn new() -> Self {
        Self::default()
    }
    /// A name for logs and spans.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
    /// How many handlers may run at once (at least 1; 0 is refused at subscribe).
    ///
    /// In lease mode without FIFO groups a delivery settles after its handler gives its slot
    /// back, beside the next handler, so acks that finish close together can share a
    /// statement; the rows the subscription holds stay bounded all the same (a claim waits
    /// until rows held by settlements still running fit beside the slots). In the other modes
    /// a slot is held until its row is settled.
    ///
    /// In row lock mode, and in advisory mode where keys are held on connections (PostgreSQL,
    /// MySQL), every delivery in work holds a pool connection: a concurrency beyond what the
    /// pool can serve is lowered at subscribe to three quarters of the pool (with a warning),
    /// so the rest of the pool stays free for claims, publishes and settlements.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }
    /// The most rows one claim asks for (at least 1; default: the concurrency).
    ///
    /// - Lease mode prefetches: a claim asks for a whole batch once that many rows fit beside
    ///   the deliveries in work and two batches of waiting rows (or as many rows as the
    ///   concurrency, if that is more), so the next batch is claimed while the last still feeds
    ///   the slots, and up to `max(2 * batch_size, concurrency)` claimed rows may wait in the
    ///   subscription for a free slot. Their leases are renewed while they wait; at
    ///   shutdown they are started like the rest within the deadline. A larger batch means
    ///   fewer claim statements per row but more rows held by this process: with slow handlers
    ///   and several processes, keep it near the concurrency. FIFO tables do not prefetch (a
    ///   claim made while a group's head is in work finds nothing in that group).
    /// - Advisory mode locks and takes one key after another, and each held key holds a
    ///   connection on PostgreSQL and MySQL, so it runs one single-row claim per free slot side
    ///   by side instead; they share candidate reads (a read returns a few times more rows than
    ///   it needs, kept briefly for the next claims).
    /// - Row lock mode claims one row per transaction, so its claims run side by side too.
    ///
    /// 0 is refused at subscribe.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = Some(n);
        self
    }
    /// How long an idle subscription waits before it looks again when nothing wakes it (at
    /// least [`MIN_POLL_INTERVAL`]; shorter is refused at subscribe, since an idle subscription
    /// would then keep a core and the database busy with empty claims). Each wait for the next
    /// look (the poll interval, the cooldown, a claim backoff) is spread at random by up to a
    /// tenth either way, so subscriptions started or drained together drift apart instead of
    /// taking connections out of a shared pool at the same moments; on average an idle
    /// subscription still looks once per poll interval.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }
    /// How soon a subscription looks again after it drained the table, while its claims keep
    /// finding rows (default [`DEFAULT_POLL_COOLDOWN`]). Rows that arrive without a wake-up
    /// (inserted by plain SQL, a trigger or another service; on MySQL, MariaDB and SQLite also
    /// those another process publishes) are then found within about this long instead of at
    /// the next poll. The wait grows with the time since a claim last found rows, up to the
    /// poll interval, so a subscription whose table stays empty looks once per poll interval,
    /// as before. Zero is refused at subscribe.
    pub fn poll_cooldown(mut self, cooldown: Duration) -> Self {
        self.poll_cooldown = cooldown;
        self
    }
    /// How long a shutdown may take (30 s by default): it returns within this whatever the
    /// database does. Handlers in work (and claims and settlements in flight) get all of it but
    /// the last second (the last half, when it is shorter than 2 s); what still runs then is
    /// dropped, and the rows of dropped deliveries are given back (lease released, key
    /// unlocked, transaction rolled back) in the time kept for that. `Duration::MAX` waits for
    /// every handler.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }
    /// The delay before retrying a row whose handler failed or panicked: `base` doubled per
    /// attempt, at most `max`. Zero retries at once. Needs a due-time column; without one,
    /// failed rows are retried at once, and a base set here shows as a warning in
    /// [`Subscription::health`](super::Subscription::health) (and on stderr once, while no
    /// `tracing` subscriber is installed). A base above its maximum is refused at subscribe.
    /// Rows whose settlement failed back off by it too, with or without a due-time column (see
    /// the crate docs).
    pub fn error_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.error_backoff = base;
        self.error_backoff_max = max;
        self.error_backoff_set = true;
        self
    }
    /// How many claims may run at once (default: enough to fill every slot, `concurrency /
    /// batch_size` rounded up; in row lock and advisory modes, where each claim takes one row,
    /// `concurrency`). 0 is refused at subscribe. Every claim in flight uses a pool connection,
    /// so it is lowered to half the pool (with a warning) where it would ask for more.
    pub fn max_claims_in_flight(mut self, n: usize) -> Self {
        self.max_claims_in_flight = Some(n);
        self
    }
    /// How long a handler may run (none by default: a handler may run as long as it likes).
    /// When the timeout passes, the job's cancel signal is raised
    /// ([`Job::cancelled`](crate::Job::cancelled)); a handler still running after
    /// [`cancel_grace`](Self::cancel_grace) more is dropped. Either way the delivery counts as a
    /// failed attempt: the row is retried after the [`error_backoff`](Self::error_backoff) (or
    /// dead-lettered when its attempts are spent), its `last_error` reads `timed out after
    /// <timeout>`, the lease stops being renewed, and a row lock transaction rolls back with
    /// the handler's writes. The handler's future is dropped before the row is given back, so
    /// the row's next delivery never overlaps it. Zero is refused at subscribe. See
    /// docs/timeouts-and-cancelling.md.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// How long a handler whose timeout passed may take to return after its cancel signal
    /// before its future is dropped ([`DEFAULT_CANCEL_GRACE`] by default; zero drops it at
    /// once). What it returns within the grace does not change the outcome: the delivery timed
    /// out.
    pub fn cancel_grace(mut self, grace: Duration) -> Self {
        self.cancel_grace = grace;
        self
    }

    /// How many times a row may be snoozed ([`Outcome::Snooze`](crate::Outcome::Snooze)): a
    /// snooze of a row already snoozed `n` times dead-letters it instead (as a row whose
    /// attempts are spent is, with the error "snoozed n times" in a `last_error` column where
    /// the table has one). Unset: no cap. Needs the table's snooze counter column
    /// ([`TableBuilder::snoozes`](crate::TableBuilder::snoozes)), a due-time column and a
    /// dead-letter target; a table without them is refused at subscribe.
    pub fn max_snoozes(mut self, n: u32) -> Self {
        self.max_snoozes = Some(n);
        self
    }

    /// Refuses options that `table` cannot serve, naming the option and what to change.
    pub(super) fn check_table(&self, table: &crate::table::TableDescription) -> crate::Result<()> {
        let Some(max) = self.max_snoozes else {
            return Ok(());
        };
        let refuse = |accepted, why| {
            Err(SqlxBrokerError::InvalidOption {
                table: table.name().to_owned(),
                option: "max_snoozes",
                value: max.to_string(),
                accepted,
                why,
            })
        };
        if table.snoozes().is_none() {
            return refuse(
                "a cap on a table with a snooze counter column: add .snoozes(\"snoozes\") to the table description and the column to the table (the DDL helper creates it as an integer starting at 0), or leave max_snoozes unset",
                "the table has no snooze counter column, so the subscription cannot count a row's snoozes",
            );
        }
        if table.due_at().is_none() {
            return refuse(
                "a cap on a table with a due-time column: add .due_at(\"..\") to the table description",
                "a snooze makes the row due later, and the table has no due-time column",
            );
        }
        if table.dead_letter().is_none() {
            return refuse(
                "a cap on a table with a dead-letter target: add .dead_letter(..) to the table description",
                "a row snoozed past the cap is dead-lettered, and the table has no dead-letter target",
            );
        }
        Ok(())
    }

    /// Refuses values the engine cannot run with, naming the option and what is accepted.
    pub(super) fn check(&self, table: &str) -> crate::Result<()> {
        let refuse = |option, value: String, accepted, why| {
            Err(SqlxBrokerError::InvalidOption {
                table: table.to_owned(),
                option,
                value,
                accepted,
                why,
            })
        };
        if self.concurrency == 0 {
            return refuse(
                "concurrency",
                "0".into(),
                "1 or more",
                "a subscription with no delivery slot would never run a handler",
            );
        }
        if self.batch_size == Some(0) {
            return refuse(
                "batch_size",
                "0".into(),
                "1 or more (or leave it unset for the concurrency)",
                "a claim for no rows would never take one",
            );
        }
        if self.max_claims_in_flight == Some(0) {
            return refuse(
                "max_claims_in_flight",
                "0".into(),
                "1 or more (or leave it unset)",
                "with no claim allowed the subscription would never take a row",
            );
        }
        if self.poll_interval < MIN_POLL_INTERVAL {
            return refuse(
                "poll_interval",
                format!("{:?}", self.poll_interval),
                "50ms or more",
                "an idle subscription would keep a core and the database busy with empty claims",
            );
        }
        if self.poll_cooldown.is_zero() {
            return refuse(
                "poll_cooldown",
                "0s".into(),
                "1ms or more",
                "a subscription would claim in a loop while rows trickle in",
            );
        }
        if self.timeout == Some(Duration::ZERO) {
            return refuse(
                "timeout",
                "0s".into(),
                "1ms or more (or leave it unset for no timeout)",
                "every handler would time out before it started",
            );
        }
        if self.error_backoff > self.error_backoff_max {
            return refuse(
                "error_backoff",
                format!(
                    "{:?} up to {:?}",
                    self.error_backoff, self.error_backoff_max
                ),
                "a base no larger than its maximum",
                "the base delay would be cut to the maximum at once",
            );
        }
        Ok(())
    }

    /// What the options ask of `table` that it cannot do, one sentence each with the fix.
    pub(super) fn warnings(&self, table: &crate::table::TableDescription) -> Vec<String> {
        let mut out = Vec::new();
        if self.error_backoff_set && !self.error_backoff.is_zero() && table.due_at().is_none() {
            out.push(format!(
                "error_backoff is set to {:?}, but the table has no due-time column, so a failed handler's row is retried at once; add .due_at(\"..\") to the table description to delay retries",
                self.error_backoff
            ));
        }
        out
    }

    /// The delay before a row's next attempt after `attempt` failed (see
    /// [`error_backoff`](Self::error_backoff)).
    pub(super) fn backoff(&self, attempt: i64) -> Duration {
        if self.error_backoff.is_zero() {
            return Duration::ZERO;
        }
        let doublings = u32::try_from(attempt.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
        self.error_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.error_backoff_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_timeout_is_refused_naming_the_option() {
        let e = SubscribeOptions::new()
            .timeout(Duration::ZERO)
            .check("jobs")
            .unwrap_err()
            .to_string();
        assert!(e.contains("timeout") && e.contains("1ms or more"), "{e}");
    }

    #[test]
    fn a_zero_poll_cooldown_is_refused() {
        let e = SubscribeOptions::new()
            .poll_cooldown(Duration::ZERO)
            .check("jobs")
            .unwrap_err()
            .to_string();
        assert!(e.contains("poll_cooldown"), "{e}");
    }

    #[test]
    fn a_failed_row_backs_off_doubling_per_attempt_up_to_the_maximum() {
        let options =
            SubscribeOptions::new().error_backoff(Duration::from_secs(1), Duration::from_secs(10));
        let waits: Vec<u64> = (1..=6).map(|a| options.backoff(a).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 10, 10]);
        assert_eq!(
            options.backoff(0),
            Duration::from_secs(1),
            "attempt 0 waits the base"
        );
    }

    #[test]
    fn a_zero_error_backoff_retries_at_once() {
        let options = SubscribeOptions::new().error_backoff(Duration::ZERO, Duration::ZERO);
        assert_eq!(options.backoff(7), Duration::ZERO);
    }
}
