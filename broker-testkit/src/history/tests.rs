//! The checker on hand-built histories: each violation found as exactly itself, each excuse
//! taking away exactly what its fault explains, and the claim order faults make.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use broker_core::ClaimMode;
use broker_core::events::EngineEvent;

use super::{Claim, Cut, Excuse, Expect, Final, History, Record, Recorded};

fn rec(id: i64, attempt: i64, start: u64, end: u64, outcome: Option<Recorded>) -> Record {
    Record {
        broker: 0,
        id,
        attempt,
        key: Some(format!("k{id}")),
        group: Some("g".into()),
        start: Duration::from_millis(start),
        claim: None,
        end: Some(Duration::from_millis(end)),
        outcome,
        lease_until: None,
        cut: None,
        cut_from: None,
    }
}

/// A claim that began and returned at these times.
fn claim(began: Duration, returned: Duration) -> Option<Claim> {
    Some(Claim { began, returned })
}

fn history(records: Vec<Record>) -> History {
    let h = History::new(&crate::unique_name("unit"));
    *h.records.lock().unwrap() = records;
    h
}

/// Notes that the settlement of `attempt` of row `id` went through at `at_ms`.
fn settled(h: &History, id: i64, attempt: i64, at_ms: u64) {
    let at = h.epoch + Duration::from_millis(at_ms);
    let micros = at.duration_since(UNIX_EPOCH).unwrap().as_micros();
    crate::engine_events::note(&h.table, id, attempt, i64::try_from(micros).unwrap());
}

fn expect(mode: ClaimMode, finals: &[(i64, Final)]) -> Expect {
    Expect {
        mode,
        fifo: true,
        max_attempts: Some(3),
        finals: finals.iter().copied().collect(),
    }
}

#[test]
fn a_clean_history_passes_with_its_figures() {
    let h = history(vec![
        rec(1, 1, 0, 10, Some(Recorded::Error)),
        rec(1, 2, 10, 20, Some(Recorded::Ack)),
        rec(2, 1, 20, 30, Some(Recorded::Retry)),
        Record {
            end: None,
            ..rec(2, 2, 30, 40, None)
        },
        rec(2, 3, 40, 50, Some(Recorded::Panic)),
    ]);
    for (id, attempt, at) in [(1, 1, 11), (1, 2, 21), (2, 1, 31)] {
        settled(&h, id, attempt, at);
    }
    let marked = h.process_killed(0, Duration::from_millis(35), Duration::from_millis(36));
    assert_eq!((marked.in_handler, marked.settling), (1, 0));
    let f = h
        .check(&expect(
            ClaimMode::Lease,
            &[(1, Final::Gone), (2, Final::Dead)],
        ))
        .unwrap();
    assert_eq!(
        (
            f.rows,
            f.deliveries,
            f.retries,
            f.cut,
            f.crashed,
            f.acked,
            f.dead
        ),
        (2, 5, 3, 1, 1, 1, 1)
    );
}

fn cut(mut r: Record, cut: Cut) -> Record {
    r.cut = Some(cut);
    r
}

#[test]
fn a_fault_excuses_only_what_its_mode_promises() {
    // Row 1 acked in a delivery a connection kill reached (0-10 ms), then delivered again
    // at `attempt` from 5 ms on; `None`: the history passes.
    let after_kill = |attempt: i64| {
        vec![
            cut(
                rec(1, 1, 0, 10, Some(Recorded::Ack)),
                Cut::ConnectionInHandler,
            ),
            rec(1, attempt, 5, 15, Some(Recorded::Ack)),
        ]
    };
    // Row 1 acked (0-10 ms), then a delivery at `attempt` whose handler ran 12-15 ms, cut by a
    // connection kill if `killed`.
    let stale_after = |attempt: i64, killed: bool| {
        let later = rec(1, attempt, 12, 15, Some(Recorded::Ack));
        vec![
            rec(1, 1, 0, 10, Some(Recorded::Ack)),
            if killed {
                cut(later, Cut::ConnectionInHandler)
            } else {
                later
            },
        ]
    };
    // Row 1's holder crashed with a lease until 100 ms; delivered again at `start`.
    let after_crash = |start: u64| {
        let mut crashed = cut(rec(1, 1, 0, 10, None), Cut::CrashInHandler);
        crashed.lease_until = Some(Duration::from_millis(100));
        vec![crashed, rec(1, 2, start, start + 10, Some(Recorded::Ack))]
    };
    let gone: &[(i64, Final)] = &[(1, Final::Gone)];
    type Case<'a> = (Vec<Record>, ClaimMode, &'a [(i64, Final)], Option<&'a str>);
    let cases: Vec<Case> = vec![
        // A killed connection does not free a lease: no overlap, cut or not.
        (
            after_kill(2),
            ClaimMode::Lease,
            gone,
            Some("one row in two deliveries"),
        ),
        // A crashed lease holder keeps the row until its lease runs out.
        (
            after_crash(50),
            ClaimMode::Lease,
            gone,
            Some("before the crashed holder's lease ran out"),
        ),
        (after_crash(100), ClaimMode::Lease, gone, None),
        // Row lock rolls back: the attempt is not used.
        (
            after_kill(2),
            ClaimMode::RowLock,
            gone,
            Some("across a ConnectionInHandler"),
        ),
        (after_kill(1), ClaimMode::RowLock, gone, None),
        // Row lock: a delivery whose transaction a kill ended may run its handler after
        // another delivery finished the row, at the attempt it claimed; not at a later one,
        // and not without the kill, and never in lease mode (the lease still holds).
        (stale_after(1, true), ClaimMode::RowLock, gone, None),
        (
            stale_after(2, true),
            ClaimMode::RowLock,
            gone,
            Some("delivered again after it finished"),
        ),
        (
            stale_after(1, false),
            ClaimMode::RowLock,
            gone,
            Some("delivered again after it finished"),
        ),
        (
            stale_after(1, true),
            ClaimMode::Lease,
            gone,
            Some("delivered again after it finished"),
        ),
        // Advisory frees the key (overlap allowed) and uses one attempt.
        (
            after_kill(1),
            ClaimMode::Advisory,
            gone,
            Some("across a ConnectionInHandler"),
        ),
        (after_kill(2), ClaimMode::Advisory, gone, None),
        // An ack nothing cut must land: dead-lettered instead is a failure.
        (
            vec![rec(1, 1, 0, 10, Some(Recorded::Ack))],
            ClaimMode::Lease,
            &[(1, Final::Dead)],
            Some("the database says Dead"),
        ),
    ];
    for (records, mode, finals, needle) in cases {
        let result = history(records).check(&expect(mode, finals));
        match needle {
            Some(needle) => {
                let err = result.unwrap_err();
                assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
            }
            None => {
                result.unwrap();
            }
        }
    }
}

