//! What the engine reports through its typed hook ([`broker_core::events`]), kept for the fault
//! injectors: the core reports a `Settled` event once a settlement has committed, and a
//! `Claimed` one for each delivery a claim returns (with when the claim began). The process's
//! observer keeps those events, so a fault injector can tell, per delivery, whether its
//! settlement was through when it struck (the history checker marks only those that were not),
//! and whether the fault came while the claim that delivered it was in flight. A `ClaimLost`
//! event (a lease claim whose reply came too late) tells the checker that an attempt was counted
//! with no handler. A child process prints its settlements and lost claims for its parent
//! instead (children are only ever killed whole, so their claims do not matter).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use broker_core::events::EngineEvent;

/// The line a child prints when a settlement went through: `@@D <table> <id> <attempt> <unix µs>`.
pub(crate) const SETTLED_LINE: &str = "@@D ";
/// The line a child prints when a claim counted an attempt that no handler runs (see
/// [`EngineEvent::ClaimLost`]): `@@L <table> <id> <attempt> <unix µs>`.
pub(crate) const LOST_LINE: &str = "@@L ";

type Key = (String, i64, i64);

type Times = Mutex<HashMap<Key, Vec<i64>>>;

/// When each delivery's settlements went through (unix µs).
fn settlements() -> &'static Times {
    static SETTLED: OnceLock<Times> = OnceLock::new();
    SETTLED.get_or_init(Default::default)
}

/// Which subscription's claims returned each delivery, when they began and when they returned
/// (unix µs).
type Claims = Mutex<HashMap<Key, Vec<(String, i64, i64)>>>;

fn claimed() -> &'static Claims {
    static CLAIMED: OnceLock<Claims> = OnceLock::new();
    CLAIMED.get_or_init(Default::default)
}

/// When claims counted each attempt that no handler runs (unix µs).
fn lost_claims() -> &'static Times {
    static LOST: OnceLock<Times> = OnceLock::new();
    LOST.get_or_init(Default::default)
}

static PRINT: AtomicBool = AtomicBool::new(false);

/// Starts keeping the engine's events (once per process). With `print`, this process is a
/// child: it prints each settlement as a [`SETTLED_LINE`] instead, and keeps no claims.
pub(crate) fn install(print: bool) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if print {
        PRINT.store(true, Ordering::SeqCst);
    }
    ONCE.call_once(|| {
        // Another observer would keep the events from this one: then this is a test bug.
        assert!(
            broker_core::events::observe(observe),
            "the conformance suite sets the only engine event observer"
        );
    });
}

/// Unix microseconds of `at`: how settlements and claims are kept, and how a child reports them.
fn micros(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// Keeps (or, in a child, prints) one engine event.
pub(crate) fn observe(event: &EngineEvent<'_>) {
    let print = PRINT.load(Ordering::SeqCst);
    match *event {
        EngineEvent::Settled {
            table,
            id,
            attempt,
            at,
        } => keep_or_print(print, SETTLED_LINE, note, (table, id, attempt, micros(at))),
        EngineEvent::ClaimLost {
            table,
            id,
            attempt,
            at,
        } => keep_or_print(
            print,
            LOST_LINE,
            note_lost,
            (table, id, attempt, micros(at)),
        ),
        EngineEvent::Claimed {
            table,
            subscription,
            id,
            attempt,
            began,
            returned,
        } if !print => {
            claimed()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry((table.to_owned(), id, attempt))
                .or_default()
                .push((subscription.to_owned(), micros(began), micros(returned)));
        }
        _ => {}
    }
}

/// Where this process keeps a delivery's event: (table, id, attempt, unix µs).
type Keep = fn(&str, i64, i64, i64);

/// Keeps a delivery's event with `keep`, or in a child prints it as a `line` for the parent.
fn keep_or_print(
    print: bool,
    line: &str,
    keep: Keep,
    (table, id, attempt, micros): (&str, i64, i64, i64),
) {
    if print {
        println!("{line}{table} {id} {attempt} {micros}");
    } else {
        keep(table, id, attempt, micros);
    }
}

/// Keeps the settlement or lost claim a child printed in `line` (a [`SETTLED_LINE`] or a
/// [`LOST_LINE`], found anywhere in it); `false` when the line is neither.
pub(crate) fn note_child_line(line: &str) -> bool {
    let lines: [(&str, Keep); 2] = [(SETTLED_LINE, note), (LOST_LINE, note_lost)];
    for (prefix, keep) in lines {
        if let Some(at) = line.find(prefix) {
            let f: Vec<&str> = line[at + prefix.len()..].split(' ').collect();
            keep(
                f[0],
                f[1].parse().expect("an id"),
                f[2].parse().expect("an attempt"),
                f[3].parse().expect("a time"),
            );
            return true;
        }
    }
    false
}

/// Notes a settlement a child reported.
pub(crate) fn note(table_name: &str, id: i64, attempt: i64, micros: i64) {
    settlements()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((table_name.to_owned(), id, attempt))
        .or_default()
        .push(micros);
}

/// Notes a claim that counted attempt `attempt` of row `id` but runs no handler (reported by
/// this process's engine or by a child).
pub(crate) fn note_lost(table_name: &str, id: i64, attempt: i64, micros: i64) {
    lost_claims()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((table_name.to_owned(), id, attempt))
        .or_default()
        .push(micros);
}

/// Every (row id, attempt) of `table_name` that a claim counted but no handler ran.
pub(crate) fn lost(table_name: &str) -> std::collections::BTreeSet<(i64, i64)> {
    lost_claims()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .keys()
        .filter(|(t, _, _)| t == table_name)
        .map(|(_, id, attempt)| (*id, *attempt))
        .collect()
}

/// What `map` holds for delivery `attempt` of row `id` of `table_name`.
fn of_delivery<V: Clone>(
    map: &Mutex<HashMap<Key, Vec<V>>>,
    table_name: &str,
    id: i64,
    attempt: i64,
) -> Vec<V> {
    map.lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(table_name.to_owned(), id, attempt))
        .cloned()
        .unwrap_or_default()
}

/// When the settlements of delivery `attempt` of row `id` went through (unix µs).
pub(crate) fn settled(table_name: &str, id: i64, attempt: i64) -> Vec<i64> {
    of_delivery(settlements(), table_name, id, attempt)
}

/// When the claims of the subscription named `subscription` (in this process) that returned
/// attempt `attempt` of row `id` began and returned (unix µs). Row lock counts no attempt at the
/// claim, so a row whose claim rolled back is claimed again at the same attempt: there may be
/// several.
pub(crate) fn claims(
    table_name: &str,
    subscription: &str,
    id: i64,
    attempt: i64,
) -> Vec<(i64, i64)> {
    of_delivery(claimed(), table_name, id, attempt)
        .into_iter()
        .filter(|(s, _, _)| s == subscription)
        .map(|(_, began, returned)| (began, returned))
        .collect()
}
