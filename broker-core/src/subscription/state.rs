//! The claim loop's states, and the one function that moves between them.
//!
//! The loop ([`claim_loop`](super::claim_loop)) does the I/O: it reads the pause, waits for
//! what [`Machine::step`] asks for, starts claims and hands their rows to delivery tasks. What
//! to do next is decided here and nowhere else, from what happened, with no clock, lock or task
//! of its own, so a unit test can drive it.

use std::time::Duration;

use tokio::time::Instant;

use super::plan::Plan;
use super::timing::{claim_backoff, drained_wait};

/// What the claim loop is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoopState {
    /// One claim looks whether rows are there: at the start, and after a wake-up, a poll or a
    /// resume. Only a claim that comes back full fans out to every claim slot, so an idle
    /// subscription runs one empty claim per poll instead of one per claim slot.
    Probing,
    /// Every claim slot stays busy: the last claim got every row it asked for, came back short
    /// while a settlement freed rows, or lost a race for rows. Claims stay busy even where most
    /// come back empty (a FIFO group has one claimable head at a time): claims started at
    /// different moments overlap the head's settlement at different points, so one of them
    /// usually takes the next head right away. One claim at a time would make every row wait
    /// out a whole claim (measured: 0.14 of the raw loop on a one-group lease table).
    Claiming,
    /// The last claim came back short, or failed: wait for a wake-up or the poll (after failed
    /// claims, the claim backoff).
    Drained,
    /// The queue is paused (see [`Queue::pause`](crate::Queue::pause)): no claim starts; wait
    /// for a wake-up (a resume in this process) or the poll, then the loop reads the pause
    /// again.
    Paused,
}

/// How a claim came back, as the claim task saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claimed {
    /// The claim returned `got` of the `asked` rows; `freed` says whether a settlement that may
    /// have made rows claimable landed while it ran.
    Rows {
        /// The rows the claim asked for.
        asked: usize,
        /// The rows it got.
        got: usize,
        /// Whether a settlement freed rows while the claim ran: it may have run before those
        /// rows were free, and the wake-up the settlement sent may have gone to a claim that
        /// lost the row to it.
        freed: bool,
    },
    /// Another claim took the same rows at the same time (on a Galera cluster, a claim on
    /// another node won certification): rows are there.
    Conflict,
    /// The claim failed (or its task ended without a claim).
    Failed,
}

impl Claimed {
    /// Whether the claim took rows.
    fn found(self) -> bool {
        matches!(self, Self::Rows { got, .. } if got > 0)
    }

    /// What the loop does after this claim, if nothing newer says otherwise.
    fn then(self) -> LoopState {
        match self {
            Self::Rows { asked, got, freed } if got == asked || freed => LoopState::Claiming,
            Self::Rows { .. } | Self::Failed => LoopState::Drained,
            Self::Conflict => LoopState::Claiming,
        }
    }
}

/// What happened to the claim loop (a delivery task that ended, or a stop, changes nothing the
/// machine decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Happened {
    /// The loop read the pause and is about to wait: what it waits for comes from this step.
    Ready {
        /// Whether the queue is paused.
        paused: bool,
        /// Claims failed since the last one that worked (from the subscription's health, which
        /// every claim updates as soon as it returns).
        claim_errors: u32,
    },
    /// A wake-up (a publish, a settlement) or the poll ended a wait: look again.
    Woken,
    /// The loop started a claim; it carries [`Machine::seq`] from this step on.
    ClaimStarted,
    /// A claim returned.
    ClaimReturned {
        /// The [`Machine::seq`] the claim carries.
        seq: u64,
        /// How it came back.
        claimed: Claimed,
    },
}

/// What the loop waits for next (besides a stop, a returning claim or an ending delivery task,
/// which it always waits for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Wait {
    /// Start a claim once this many window permits are free; `None`: start none now.
    pub(super) claim: Option<usize>,
    /// Look again after this long, or at a wake-up if sooner; `None`: look only when a claim
    /// returns.
    pub(super) look: Option<Duration>,
}