#[test]
fn a_connection_kill_marks_running_and_settling_deliveries_of_its_broker_only() {
    let mut other = rec(3, 1, 0, 100, Some(Recorded::Ack));
    other.broker = 1;
    let h = history(vec![
        rec(1, 1, 0, 10, Some(Recorded::Ack)),
        rec(2, 1, 0, 19, Some(Recorded::Ack)),
        rec(4, 1, 15, 40, Some(Recorded::Ack)),
        other,
    ]);
    // At 20 one handler (row 4) runs, row 1's settlement is through, row 2's is not.
    settled(&h, 1, 1, 12);
    settled(&h, 2, 1, 25);
    let marked = h.connections_killed(0, Duration::from_millis(20), Duration::from_millis(21));
    assert_eq!((marked.in_handler, marked.settling), (1, 1));
    let cuts: Vec<_> = h.records().iter().map(|r| (r.id, r.cut)).collect();
    assert_eq!(
        cuts,
        [
            (1, None),
            (2, Some(Cut::ConnectionSettling)),
            (4, Some(Cut::ConnectionInHandler)),
            (3, None)
        ]
    );
}
#[test]
fn a_delivery_whose_claim_was_in_flight_during_a_kill_is_cut() {
    // The kill of broker 0's connections runs from 20 to 21 ms. Broker 0 starts a handler
    // for row 1 at 25 ms from a claim that began at `claimed`; broker 1 runs row 1 alongside
    // it at the same attempt (row lock: the kill rolled broker 0's claim back) and acks it.
    let run = |claimed: u64| {
        let mut mine = rec(1, 1, 25, 35, Some(Recorded::Ack));
        mine.claim = claim(Duration::from_millis(claimed), Duration::from_millis(24));
        let mut other = rec(1, 1, 27, 45, Some(Recorded::Ack));
        other.broker = 1;
        let h = history(vec![mine, other]);
        settled(&h, 1, 1, 46);
        h.connections_killed(0, Duration::from_millis(20), Duration::from_millis(21));
        h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
    };
    run(19).unwrap();
    run(21).unwrap();
    let err = run(22).unwrap_err();
    assert!(err.contains("one row in two deliveries"), "{err}");
}

#[test]
fn a_handler_start_takes_its_claim_time_from_the_engines_event() {
    let h = History::new(&crate::unique_name("unit"));
    // The claim begins after the history's start.
    std::thread::sleep(Duration::from_millis(20));
    // What the engine reports when a claim that took 5 ms returns a delivery.
    let returned = SystemTime::now();
    crate::engine_events::observe(&EngineEvent::Claimed {
        table: &h.table,
        subscription: &History::subscription_name(3),
        id: 7,
        attempt: 2,
        began: returned - Duration::from_millis(5),
        returned,
    });
    let at = h.start(3, 7, 2, None, None, None);
    let r = &h.records()[at];
    let claim = r.claim.expect("the claim's event was kept");
    assert!(
        claim.returned - claim.began >= Duration::from_millis(5) && claim.returned <= r.start,
        "{claim:?} {:?}",
        r.start
    );
    // Another attempt of the row, or another broker's delivery of it, has no claim on
    // record.
    let other = h.start(3, 7, 3, None, None, None);
    assert_eq!(h.records()[other].claim, None);
    let other = h.start(4, 7, 2, None, None, None);
    assert_eq!(h.records()[other].claim, None);
}

#[test]
fn a_late_handler_of_an_earlier_claim_is_ordered_by_its_claim() {
    // Row lock: broker 1 claimed row 1 at 10-11 ms; the kill of its connections (20-23 ms)
    // rolled its claim back before its handler began at 22 ms. Broker 0's claim, returned at
    // `returned`, ran the row from 21 ms, at the same attempt.
    let run = |returned: u64| {
        let mut mine = rec(1, 1, 21, 30, Some(Recorded::Ack));
        mine.claim = claim(
            Duration::from_millis(returned - 1),
            Duration::from_millis(returned),
        );
        let mut late = rec(1, 1, 22, 25, Some(Recorded::Ack));
        late.broker = 1;
        late.claim = claim(Duration::from_millis(10), Duration::from_millis(11));
        let h = history(vec![mine, late]);
        settled(&h, 1, 1, 31);
        h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(23));
        h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
    };
    run(21).unwrap();
    // A claim that returned before the kill took the row while broker 1 still held it.
    let err = run(15).unwrap_err();
    assert!(err.contains("one row in two deliveries"), "{err}");
}

