//! Periodic schedules: a cron expression in a time zone that publishes one job to a queue per
//! tick, however many processes run it.
//!
//! Every process that runs a schedule wakes at each tick and tries to publish it, in one
//! transaction that first records the tick in [`TICKS_TABLE`] (keyed by the schedule's name and
//! the tick's time). The database lets exactly one transaction record a tick: the others find
//! it recorded and publish nothing. So the tick's job lands once whether one process or ten run
//! the schedule, and whether or not its job has already been acked (a unique key alone frees
//! once its row finishes, so it could not tell a late process that the tick was done).
//!
//! Ticks while no process ran the schedule are *missed*; so is a tick that a running process
//! reaches more than [`Schedule::max_lateness`] after its time (the process stalled).
//! [`Missed::Skip`] (the default) publishes none of them; [`Missed::RunLatest`] publishes the
//! latest missed tick once (at start, only when a tick was published before: a new schedule
//! has missed nothing).

use std::str::FromStr as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, TimeZone as _, Utc};
use tokio::sync::{broadcast, watch};

use crate::driver::{Backend, clock};
use crate::error::{Result, SqlxBrokerError};
use crate::mode::QueueInner;
use crate::publish::NewJob;

/// The table of registered schedules (one row per schedule name: its queue, cron expression,
/// time zone and latest published tick), shared by every queue of a database; the DDL helper
/// creates it beside each queue table.
pub const SCHEDULES_TABLE: &str = "sqlx_broker_schedules";

/// The table of published ticks (schedule name, tick time in unix ms): its primary key is what
/// makes one tick publish once across processes. Ticks more than a day older than the latest
/// are deleted as new ones are recorded.
pub const TICKS_TABLE: &str = "sqlx_broker_ticks";

/// The longest schedule name, in characters (the name is part of the tick table's key).
pub const MAX_SCHEDULE_NAME_CHARS: usize = 200;

/// How long a recorded tick is kept: a process never tries a tick this old (its lateness is
/// capped far below), so a tick deleted after a day cannot be published again.
pub(crate) const TICK_KEPT_MS: i64 = 86_400_000;

/// The default [`Schedule::max_lateness`].
pub const DEFAULT_MAX_LATENESS: Duration = Duration::from_secs(60);

/// The largest [`Schedule::max_lateness`]: an hour, far below how long a tick is kept (a day).
pub const MAX_LATENESS_CAP: Duration = Duration::from_secs(3600);

/// What a schedule does with missed ticks: ticks that passed while no process ran the
/// schedule, and ticks a running process reached more than [`Schedule::max_lateness`] late.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Missed {
    /// Publish no missed tick (the default).
    #[default]
    Skip,
    /// Publish the latest missed tick once, then go on with the ticks to come.
    RunLatest,
}

/// A periodic schedule: a name, a cron expression and a time zone.
///
/// Expressions are parsed by the `croner` crate: five fields (minute, hour, day of month,
/// month, day of week) or six with seconds first, ranges, steps, lists, `L`, `W`, `#` and
/// nicknames such as `@hourly`. Daylight-saving transitions follow croner (the Open Cron
/// Pattern Specification): in a gap, a fixed-time job (`30 2 * * *`) runs at the first valid
/// time after it and interval jobs skip the missing ticks; in an overlap, a fixed-time job runs
/// once (at the first pass) and interval jobs run in both passes.
///
/// ```
/// use broker_core::{Missed, Schedule};
/// let nightly = Schedule::new("nightly-report", "0 3 * * *")?
///     .time_zone("Europe/Paris")?
///     .missed(Missed::RunLatest);
/// assert_eq!(nightly.name(), "nightly-report");
/// assert!(Schedule::new("bad", "61 * * * *").is_err());
/// # Ok::<(), broker_core::SqlxBrokerError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Schedule {
    name: String,
    expression: String,
    cron: croner::Cron,
    tz: chrono_tz::Tz,
    missed: Missed,
    max_lateness: Duration,
}

fn schedule_error(name: &str, message: impl Into<String>) -> SqlxBrokerError {
    SqlxBrokerError::Schedule {
        schedule: name.to_owned(),
        message: message.into(),
    }
}