/// What the loop's decisions read that does not change while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    /// The most claims in flight.
    pub(super) max_claims: usize,
    /// Window permits a claim waits for before it starts: prefetching claims wait until a
    /// whole batch fits; the others start as soon as one slot is free and take what else is
    /// free.
    pub(super) wanted: usize,
    /// [`SubscribeOptions::poll_interval`](super::SubscribeOptions::poll_interval).
    pub(super) poll_interval: Duration,
    /// [`SubscribeOptions::poll_cooldown`](super::SubscribeOptions::poll_cooldown).
    pub(super) poll_cooldown: Duration,
}

impl Limits {
    /// The limits of a subscription with `plan` and these poll timings.
    pub(super) fn new(plan: &Plan, poll_interval: Duration, poll_cooldown: Duration) -> Self {
        Self {
            max_claims: plan.max_claims,
            wanted: if plan.prefetch > 0 { plan.batch } else { 1 },
            poll_interval,
            poll_cooldown,
        }
    }
}

/// The claim loop's state and what its decisions remember.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Machine {
    /// What the loop is doing.
    state: LoopState,
    /// Counts the claims started and the wake-ups and polls taken, in the order the loop saw
    /// them; each claim carries the count at its start.
    seq: u64,
    /// The count of what set `state`: a claim that started before a wake-up (or before a newer
    /// claim that found rows) and came back short says nothing about rows that wake-up
    /// announced, since its statement may have run before they were committed. Letting it
    /// drain the loop would lose the wake-up and leave those rows to the next poll (measured
    /// on a one-group FIFO table: a one-second stall every few hundred rows, a quarter of the
    /// strategy loop's rate).
    state_seq: u64,
    /// Claims in flight.
    claims: usize,
    /// When a claim last found rows: the wait after a drained claim grows with the time since
    /// (see [`drained_wait`]). `None` until a claim finds rows.
    last_found: Option<Instant>,
    /// Claims failed in a row, as last seen.
    claim_errors: u32,
    limits: Limits,
}

impl Machine {
    /// A loop that has claimed nothing yet: it probes first.
    pub(super) fn new(limits: Limits) -> Self {
        Self {
            state: LoopState::Probing,
            seq: 0,
            state_seq: 0,
            claims: 0,
            last_found: None,
            claim_errors: 0,
            limits,
        }
    }

    /// What the loop is doing.
    #[cfg(test)]
    pub(super) fn state(&self) -> LoopState {
        self.state
    }

    /// The count a claim started now carries (see [`Happened::ClaimStarted`]).
    pub(super) fn seq(&self) -> u64 {
        self.seq
    }

    /// Claims in flight.
    pub(super) fn claims(&self) -> usize {
        self.claims
    }

    /// The transition: the state after `happened` at `now`, and what the loop waits for next.
    pub(super) fn step(mut self, happened: Happened, now: Instant) -> (Self, Wait) {
        match happened {
            Happened::Ready {
                paused,
                claim_errors,
            } => {
                self.claim_errors = claim_errors;
                if paused {
                    self.state = LoopState::Paused;
                } else if self.state == LoopState::Paused {
                    // Resumed: look at once, as after a wake-up.
                    self.look();
                }
            }
            Happened::Woken => {
                if self.state == LoopState::Paused {
                    // The pause is read again before the next wait; only a resume looks.
                    self.seq += 1;
                } else {
                    self.look();
                }
            }
            Happened::ClaimStarted => {
                self.seq += 1;
                self.claims += 1;
            }
            Happened::ClaimReturned { seq, claimed } => {
                self.claims = self.claims.saturating_sub(1);
                if claimed.found() {
                    self.last_found = Some(now);
                }
                let then = claimed.then();
                if self.state == LoopState::Paused {
                    // A resume probes whatever the claims said.
                } else if seq >= self.state_seq {
                    self.state = then;
                    self.state_seq = seq;
                } else if then == LoopState::Claiming {
                    self.state = LoopState::Claiming;
                }
            }
        }
        let wait = self.wait(now);
        (self, wait)
    }