#[test]
fn a_late_handler_of_an_earlier_row_lock_claim_comes_before_a_retry() {
    // Row lock: broker 1's claim of row 1 (from `late_began` to 22 ms) read attempt 1 and
    // its transaction died in the kill of its connections (20-23 ms); its handler panicked
    // at 22 ms. Broker 0's claim (with `known` claim times: 15 ms to `mine_took`) took the
    // row and its handler panicked at `mine_took`: the retry counted the attempt, and
    // broker 0 ran attempt 2 at 30 ms. Broker 1 read attempt 1, so it took the row before
    // broker 0 did, which it could only if its transaction had died by then.
    let run = |late_began: u64, mine_took: u64, known: bool| {
        let mut mine = rec(1, 1, mine_took, mine_took, Some(Recorded::Panic));
        mine.claim = known.then_some(Claim {
            began: Duration::from_millis(15),
            returned: Duration::from_millis(mine_took),
        });
        let mut late = rec(1, 1, 22, 22, Some(Recorded::Panic));
        late.broker = 1;
        late.claim = claim(Duration::from_millis(late_began), Duration::from_millis(22));
        let mut again = rec(1, 2, 30, 31, Some(Recorded::Ack));
        again.claim = claim(Duration::from_millis(29), Duration::from_millis(30));
        let h = history(vec![mine, late, again]);
        settled(&h, 1, 1, mine_took);
        settled(&h, 1, 2, 31);
        h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(23));
        h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
    };
    run(12, 21, true).unwrap();
    // Claims that overlapped, and a claim (a child process's) whose times are unknown.
    run(16, 21, true).unwrap();
    run(12, 21, false).unwrap();
    // Broker 0 took the row before the kill: broker 1 still held it then.
    for known in [true, false] {
        let err = run(12, 19, known).unwrap_err();
        assert!(err.contains("attempt went from 1 to 1"), "{err}");
    }
    // A claim that began first but read the attempt a later retry counted came after that
    // retry, whatever its start: broker 0's claim (12-30 ms, through the kill of its
    // connections at 10-13 ms) read attempt 2, after broker 1 ran attempt 1 (a retry).
    let mut slow = rec(1, 2, 30, 31, Some(Recorded::Ack));
    slow.claim = claim(Duration::from_millis(12), Duration::from_millis(30));
    let mut first = rec(1, 1, 20, 20, Some(Recorded::Retry));
    first.broker = 1;
    first.claim = claim(Duration::from_millis(13), Duration::from_millis(20));
    let h = history(vec![first, slow]);
    settled(&h, 1, 1, 20);
    settled(&h, 1, 2, 31);
    h.connections_killed(0, Duration::from_millis(10), Duration::from_millis(13));
    h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
        .unwrap();
}

#[test]
fn a_late_handler_is_not_put_before_a_delivery_whose_claim_is_unknown() {
    // Row lock: a child process (broker 100, which reports no claims) ran row 1 from 30 ms
    // until it was killed at 35 ms. Broker 1's claim began at 25 ms, in the kill of its
    // connections (20-28 ms), and took the row after the crash; its handler retried at
    // 40 ms, and broker 0 acked attempt 2 at 50 ms. The child's claim began before its
    // start, so nothing says broker 1's came first.
    let mut child = rec(1, 1, 30, 0, None);
    child.broker = 100;
    child.end = None;
    let mut late = rec(1, 1, 40, 41, Some(Recorded::RetryAfter));
    late.broker = 1;
    late.claim = claim(Duration::from_millis(25), Duration::from_millis(40));
    let mut last = rec(1, 2, 50, 51, Some(Recorded::Ack));
    last.claim = claim(Duration::from_millis(49), Duration::from_millis(50));
    let h = history(vec![child, late, last]);
    settled(&h, 1, 1, 41);
    settled(&h, 1, 2, 51);
    h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(28));
    h.process_killed(100, Duration::from_millis(35), Duration::from_millis(36));
    h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
        .unwrap();
}

#[test]
fn a_group_moves_on_once_a_later_claim_finished_a_late_handlers_row() {
    // Advisory: broker 1's connections were killed from 7 ms on. Its delivery of row 1 at
    // attempt 2 (claimed 15-21 ms) began after a child process had claimed attempt 3 and
    // started it at 20 ms; the child acked at `acked`. Row 2 of the group ran at 40 ms.
    let run = |acked: u64| {
        let mut first = rec(1, 1, 5, 8, Some(Recorded::Retry));
        first.broker = 1;
        first.claim = claim(Duration::from_millis(4), Duration::from_millis(5));
        let mut late = rec(1, 2, 21, 25, Some(Recorded::Error));
        late.broker = 1;
        late.claim = claim(Duration::from_millis(15), Duration::from_millis(21));
        let mut child = rec(1, 3, 20, acked, Some(Recorded::Ack));
        child.broker = 100;
        let mut next = rec(2, 1, 40, 41, Some(Recorded::Ack));
        next.key = Some("k2".into());
        next.claim = claim(Duration::from_millis(39), Duration::from_millis(40));
        let h = history(vec![first, late, child, next]);
        settled(&h, 1, 3, acked);
        settled(&h, 2, 1, 41);
        h.connections_killed(1, Duration::from_millis(7), Duration::from_millis(100));
        h.check(&expect(
            ClaimMode::Advisory,
            &[(1, Final::Gone), (2, Final::Gone)],
        ))
    };
    run(22).unwrap();
    // The row was still in work when the group's next row began.
    let err = run(45).unwrap_err();
    assert!(err.contains("group g moved on from row 1"), "{err}");
}