impl Schedule {
    /// A schedule called `name` (unique per database, at most [`MAX_SCHEDULE_NAME_CHARS`]
    /// characters) that ticks on the cron `expression`, in UTC.
    ///
    /// # Errors
    /// [`SqlxBrokerError::Schedule`] for an empty or too long name, or an expression croner
    /// cannot parse (the message quotes croner's reason).
    pub fn new(name: impl Into<String>, expression: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let expression = expression.into();
        let chars = name.chars().count();
        if name.trim().is_empty() || chars > MAX_SCHEDULE_NAME_CHARS || name.contains('\0') {
            return Err(schedule_error(
                &name,
                format!(
                    "the name is {chars} characters long; a schedule name holds 1 to {MAX_SCHEDULE_NAME_CHARS} characters and no NUL"
                ),
            ));
        }
        let cron = croner::Cron::from_str(&expression).map_err(|e| {
            schedule_error(
                &name,
                format!(
                    "the cron expression \"{expression}\" is invalid: {e}; write five fields (minute hour day-of-month month day-of-week) or six with seconds first, e.g. \"0 3 * * *\""
                ),
            )
        })?;
        Ok(Self {
            name,
            expression,
            cron,
            tz: chrono_tz::UTC,
            missed: Missed::Skip,
            max_lateness: DEFAULT_MAX_LATENESS,
        })
    }

    /// The time zone the expression reads its fields in, by its IANA name (`"Europe/Paris"`,
    /// `"UTC"`).
    ///
    /// # Errors
    /// [`SqlxBrokerError::Schedule`] for a name not in the IANA database.
    pub fn time_zone(mut self, zone: &str) -> Result<Self> {
        self.tz = zone.parse().map_err(|_| {
            schedule_error(
                &self.name,
                format!(
                    "the time zone \"{zone}\" is unknown; use an IANA name such as \"UTC\" or \"Europe/Paris\""
                ),
            )
        })?;
        Ok(self)
    }

    /// What to do with missed ticks (default [`Missed::Skip`]).
    pub fn missed(mut self, missed: Missed) -> Self {
        self.missed = missed;
        self
    }

    /// How late a running process may publish a tick (default [`DEFAULT_MAX_LATENESS`],
    /// between 1 s and [`MAX_LATENESS_CAP`]): a tick the process reaches later than this counts
    /// as missed.
    pub fn max_lateness(mut self, lateness: Duration) -> Self {
        self.max_lateness = lateness.clamp(Duration::from_secs(1), MAX_LATENESS_CAP);
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The cron expression as written.
    pub fn expression(&self) -> &str {
        &self.expression
    }
    /// The time zone's IANA name.
    pub fn zone_name(&self) -> &str {
        self.tz.name()
    }
    /// The missed-ticks policy.
    pub fn missed_policy(&self) -> Missed {
        self.missed
    }

    fn at(&self, ms: i64) -> Option<DateTime<chrono_tz::Tz>> {
        Some(
            Utc.timestamp_millis_opt(ms)
                .single()?
                .with_timezone(&self.tz),
        )
    }

    /// The first tick strictly after `ms` (unix milliseconds), if the expression has one.
    pub fn next_after(&self, ms: i64) -> Option<i64> {
        let t = self.cron.find_next_occurrence(&self.at(ms)?, false).ok()?;
        Some(t.timestamp_millis())
    }

    /// The latest tick at or before `ms` (unix milliseconds), if the expression has one.
    pub fn latest_at_or_before(&self, ms: i64) -> Option<i64> {
        let t = self
            .cron
            .find_previous_occurrence(&self.at(ms)?, true)
            .ok()?;
        Some(t.timestamp_millis())
    }
}

/// A registered schedule as [`SCHEDULES_TABLE`] holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScheduleRow {
    /// The schedule's name.
    pub name: String,
    /// The queue (table) its ticks publish to.
    pub queue: String,
    /// The cron expression.
    pub expression: String,
    /// The time zone's IANA name.
    pub time_zone: String,
    /// The latest tick published (unix ms), if any.
    pub last_tick_ms: Option<i64>,
}

impl ScheduleRow {
    /// A row from its parts.
    pub fn new(
        name: String,
        queue: String,
        expression: String,
        time_zone: String,
        last_tick_ms: Option<i64>,
    ) -> Self {
        Self {
            name,
            queue,
            expression,
            time_zone,
            last_tick_ms,
        }
    }