    /// A wake-up, a poll or a resume: one claim looks.
    fn look(&mut self) {
        self.seq += 1;
        self.state = LoopState::Probing;
        self.state_seq = self.seq;
    }

    /// What the loop waits for in its state: a wake-up or the poll while the table looks
    /// drained or the queue is paused, a returning claim while all claims are in flight, window
    /// permits otherwise.
    fn wait(&self, now: Instant) -> Wait {
        let limits = &self.limits;
        let max_claims = match self.state {
            LoopState::Probing => 1,
            _ => limits.max_claims,
        };
        match self.state {
            LoopState::Paused => Wait {
                claim: None,
                look: Some(limits.poll_interval),
            },
            LoopState::Drained => Wait {
                claim: None,
                look: Some(match self.claim_errors {
                    0 => drained_wait(
                        limits.poll_interval,
                        limits.poll_cooldown,
                        self.last_found.map(|at| now.saturating_duration_since(at)),
                    ),
                    // A wake-up cuts a claim backoff short too: it means the database took a
                    // write just now, and without one a backoff is never longer than the poll
                    // interval was.
                    failing => claim_backoff(limits.poll_interval, failing),
                }),
            },
            LoopState::Probing | LoopState::Claiming => Wait {
                claim: (self.claims < max_claims).then_some(limits.wanted),
                look: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLL: Duration = Duration::from_secs(1);
    const COOLDOWN: Duration = Duration::from_millis(25);

    fn limits(max_claims: usize) -> Limits {
        Limits {
            max_claims,
            wanted: 1,
            poll_interval: POLL,
            poll_cooldown: COOLDOWN,
        }
    }

    fn ready() -> Happened {
        Happened::Ready {
            paused: false,
            claim_errors: 0,
        }
    }

    fn rows(asked: usize, got: usize) -> Claimed {
        Claimed::Rows {
            asked,
            got,
            freed: false,
        }
    }

    /// Steps `m` through `events` at `now`; returns the machine and the last wait.
    fn run(m: Machine, events: &[Happened], now: Instant) -> (Machine, Wait) {
        let mut m = m;
        let mut wait = None;
        for &e in events {
            let (next, w) = m.step(e, now);
            m = next;
            wait = Some(w);
        }
        (m, wait.expect("at least one event"))
    }

    /// Starts a claim and returns its seq.
    fn start(m: &mut Machine, now: Instant) -> u64 {
        *m = m.step(Happened::ClaimStarted, now).0;
        m.seq()
    }

    fn returned(seq: u64, claimed: Claimed) -> Happened {
        Happened::ClaimReturned { seq, claimed }
    }

    #[test]
    fn a_new_loop_probes_with_a_single_claim() {
        let now = Instant::now();
        let mut m = Machine::new(limits(4));
        let (_, wait) = m.step(ready(), now);
        assert_eq!(m.state(), LoopState::Probing);
        assert_eq!(
            wait,
            Wait {
                claim: Some(1),
                look: None
            }
        );
        start(&mut m, now);
        let (_, wait) = m.step(ready(), now);
        assert_eq!(
            wait.claim, None,
            "a probe runs one claim, not one per claim slot"
        );
    }

    #[test]
    fn a_full_probe_fans_out_to_every_claim_slot() {
        let now = Instant::now();
        let mut m = Machine::new(limits(3));
        let seq = start(&mut m, now);
        let (mut m, _) = m.step(returned(seq, rows(1, 1)), now);
        assert_eq!(m.state(), LoopState::Claiming);
        for _ in 0..3 {
            assert_eq!(m.step(ready(), now).1.claim, Some(1));
            start(&mut m, now);
        }
        assert_eq!(
            m.step(ready(), now).1,
            Wait {
                claim: None,
                look: None
            },
            "with every claim slot busy the loop waits for a claim to return"
        );
    }

    #[test]
    fn a_short_claim_drains_the_loop_until_a_wake_up() {
        let now = Instant::now();
        let mut m = Machine::new(limits(3));
        let seq = start(&mut m, now);
        let (m, wait) = run(m, &[returned(seq, rows(4, 0)), ready()], now);
        assert_eq!(m.state(), LoopState::Drained);
        assert_eq!(
            wait,
            Wait {
                claim: None,
                look: Some(POLL)
            }
        );
        let (m, wait) = run(m, &[Happened::Woken, ready()], now);
        assert_eq!(m.state(), LoopState::Probing);
        assert_eq!(wait.claim, Some(1));
    }

    #[test]
    fn a_short_claim_that_started_before_a_wake_up_does_not_drain_the_loop() {
        let now = Instant::now();
        let mut m = Machine::new(limits(3));
        let seq = start(&mut m, now);
        m = m.step(Happened::Woken, now).0;
        let (m, _) = m.step(returned(seq, rows(4, 0)), now);
        assert_eq!(
            m.state(),
            LoopState::Probing,
            "the claim may have run before the rows the wake-up announced were committed"
        );
    }

    #[test]
    fn an_older_claim_that_got_all_it_asked_for_still_fans_out() {
        let now = Instant::now();
        let mut m = Machine::new(limits(3));
        let seq = start(&mut m, now);
        m = m.step(Happened::Woken, now).0;
        let (m, _) = m.step(returned(seq, rows(2, 2)), now);
        assert_eq!(m.state(), LoopState::Claiming);
    }

    #[test]
    fn a_short_claim_while_a_settlement_freed_rows_keeps_claiming() {
        let now = Instant::now();
        let mut m = Machine::new(limits(3));
        let seq = start(&mut m, now);
        let claimed = Claimed::Rows {
            asked: 4,
            got: 1,
            freed: true,
        };
        let (m, _) = m.step(returned(seq, claimed), now);
        assert_eq!(m.state(), LoopState::Claiming);
    }

    #[test]
    fn a_conflict_claims_again_at_once_and_a_failure_drains() {
        let now = Instant::now();
        let mut m = Machine::new(limits(3));
        let seq = start(&mut m, now);
        let (mut m, _) = m.step(returned(seq, Claimed::Conflict), now);
        assert_eq!(m.state(), LoopState::Claiming);
        let seq = start(&mut m, now);
        let (m, _) = m.step(returned(seq, Claimed::Failed), now);
        assert_eq!(m.state(), LoopState::Drained);
        assert_eq!(m.claims(), 0);
    }

    #[test]
    fn a_paused_queue_starts_no_claim_and_a_resume_probes_at_once() {
        let now = Instant::now();
        let mut m = Machine::new(limits(3));
        let seq = start(&mut m, now);
        let paused = Happened::Ready {
            paused: true,
            claim_errors: 3,
        };
        let (m, wait) = run(m, &[returned(seq, rows(1, 1)), paused], now);
        assert_eq!(m.state(), LoopState::Paused);
        assert_eq!(
            wait,
            Wait {
                claim: None,
                look: Some(POLL)
            },
            "paused, the loop reads the pause again every poll interval, whatever the errors"
        );
        let (mut m, wait) = m.step(Happened::Woken, now);
        assert_eq!(
            m.state(),
            LoopState::Paused,
            "a wake-up alone does not resume"
        );
        assert_eq!(wait.claim, None);
        let seq = start(&mut m, now);
        let (m, wait) = m.step(returned(seq, rows(1, 1)), now);
        assert_eq!(
            m.state(),
            LoopState::Paused,
            "a claim's report does not resume"
        );
        assert_eq!(wait.claim, None);
        let (m, wait) = m.step(ready(), now);
        assert_eq!(m.state(), LoopState::Probing);
        assert_eq!(wait.claim, Some(1));
    }

    #[test]
    fn prefetching_claims_wait_for_a_whole_batch_of_permits() {
        let plan = Plan {
            batch: 8,
            max_claims: 2,
            prefetch: 16,
        };
        let m = Machine::new(Limits::new(&plan, POLL, COOLDOWN));
        assert_eq!(m.step(ready(), Instant::now()).1.claim, Some(8));
        let plan = Plan {
            prefetch: 0,
            ..plan
        };
        let m = Machine::new(Limits::new(&plan, POLL, COOLDOWN));
        assert_eq!(m.step(ready(), Instant::now()).1.claim, Some(1));
    }

    /// A table for [`drive`]: how the `n`th claim comes back.
    type Table = fn(usize) -> Claimed;

    /// Drives the machine the way the claim loop does, for `span` of (paused) time, against
    /// claims that return at once as `table` says and no wake-ups; returns when each claim
    /// started, since the start (at most 1,000 claims).
    async fn drive(table: Table, span: Duration) -> Vec<Duration> {
        let start = Instant::now();
        let mut m = Machine::new(limits(1));
        let mut errors = 0;
        let mut starts = Vec::new();
        // The cap ends a loop that stopped waiting (a zero wait never lets paused time move).
        while start.elapsed() < span && starts.len() < 1000 {
            let ready = Happened::Ready {
                paused: false,
                claim_errors: errors,
            };
            let (next, wait) = m.step(ready, Instant::now());
            m = next;
            if wait.claim.is_some() {
                starts.push(start.elapsed());
                let seq = start_at(&mut m);
                let claimed = table(starts.len());
                errors = if claimed == Claimed::Failed {
                    errors + 1
                } else {
                    0
                };
                m = m.step(returned(seq, claimed), Instant::now()).0;
            } else {
                let look = wait
                    .look
                    .expect("a loop with no claim in flight looks again");
                tokio::time::sleep(look).await;
                m = m.step(Happened::Woken, Instant::now()).0;
            }
        }
        starts
    }

    fn start_at(m: &mut Machine) -> u64 {
        start(m, Instant::now())
    }

    fn millis(starts: &[Duration]) -> Vec<u128> {
        starts.iter().map(Duration::as_millis).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_subscription_looks_once_per_poll_interval() {
        let starts = drive(|_| rows(1, 0), Duration::from_secs(5)).await;
        assert_eq!(millis(&starts), [0, 1000, 2000, 3000, 4000]);
    }

    #[tokio::test(start_paused = true)]
    async fn after_finding_rows_the_loop_looks_after_the_cooldown_then_doubles_to_the_poll() {
        // The first claim finds one row of the ten it asked for; the table stays empty after.
        let starts = drive(
            |n| if n == 1 { rows(10, 1) } else { rows(10, 0) },
            Duration::from_secs(4),
        )
        .await;
        assert_eq!(
            millis(&starts),
            [0, 25, 50, 100, 200, 400, 800, 1600, 2600, 3600]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn rows_that_keep_trickling_in_are_claimed_every_cooldown() {
        let starts = drive(|_| rows(10, 1), Duration::from_millis(100)).await;
        assert_eq!(millis(&starts), [0, 25, 50, 75]);
    }

    #[tokio::test(start_paused = true)]
    async fn failing_claims_back_off_doubling_from_the_poll_interval_to_thirty_seconds() {
        let starts = drive(|_| Claimed::Failed, Duration::from_secs(100)).await;
        assert_eq!(
            starts.iter().map(Duration::as_secs).collect::<Vec<_>>(),
            [0, 1, 3, 7, 15, 31, 61, 91]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_that_works_again_ends_the_backoff() {
        // Three failures, then an empty table: back to the poll interval.
        let starts = drive(
            |n| if n <= 3 { Claimed::Failed } else { rows(1, 0) },
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(
            starts.iter().map(Duration::as_secs).collect::<Vec<_>>(),
            [0, 1, 3, 7, 8, 9]
        );
    }
}