#[test]
fn a_handler_recorded_just_after_a_kill_marked_its_broker_is_cut() {
    // Row lock: broker 1's claim of row 1 (10-29 ms) was in flight through the kill of its
    // connections (20-30 ms) and lost its transaction; its handler began at 29 ms, but its
    // record came in just after the kill marked the handlers it found. Broker 1's next
    // claim (29.5-31 ms) took the row again, at the same attempt, and both acked.
    let mut missed = rec(1, 1, 29, 40, Some(Recorded::Ack));
    missed.broker = 1;
    missed.claim = claim(Duration::from_millis(10), Duration::from_millis(29));
    let mut again = rec(1, 1, 31, 39, Some(Recorded::Ack));
    again.broker = 1;
    again.claim = claim(Duration::from_micros(29_500), Duration::from_millis(31));
    let h = history(vec![again]);
    settled(&h, 1, 1, 39);
    h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(30));
    h.records.lock().unwrap().insert(0, missed);
    h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
        .unwrap();
}

#[test]
fn a_late_handler_of_an_earlier_claim_is_ordered_by_its_attempt() {
    // Advisory: the claim at attempt 1 lost its key's session before its handler began at
    // 8 ms; the claim at attempt 2 ran from 0 to 10 ms and acked.
    let late = cut(
        rec(1, 1, 8, 9, Some(Recorded::Ack)),
        Cut::ConnectionInHandler,
    );
    let h = history(vec![rec(1, 2, 0, 10, Some(Recorded::Ack)), late]);
    h.check(&expect(ClaimMode::Advisory, &[(1, Final::Gone)]))
        .unwrap();
}

/// A delivery of row `id` with no advisory key and no group.
fn plain(id: i64, attempt: i64, start: u64, end: u64, outcome: Option<Recorded>) -> Record {
    Record {
        key: None,
        group: None,
        ..rec(id, attempt, start, end, outcome)
    }
}

/// A history of `records` in which broker 9 (which ran none of them) was killed from 5 to 6 ms:
/// a fault that reaches no recorded delivery but may have claimed rows no handler saw.
fn with_unseen_claims(records: Vec<Record>) -> History {
    let h = history(records);
    h.process_killed(9, Duration::from_millis(5), Duration::from_millis(6));
    h
}

/// Every violation the checker finds in `h`, by name, with the excuse it found for it.
fn judged(h: &History, expect: &Expect) -> Vec<(&'static str, Option<Excuse>)> {
    h.judge(expect)
        .1
        .iter()
        .map(|(v, why)| (v.name(), *why))
        .collect()
}

/// `h` breaks exactly one invariant, `name`, and no fault excuses it; the text of the failed
/// check names it.
#[track_caller]
fn found_alone(h: &History, expect: &Expect, name: &'static str) {
    assert_eq!(judged(h, expect), [(name, None)]);
    let violations = h.violations(expect).unwrap_err();
    assert_eq!(violations.len(), 1);
    let text = h.check(expect).unwrap_err();
    assert!(text.contains(&format!("[{name}]")), "{text}");
}

/// `h` breaks `name`, `why` excuses it, and every other violation found is excused too: the
/// check passes.
#[track_caller]
fn excused(h: &History, expect: &Expect, name: &'static str, why: Excuse) {
    let judged = judged(h, expect);
    assert!(judged.contains(&(name, Some(why))), "{judged:?}");
    assert!(judged.iter().all(|(_, why)| why.is_some()), "{judged:?}");
    h.check(expect).unwrap();
}

/// `expect` of a table without FIFO groups.
fn unordered(mode: ClaimMode, finals: &[(i64, Final)]) -> Expect {
    Expect {
        fifo: false,
        ..expect(mode, finals)
    }
}

const GONE: &[(i64, Final)] = &[(1, Final::Gone)];

#[test]
fn a_handler_still_running_at_the_check_is_still_running() {
    let running = Record {
        end: None,
        ..plain(1, 1, 0, 0, None)
    };
    let h = history(vec![running, plain(1, 2, 10, 20, Some(Recorded::Ack))]);
    found_alone(&h, &unordered(ClaimMode::Lease, GONE), "StillRunning");
}

#[test]
fn a_row_in_two_deliveries_at_once_is_excused_only_where_a_fault_freed_its_hold() {
    let overlapping = |first: Record| vec![first, plain(1, 2, 5, 15, Some(Recorded::Ack))];
    let retried = plain(1, 1, 0, 10, Some(Recorded::Retry));
    for mode in [ClaimMode::Lease, ClaimMode::Advisory] {
        let h = history(overlapping(retried.clone()));
        found_alone(&h, &unordered(mode, GONE), "RowInTwoDeliveries");
    }
    let killed = cut(retried, Cut::ConnectionInHandler);
    // The key's session died with the connection; a lease outlives it.
    let h = history(overlapping(killed.clone()));
    excused(
        &h,
        &unordered(ClaimMode::Advisory, GONE),
        "RowInTwoDeliveries",
        Excuse::HoldFreed,
    );
    let h = history(overlapping(killed));
    found_alone(&h, &unordered(ClaimMode::Lease, GONE), "RowInTwoDeliveries");
}