    /// The tick after `now_ms`, worked out from the stored expression and time zone; `None`
    /// when they no longer parse or the expression has no later tick.
    pub fn next_tick_ms(&self, now_ms: i64) -> Option<i64> {
        Schedule::new(&self.name, &self.expression)
            .ok()?
            .time_zone(&self.time_zone)
            .ok()?
            .next_after(now_ms)
    }
}

/// What one process did with one tick, as [`Scheduled::ticks`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tick {
    /// The tick's time, unix milliseconds.
    pub at_ms: i64,
    /// The row this process published for it; `None` when another process had published it.
    pub published: Option<i64>,
}

/// A schedule running in this process (see [`Queue::schedule`](crate::Queue::schedule)).
/// Dropping it stops the schedule after the tick in progress, as [`stop`](Self::stop) does
/// without waiting; closing the broker stops it too.
#[derive(Debug)]
pub struct Scheduled {
    name: String,
    stop: watch::Sender<bool>,
    events: broadcast::Sender<Tick>,
    /// Subscribed before the loop started, for the first call of [`ticks`](Self::ticks).
    first: std::sync::Mutex<Option<broadcast::Receiver<Tick>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Scheduled {
    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What this process does with each tick (a tick it published, or found published), for
    /// tests and logs: the first call sees every tick since the schedule started, later calls
    /// the ticks from then on. A slow receiver loses the oldest events first (1024 are kept).
    pub fn ticks(&self) -> broadcast::Receiver<Tick> {
        let first = self.first.lock().unwrap_or_else(|p| p.into_inner()).take();
        first.unwrap_or_else(|| self.events.subscribe())
    }

    /// Stops the schedule and waits for the tick in progress to finish.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Scheduled {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// Registers `schedule` for the queue and starts its loop.
pub(crate) async fn start<B, P, F>(
    queue: Arc<QueueInner<B>>,
    schedule: Schedule,
    job: F,
) -> Result<Scheduled>
where
    B: Backend,
    P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync + 'static,
    F: Fn(SystemTime) -> NewJob<P> + Send + Sync + 'static,
{
    let shared = &queue.shared;
    let table = shared.table.name().to_owned();
    let wanted = ScheduleRow::new(
        schedule.name.clone(),
        table.clone(),
        schedule.expression.clone(),
        schedule.zone_name().to_owned(),
        None,
    );
    let stored = shared.broker.backend.register_schedule(&wanted).await?;
    if (&stored.queue, &stored.expression, &stored.time_zone)
        != (&wanted.queue, &wanted.expression, &wanted.time_zone)
    {
        return Err(schedule_error(
            &schedule.name,
            format!(
                "the name is registered already with \"{}\" in {} for table \"{}\", not \"{}\" in {} for table \"{}\"; give this schedule another name, or delete the old one's row from {SCHEDULES_TABLE} once no process runs it",
                stored.expression,
                stored.time_zone,
                stored.queue,
                wanted.expression,
                wanted.time_zone,
                wanted.queue
            ),
        ));
    }
    let (stop, stop_rx) = watch::channel(false);
    let (events, first) = broadcast::channel(1024);
    let runner = Runner {
        stop: stop_rx.clone(),
        queue: queue.clone(),
        schedule,
        job,
        events: events.clone(),
        _p: std::marker::PhantomData,
    };
    let name = runner.schedule.name.clone();
    let task = tokio::spawn(runner.run(stored.last_tick_ms, stop_rx));
    Ok(Scheduled {
        name,
        stop,
        events,
        first: std::sync::Mutex::new(Some(first)),
        task: Some(task),
    })
}

struct Runner<B: Backend, P, F> {
    /// Set when the handle drops or stops; an attempt that failed does not run again then.
    stop: watch::Receiver<bool>,
    queue: Arc<QueueInner<B>>,
    schedule: Schedule,
    job: F,
    events: broadcast::Sender<Tick>,
    _p: std::marker::PhantomData<fn() -> P>,
}

impl<B, P, F> Runner<B, P, F>
where
    B: Backend,
    P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync + 'static,
    F: Fn(SystemTime) -> NewJob<P> + Send + Sync + 'static,
{
    async fn run(self, last_published: Option<i64>, mut stop: watch::Receiver<bool>) {
        let mut shutdown = self.queue.shared.broker.shutdown.subscribe();
        let stopped = |stop: &watch::Receiver<bool>, shutdown: &watch::Receiver<bool>| {
            *stop.borrow() || *shutdown.borrow()
        };
        let lateness = i64::try_from(self.schedule.max_lateness.as_millis()).unwrap_or(i64::MAX);
        let mut cursor = clock::now_ms();
        // Every tick up to now passed while this process did not run the schedule.
        if self.schedule.missed == Missed::RunLatest
            && let Some(last) = last_published
            && let Some(latest) = self.schedule.latest_at_or_before(cursor)
            && latest > last
        {
            self.attempt(latest).await;
        }
        loop {
            let Some(next) = self.schedule.next_after(cursor) else {
                tracing::info!(schedule = %self.schedule.name, "the schedule has no tick to come; it stops");
                return;
            };
            let wait = u64::try_from(next.saturating_sub(clock::now_ms())).unwrap_or(0);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
                _ = stop.wait_for(|s| *s) => return,
                _ = shutdown.wait_for(|s| *s) => return,
            }
            if stopped(&stop, &shutdown) {
                return;
            }
            let now = clock::now_ms();
            if now < next {
                // Woke early (a coarse timer): sleep again without moving the cursor.
                continue;
            }
            // Ticks older than this were missed: the process stalled past its lateness.
            let edge = now.saturating_sub(lateness);
            if self.schedule.missed == Missed::RunLatest
                && let Some(latest) = self.schedule.latest_at_or_before(edge.saturating_sub(1))
                && latest > cursor
            {
                self.attempt(latest).await;
            }
            let mut tick = self.schedule.next_after(cursor.max(edge.saturating_sub(1)));
            while let Some(t) = tick.filter(|t| *t <= now) {
                if stopped(&stop, &shutdown) {
                    return;
                }
                self.attempt(t).await;
                tick = self.schedule.next_after(t);
            }
            cursor = now;
        }
    }

    /// Publishes tick `at` unless another process did; retries a failed attempt while the tick
    /// is within the lateness.
    async fn attempt(&self, at: i64) {
        let lateness = i64::try_from(self.schedule.max_lateness.as_millis()).unwrap_or(i64::MAX);
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.publish_tick(at).await {
                Ok(published) => {
                    tracing::debug!(schedule = %self.schedule.name, tick_ms = at, ?published, "tick");
                    let _ = self.events.send(Tick {
                        at_ms: at,
                        published,
                    });
                    return;
                }
                Err(e)
                    if clock::now_ms().saturating_sub(at) < lateness
                        && !*self.stop.borrow()
                        && !*self.queue.shared.broker.shutdown.borrow() =>
                {
                    tracing::warn!(schedule = %self.schedule.name, tick_ms = at, error = %e, "publishing a tick failed; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::error!(schedule = %self.schedule.name, tick_ms = at, error = %e, "publishing a tick failed past its lateness; the tick is missed in this process");
                    return;
                }
            }
        }
    }

    async fn publish_tick(&self, at: i64) -> Result<Option<i64>> {
        let shared = &self.queue.shared;
        let backend = &shared.broker.backend;
        let table = &shared.table;
        let err = |e| SqlxBrokerError::statement(table.name(), "publish a tick", e);
        let mut tx = backend.pool().begin().await.map_err(err)?;
        let recorded = backend
            .record_tick(
                &mut tx,
                &self.schedule.name,
                at,
                at.saturating_sub(TICK_KEPT_MS),
            )
            .await?;
        if !recorded {
            // Dropping the transaction rolls it back.
            return Ok(None);
        }
        let time =
            SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(at).unwrap_or_default());
        let mut job = (self.job)(time);
        if table.unique_key().is_some() && job.unique_key_value().is_none() {
            job = job.unique_key(format!("{}@{at}", self.schedule.name));
        }
        let id = if job.unique_key_value().is_some() {
            backend.publish_unique(&mut tx, table, &job).await?.id
        } else {
            let ids = backend
                .publish(&mut tx, table, std::slice::from_ref(&job))
                .await?;
            ids.first().copied().unwrap_or_default()
        };
        tx.commit().await.map_err(err)?;
        shared.broker.wake(table.name());
        Ok(Some(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix ms of a UTC date and time.
    fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> i64 {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, 0)
            .single()
            .unwrap()
            .timestamp_millis()
    }

    #[test]
    fn ticks_follow_the_expression_in_its_time_zone() {
        let s = Schedule::new("n", "0 3 * * *")
            .unwrap()
            .time_zone("Europe/Paris")
            .unwrap();
        // 03:00 in Paris in January is 02:00 UTC.
        let next = s.next_after(utc(2026, 1, 10, 12, 0)).unwrap();
        assert_eq!(next, utc(2026, 1, 11, 2, 0));
        assert_eq!(s.latest_at_or_before(next), Some(next));
        assert_eq!(
            s.latest_at_or_before(next - 1),
            Some(utc(2026, 1, 10, 2, 0))
        );
        assert_eq!(s.next_after(next), Some(utc(2026, 1, 12, 2, 0)));
    }

    #[test]
    fn a_fixed_time_in_the_spring_gap_runs_right_after_it_and_once_in_the_autumn_overlap() {
        // Paris skips 02:00-03:00 on 2026-03-29 and repeats 02:00-03:00 on 2026-10-25.
        let s = Schedule::new("n", "30 2 * * *")
            .unwrap()
            .time_zone("Europe/Paris")
            .unwrap();
        let spring = s.next_after(utc(2026, 3, 28, 12, 0)).unwrap();
        // 02:30 does not exist; the first valid time after the gap is 03:00 CEST = 01:00 UTC.
        assert_eq!(spring, utc(2026, 3, 29, 1, 0));
        let autumn = s.next_after(utc(2026, 10, 24, 12, 0)).unwrap();
        // The first 02:30 (CEST, 00:30 UTC), and not the second (CET, 01:30 UTC).
        assert_eq!(autumn, utc(2026, 10, 25, 0, 30));
        assert_eq!(s.next_after(autumn), Some(utc(2026, 10, 26, 1, 30)));
    }

    #[test]
    fn an_interval_runs_in_both_passes_of_the_autumn_overlap() {
        let s = Schedule::new("n", "0 * * * *")
            .unwrap()
            .time_zone("Europe/Paris")
            .unwrap();
        let mut t = utc(2026, 10, 24, 23, 30);
        let mut ticks = Vec::new();
        for _ in 0..4 {
            t = s.next_after(t).unwrap();
            ticks.push(t);
        }
        // 02:00 CEST (00:00 UTC), 02:00 CET (01:00 UTC): hourly in real time.
        assert_eq!(
            ticks,
            [
                utc(2026, 10, 25, 0, 0),
                utc(2026, 10, 25, 1, 0),
                utc(2026, 10, 25, 2, 0),
                utc(2026, 10, 25, 3, 0)
            ]
        );
    }

    #[test]
    fn bad_schedules_name_what_to_change() {
        for (name, expr, needle) in [
            ("", "* * * * *", "schedule name holds 1 to"),
            ("s", "* * *", "cron expression \"* * *\" is invalid"),
            (
                "s",
                "0 25 * * *",
                "cron expression \"0 25 * * *\" is invalid",
            ),
        ] {
            let e = Schedule::new(name, expr).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
            assert!(e.starts_with("schedule \""), "{e}");
        }
        let e = Schedule::new("s", "@daily")
            .unwrap()
            .time_zone("Europe/Pariss")
            .unwrap_err()
            .to_string();
        assert!(e.contains("time zone \"Europe/Pariss\" is unknown"), "{e}");
    }

    #[test]
    fn lateness_is_kept_between_a_second_and_an_hour() {
        let s = Schedule::new("s", "* * * * *").unwrap();
        assert_eq!(s.max_lateness, DEFAULT_MAX_LATENESS);
        let s = s.max_lateness(Duration::from_secs(86_400));
        assert_eq!(s.max_lateness, MAX_LATENESS_CAP);
        assert!(MAX_LATENESS_CAP.as_millis() * 2 < u128::from(TICK_KEPT_MS.unsigned_abs()));
    }
}
