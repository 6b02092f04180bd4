//! What the engine reports through `tracing`, kept for the fault injectors: the core emits a
//! `settled` debug event once a settlement has committed, and a `claimed` one for each delivery
//! a claim returns (with how long the claim took). A process-wide tracing subscriber keeps
//! those events, so a fault injector can tell, per delivery, whether its settlement was through
//! when it struck (the history checker marks only those that were not), and whether the fault
//! came while the claim that delivered it was in flight. A child process prints its settlements
//! for its parent instead (children are only ever killed whole, so their claims do not matter).

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use crate::history::unix_micros;

/// The line a child prints when a settlement went through: `@@D <table> <id> <attempt> <unix µs>`.
pub(crate) const SETTLED_LINE: &str = "@@D ";

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

static PRINT: AtomicBool = AtomicBool::new(false);

/// Starts keeping the engine's events (once per process). With `print`, this process is a
/// child: it prints each settlement as a [`SETTLED_LINE`] instead, and keeps no claims.
pub(crate) fn install(print: bool) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if print {
        PRINT.store(true, Ordering::SeqCst);
    }
    ONCE.call_once(|| {
        // Another global subscriber would hide the events: then this is a test bug.
        tracing::subscriber::set_global_default(EngineEvents::default())
            .expect("the conformance suite installs the only global tracing subscriber");
    });
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

#[derive(Default)]
struct EngineEvents {
    next_span: AtomicU64,
}

/// Which of the engine's events an event is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Settled,
    Claimed,
}

#[derive(Default)]
struct Fields {
    kind: Option<Kind>,
    table: Option<String>,
    subscription: Option<String>,
    id: Option<i64>,
    attempt: Option<i64>,
    claim_us: Option<u64>,
}

impl Visit for Fields {
    fn record_i64(&mut self, field: &Field, value: i64) {
        match field.name() {
            "id" => self.id = Some(value),
            "attempt" => self.attempt = Some(value),
            _ => {}
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "table" => self.table = Some(value.to_owned()),
            "subscription" => self.subscription = Some(value.to_owned()),
            _ => {}
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "claim_us" {
            self.claim_us = Some(value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.kind = match format!("{value:?}").as_str() {
                "settled" => Some(Kind::Settled),
                "claimed" => Some(Kind::Claimed),
                _ => None,
            };
        }
    }
}

impl Subscriber for EngineEvents {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.is_event()
            && *metadata.level() == Level::DEBUG
            && metadata.target() == "broker_core::delivery"
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let (Some(kind), Some(table_name), Some(id), Some(attempt)) =
            (f.kind, f.table, f.id, f.attempt)
        else {
            return;
        };
        let now = unix_micros();
        let print = PRINT.load(Ordering::SeqCst);
        match (kind, f.claim_us) {
            (Kind::Settled, _) if print => {
                println!("{SETTLED_LINE}{table_name} {id} {attempt} {now}");
            }
            (Kind::Settled, _) => note(&table_name, id, attempt, now),
            (Kind::Claimed, Some(took)) if !print => {
                let began = now.saturating_sub(i64::try_from(took).unwrap_or(i64::MAX));
                claimed()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry((table_name, id, attempt))
                    .or_default()
                    .push((f.subscription.unwrap_or_default(), began, now));
            }
            (Kind::Claimed, _) => {}
        }
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}