#[test]
fn a_key_in_two_deliveries_at_once_is_excused_for_the_late_handler_of_an_earlier_claim() {
    let keyed = |r: Record| Record {
        key: Some("k".into()),
        ..r
    };
    let two = &[(1, Final::Gone), (2, Final::Gone)];
    let h = history(vec![
        keyed(plain(1, 1, 0, 10, Some(Recorded::Ack))),
        keyed(plain(2, 1, 5, 15, Some(Recorded::Ack))),
    ]);
    found_alone(
        &h,
        &unordered(ClaimMode::Advisory, two),
        "KeyInTwoDeliveries",
    );
    // Advisory: the claim at attempt 1 lost its key's session before its handler began at
    // 8 ms, while the claim at attempt 2 ran from 0 to 10 ms.
    let late = cut(
        keyed(plain(1, 1, 8, 9, Some(Recorded::Ack))),
        Cut::ConnectionInHandler,
    );
    let h = history(vec![keyed(plain(1, 2, 0, 10, Some(Recorded::Ack))), late]);
    excused(
        &h,
        &unordered(ClaimMode::Advisory, GONE),
        "KeyInTwoDeliveries",
        Excuse::LateHandler,
    );
}

#[test]
fn a_group_in_two_deliveries_at_once_is_excused_where_a_fault_freed_its_hold() {
    let run = |first: Record| {
        history(vec![
            Record { key: None, ..first },
            plain_in_group(2, 1, 5, 15, Some(Recorded::Ack)),
        ])
    };
    let two = &[(1, Final::Gone), (2, Final::Gone)];
    let acked = plain_in_group(1, 1, 0, 10, Some(Recorded::Ack));
    found_alone(
        &run(acked.clone()),
        &expect(ClaimMode::RowLock, two),
        "GroupInTwoDeliveries",
    );
    // Without FIFO groups nothing orders them.
    run(acked.clone())
        .check(&unordered(ClaimMode::RowLock, two))
        .unwrap();
    excused(
        &run(cut(acked, Cut::ConnectionInHandler)),
        &expect(ClaimMode::RowLock, two),
        "GroupInTwoDeliveries",
        Excuse::HoldFreed,
    );
}

/// A delivery in group `g` with no advisory key.
fn plain_in_group(id: i64, attempt: i64, start: u64, end: u64, o: Option<Recorded>) -> Record {
    Record {
        key: None,
        ..rec(id, attempt, start, end, o)
    }
}

#[test]
fn a_group_that_goes_back_a_row_is_out_of_order_unless_a_fault_freed_the_later_row() {
    let two = &[(1, Final::Gone), (2, Final::Gone)];
    let run = |first: Record| {
        history(vec![
            first,
            plain_in_group(1, 1, 10, 15, Some(Recorded::Ack)),
        ])
    };
    let later = plain_in_group(2, 1, 0, 10, Some(Recorded::Ack));
    found_alone(
        &run(later.clone()),
        &expect(ClaimMode::RowLock, two),
        "GroupOutOfOrder",
    );
    excused(
        &run(cut(later.clone(), Cut::ConnectionInHandler)),
        &expect(ClaimMode::RowLock, two),
        "GroupOutOfOrder",
        Excuse::HoldFreed,
    );
    found_alone(
        &run(cut(later, Cut::ConnectionInHandler)),
        &expect(ClaimMode::Lease, two),
        "GroupOutOfOrder",
    );
}

#[test]
fn a_group_that_moves_on_before_its_head_finished_is_excused_by_a_dead_letter_no_one_saw() {
    // Row 1 retried, the group ran row 2, and row 1's next delivery (outside the group's
    // records) finished it only after.
    let h = history(vec![
        plain_in_group(1, 1, 0, 10, Some(Recorded::Retry)),
        plain_in_group(2, 1, 10, 15, Some(Recorded::Ack)),
        plain(1, 2, 12, 20, Some(Recorded::Ack)),
    ]);
    let two = &[(1, Final::Gone), (2, Final::Gone)];
    found_alone(&h, &expect(ClaimMode::Lease, two), "GroupMovedOnEarly");
    // Row 1 ends dead-lettered though no delivery said so: a crash between 0 and 10 ms may
    // have claimed its last attempts, and the claim after dead-lettered it.
    let records = vec![
        plain_in_group(1, 1, 0, 10, Some(Recorded::Retry)),
        plain_in_group(2, 1, 10, 15, Some(Recorded::Ack)),
    ];
    let dead = &[(1, Final::Dead), (2, Final::Gone)];
    excused(
        &with_unseen_claims(records.clone()),
        &expect(ClaimMode::Lease, dead),
        "GroupMovedOnEarly",
        Excuse::UnseenClaim,
    );
    assert_eq!(
        judged(&history(records), &expect(ClaimMode::Lease, dead)),
        [("GroupMovedOnEarly", None), ("SettlementLost", None)]
    );
}

#[test]
fn a_published_row_never_delivered_is_lost_and_an_unpublished_one_is_named() {
    found_alone(
        &history(vec![]),
        &unordered(ClaimMode::Lease, GONE),
        "RowNeverDelivered",
    );
    found_alone(
        &history(vec![plain(2, 1, 0, 10, Some(Recorded::Ack))]),
        &unordered(ClaimMode::Lease, &[]),
        "RowNeverPublished",
    );
    // Not even a crash excuses either.
    let judged = judged(
        &with_unseen_claims(vec![plain(2, 1, 0, 10, Some(Recorded::Ack))]),
        &unordered(ClaimMode::Lease, GONE),
    );
    assert_eq!(
        judged,
        [("RowNeverDelivered", None), ("RowNeverPublished", None)]
    );
}

#[test]
fn a_first_delivery_past_attempt_one_is_excused_by_a_claim_no_one_saw() {
    let records = vec![plain(1, 2, 10, 20, Some(Recorded::Ack))];
    found_alone(
        &history(records.clone()),
        &unordered(ClaimMode::Lease, GONE),
        "FirstAttemptNotOne",
    );
    excused(
        &with_unseen_claims(records.clone()),
        &unordered(ClaimMode::Lease, GONE),
        "FirstAttemptNotOne",
        Excuse::UnseenClaim,
    );
    // Row lock counts nothing at the claim.
    found_alone(
        &with_unseen_claims(records),
        &unordered(ClaimMode::RowLock, GONE),
        "FirstAttemptNotOne",
    );
}

#[test]
fn a_finished_row_run_again_is_excused_by_a_cut_settlement_or_a_stale_row_lock_claim() {
    let acked = plain(1, 1, 0, 10, Some(Recorded::Ack));
    let run = |first: Record, second: Record| history(vec![first, second]);
    found_alone(
        &run(acked.clone(), plain(1, 2, 10, 15, Some(Recorded::Ack))),
        &unordered(ClaimMode::Lease, GONE),
        "RunAfterFinished",
    );
    excused(
        &run(
            cut(acked.clone(), Cut::ConnectionSettling),
            plain(1, 2, 10, 15, Some(Recorded::Ack)),
        ),
        &unordered(ClaimMode::Lease, GONE),
        "RunAfterFinished",
        Excuse::SettlementCut,
    );
    // Row lock: the later delivery's transaction died with its connection, so its claim read
    // the row at the same attempt before the ack, and its handler ran after.
    let stale = cut(
        plain(1, 1, 12, 15, Some(Recorded::Ack)),
        Cut::ConnectionInHandler,
    );
    excused(
        &run(acked.clone(), stale.clone()),
        &unordered(ClaimMode::RowLock, GONE),
        "RunAfterFinished",
        Excuse::StaleClaim,
    );
    // Not when a crash cut it, and not in lease mode (the lease held the row).
    found_alone(
        &run(
            acked.clone(),
            Record {
                cut: Some(Cut::CrashInHandler),
                ..stale.clone()
            },
        ),
        &unordered(ClaimMode::RowLock, GONE),
        "RunAfterFinished",
    );
    found_alone(
        &run(acked, stale),
        &unordered(ClaimMode::Lease, GONE),
        "RunAfterFinished",
    );
}

#[test]
fn a_miscounted_attempt_is_excused_by_a_rollback_or_a_claim_no_one_saw() {
    let run = |first: Record, attempt: i64| {
        history(vec![first, plain(1, attempt, 10, 15, Some(Recorded::Ack))])
    };
    let retried = plain(1, 1, 0, 10, Some(Recorded::Retry));
    // Lease counts one at every claim; a skipped attempt needs a claim no handler saw.
    found_alone(
        &run(retried.clone(), 3),
        &unordered(ClaimMode::Lease, GONE),
        "AttemptMiscounted",
    );
    let h = run(retried.clone(), 3);
    h.process_killed(9, Duration::from_millis(5), Duration::from_millis(6));
    excused(
        &h,
        &unordered(ClaimMode::Lease, GONE),
        "AttemptMiscounted",
        Excuse::UnseenClaim,
    );
    // Row lock counts a retry in its settlement; a connection kill rolls it back.
    found_alone(
        &run(retried.clone(), 1),
        &unordered(ClaimMode::RowLock, GONE),
        "AttemptMiscounted",
    );
    excused(
        &run(cut(retried.clone(), Cut::ConnectionInHandler), 1),
        &unordered(ClaimMode::RowLock, GONE),
        "AttemptMiscounted",
        Excuse::RolledBack,
    );
    // A lease claim counted the attempt before the kill: nothing rolls it back.
    found_alone(
        &run(cut(retried, Cut::ConnectionInHandler), 1),
        &unordered(ClaimMode::Lease, GONE),
        "AttemptMiscounted",
    );
}

#[test]
fn a_row_taken_from_a_crashed_lease_holder_before_its_lease_ran_out_is_cut_short() {
    let run = |start: u64| {
        let mut crashed = cut(plain(1, 1, 0, 10, None), Cut::CrashInHandler);
        crashed.lease_until = Some(Duration::from_millis(100));
        history(vec![
            crashed,
            plain(1, 2, start, start + 10, Some(Recorded::Ack)),
        ])
    };
    found_alone(
        &run(50),
        &unordered(ClaimMode::Lease, GONE),
        "LeaseCutShort",
    );
    run(100).check(&unordered(ClaimMode::Lease, GONE)).unwrap();
}

#[test]
fn an_outcome_the_database_does_not_hold_is_excused_only_by_a_claim_no_one_saw() {
    let acked = plain(1, 1, 0, 10, Some(Recorded::Ack));
    let dead = &[(1, Final::Dead)];
    found_alone(
        &history(vec![acked.clone()]),
        &unordered(ClaimMode::Lease, dead),
        "SettlementLost",
    );
    found_alone(
        &history(vec![acked.clone()]),
        &unordered(ClaimMode::Lease, &[(1, Final::Present)]),
        "SettlementLost",
    );
    // The ack was cut, and claims no handler saw spent the row's attempts.
    excused(
        &with_unseen_claims(vec![cut(acked.clone(), Cut::CrashSettling)]),
        &unordered(ClaimMode::Lease, dead),
        "SettlementLost",
        Excuse::UnseenClaim,
    );
    // An ack nothing cut must land, whatever else happened.
    found_alone(
        &with_unseen_claims(vec![acked]),
        &unordered(ClaimMode::Lease, dead),
        "SettlementLost",
    );
}

/// Reports, as the engine does, that a claim counted `attempt` of row `id` of `h`'s table and
/// ran no handler.
fn lost(h: &History, id: i64, attempt: i64) {
    crate::engine_events::observe(&EngineEvent::ClaimLost {
        table: &h.table,
        id,
        attempt,
        at: SystemTime::now(),
    });
}

#[test]
fn attempts_a_lost_claim_counted_are_excused_by_its_event_and_only_those() {
    // Attempt 2 of row 1 went to a claim whose reply came too late: the next delivery reads 3.
    let skipped = || {
        vec![
            plain(1, 1, 0, 10, Some(Recorded::Error)),
            plain(1, 3, 20, 30, Some(Recorded::Ack)),
        ]
    };
    found_alone(
        &history(skipped()),
        &unordered(ClaimMode::Lease, GONE),
        "AttemptMiscounted",
    );
    let h = history(skipped());
    lost(&h, 1, 2);
    excused(
        &h,
        &unordered(ClaimMode::Lease, GONE),
        "AttemptMiscounted",
        Excuse::LostClaim,
    );
    // A lost claim of another attempt, or of another row, excuses nothing.
    for (id, attempt) in [(1, 1), (1, 3), (2, 2)] {
        let h = history(skipped());
        lost(&h, id, attempt);
        found_alone(&h, &unordered(ClaimMode::Lease, GONE), "AttemptMiscounted");
    }
    // Two attempts skipped need both lost.
    let two_skipped = vec![
        plain(1, 1, 0, 10, Some(Recorded::Error)),
        plain(1, 4, 20, 30, Some(Recorded::Ack)),
    ];
    let h = history(two_skipped.clone());
    lost(&h, 1, 2);
    found_alone(&h, &unordered(ClaimMode::Lease, GONE), "AttemptMiscounted");
    let h = history(two_skipped);
    lost(&h, 1, 2);
    lost(&h, 1, 3);
    h.check(&unordered(ClaimMode::Lease, GONE)).unwrap();

    // The first delivery reads 2: attempt 1 was lost.
    let h = history(vec![plain(1, 2, 10, 20, Some(Recorded::Ack))]);
    lost(&h, 1, 1);
    excused(
        &h,
        &unordered(ClaimMode::Lease, GONE),
        "FirstAttemptNotOne",
        Excuse::LostClaim,
    );
}

#[test]
fn a_row_whose_last_attempts_lost_claims_counted_may_end_dead_without_a_delivery() {
    // max_attempts 3: attempt 2 retried, attempt 3 lost, and the next claim dead-lettered it.
    let records = || {
        vec![
            plain(1, 1, 0, 10, Some(Recorded::Retry)),
            plain(1, 2, 10, 20, Some(Recorded::Retry)),
        ]
    };
    let dead = &[(1, Final::Dead)];
    found_alone(
        &history(records()),
        &unordered(ClaimMode::Lease, dead),
        "SettlementLost",
    );
    let h = history(records());
    lost(&h, 1, 3);
    excused(
        &h,
        &unordered(ClaimMode::Lease, dead),
        "SettlementLost",
        Excuse::LostClaim,
    );
    // A row that should be gone is not excused by a lost claim.
    let h = history(vec![plain(1, 1, 0, 10, Some(Recorded::Ack))]);
    lost(&h, 1, 2);
    found_alone(&h, &unordered(ClaimMode::Lease, dead), "SettlementLost");
}

/// A connection kill marked while handlers start on other threads: every handler whose start
/// came before the kill's end is marked (never a start recorded before the kill that the
/// marking did not see). Eight threads start 2,000 handlers each on two cores, so some are
/// descheduled inside `start`.
#[test]
fn a_kill_marks_every_handler_that_started_before_it_ended() {
    use std::sync::Arc;
    let h = Arc::new(History::new(&crate::unique_name("unit")));
    let starters: Vec<_> = (0..8)
        .map(|t| {
            let h = h.clone();
            std::thread::spawn(move || {
                for i in 0..2_000 {
                    h.start(0, t * 10_000 + i, 1, None, None, None);
                }
            })
        })
        .collect();
    let mut missed = Vec::new();
    while !starters.iter().all(|s| s.is_finished()) {
        let from = h.now();
        h.connections_killed(0, from, h.now());
        // Every uncut record that started by the kill's start is one the marking did not see.
        missed.extend(
            h.lock()
                .iter()
                .filter(|r| r.start <= from && r.cut.is_none())
                .map(|r| (r.id, r.start, from)),
        );
    }
    for s in starters {
        s.join().unwrap();
    }
    assert!(
        missed.is_empty(),
        "{} handlers started before a kill but were not marked, e.g. {:?}",
        missed.len(),
        &missed[..missed.len().min(3)]
    );
}

#[test]
fn a_timed_out_delivery_still_running_when_its_rows_next_one_began_is_found() {
    let timed_out = plain(1, 1, 0, 10, Some(Recorded::TimedOut));
    let h = history(vec![
        timed_out.clone(),
        plain(1, 2, 5, 15, Some(Recorded::Ack)),
    ]);
    assert_eq!(
        judged(&h, &unordered(ClaimMode::Lease, GONE)),
        [("RowInTwoDeliveries", None), ("TimedOutOverlapsNext", None)]
    );
    // Dropped before the next delivery began: a failed attempt like an error.
    let h = history(vec![timed_out, plain(1, 2, 10, 15, Some(Recorded::Ack))]);
    settled(&h, 1, 1, 10);
    settled(&h, 1, 2, 16);
    let f = h.check(&unordered(ClaimMode::Lease, GONE)).unwrap();
    assert_eq!((f.retries, f.timed_out, f.acked), (1, 1, 1));
}

#[test]
fn a_cancelled_row_that_starts_again_is_found_whatever_fault_came() {
    let cancelled = plain(1, 1, 0, 10, Some(Recorded::Cancelled));
    // Deleted by its holder: one delivery, gone.
    let h = history(vec![cancelled.clone()]);
    settled(&h, 1, 1, 11);
    let f = h.check(&unordered(ClaimMode::Lease, GONE)).unwrap();
    assert_eq!(f.deliveries, 1);
    // Run again after the cancel: found, and no fault excuses it.
    let h = with_unseen_claims(vec![cancelled, plain(1, 2, 20, 30, Some(Recorded::Ack))]);
    settled(&h, 1, 2, 31);
    assert_eq!(
        judged(&h, &unordered(ClaimMode::Lease, GONE)),
        [("RunAfterCancelled", None)]
    );
}

#[test]
fn a_snooze_spends_no_attempt_and_one_that_did_is_miscounted() {
    // Row 1 snoozed twice, then failed once (max_attempts 3) and acked: attempts 1, 1, 1, 2.
    let snoozed = |after: i64| {
        vec![
            plain(1, 1, 0, 10, Some(Recorded::Snooze)),
            plain(1, 1, 20, 30, Some(Recorded::Snooze)),
            plain(1, 1, 40, 50, Some(Recorded::Error)),
            plain(1, after, 60, 70, Some(Recorded::Ack)),
        ]
    };
    for mode in [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory] {
        history(snoozed(2))
            .check(&unordered(mode, GONE))
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        // A snooze that spent its attempt: the delivery after it reads 2.
        let spent = vec![
            plain(1, 1, 0, 10, Some(Recorded::Snooze)),
            plain(1, 2, 20, 30, Some(Recorded::Ack)),
        ];
        found_alone(&history(spent), &unordered(mode, GONE), "AttemptMiscounted");
        // Three snoozes never dead-letter by max_attempts (3): the row must come back.
        let h = history(vec![
            plain(1, 1, 0, 10, Some(Recorded::Snooze)),
            plain(1, 1, 20, 30, Some(Recorded::Snooze)),
            plain(1, 1, 40, 50, Some(Recorded::Snooze)),
        ]);
        found_alone(
            &h,
            &unordered(mode, &[(1, Final::Present)]),
            "SettlementLost",
        );
    }
}

#[test]
fn a_cut_snooze_excuses_one_attempt_in_lease_and_advisory_only() {
    let after_cut_snooze = |attempt: i64| {
        vec![
            cut(
                plain(1, 1, 0, 10, Some(Recorded::Snooze)),
                Cut::ConnectionSettling,
            ),
            plain(1, attempt, 20, 30, Some(Recorded::Ack)),
        ]
    };
    for mode in [ClaimMode::Lease, ClaimMode::Advisory] {
        history(after_cut_snooze(1))
            .check(&unordered(mode, GONE))
            .unwrap();
        excused(
            &history(after_cut_snooze(2)),
            &unordered(mode, GONE),
            "AttemptMiscounted",
            Excuse::SettlementCut,
        );
        found_alone(
            &history(after_cut_snooze(3)),
            &unordered(mode, GONE),
            "AttemptMiscounted",
        );
    }
    // Row lock counts nothing for a snooze, landed or rolled back.
    history(after_cut_snooze(1))
        .check(&unordered(ClaimMode::RowLock, GONE))
        .unwrap();
    found_alone(
        &history(after_cut_snooze(2)),
        &unordered(ClaimMode::RowLock, GONE),
        "AttemptMiscounted",
    );
}

#[test]
fn row_lock_orders_a_delivery_after_a_snooze_by_its_claim() {
    // A kill began at 11 ms, while the snoozing delivery's claim was in flight (10-12 ms); the
    // next delivery's claim (15-16 ms) came after the snooze, at the same attempt. The snooze
    // left the row at its attempt, so nothing but the claims' times orders the two: the ack
    // stays last.
    let ms = Duration::from_millis;
    let h = history(vec![
        Record {
            claim: claim(ms(10), ms(12)),
            ..plain(1, 1, 12, 14, Some(Recorded::Snooze))
        },
        Record {
            claim: claim(ms(15), ms(16)),
            cut: Some(Cut::ConnectionInClaim),
            cut_from: Some(ms(11)),
            ..plain(1, 1, 16, 18, Some(Recorded::Ack))
        },
    ]);
    h.check(&unordered(ClaimMode::RowLock, GONE)).unwrap();
}
