//! Which settlements went through, as the engine reports them: the core emits a `settled` debug
//! event once a settlement has committed. A process-wide tracing subscriber keeps those events,
//! so a fault injector can tell, per delivery, whether its settlement was through when it struck
//! (the history checker marks only those that were not). A child process prints them for its
//! parent instead.

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

fn table() -> &'static Mutex<HashMap<Key, Vec<i64>>> {
    static SETTLED: OnceLock<Mutex<HashMap<Key, Vec<i64>>>> = OnceLock::new();
    SETTLED.get_or_init(Default::default)
}

static PRINT: AtomicBool = AtomicBool::new(false);

/// Starts keeping settlements (once per process). With `print`, this process is a child: it
/// prints each settlement as a [`SETTLED_LINE`] instead.
pub(crate) fn install(print: bool) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if print {
        PRINT.store(true, Ordering::SeqCst);
    }
    ONCE.call_once(|| {
        // Another global subscriber would hide the events: then this is a test bug.
        tracing::subscriber::set_global_default(Settlements::default())
            .expect("the conformance suite installs the only global tracing subscriber");
    });
}

/// Notes a settlement a child reported.
pub(crate) fn note(table_name: &str, id: i64, attempt: i64, micros: i64) {
    table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((table_name.to_owned(), id, attempt))
        .or_default()
        .push(micros);
}

/// When the settlements of delivery `attempt` of row `id` went through (unix µs).
pub(crate) fn settled(table_name: &str, id: i64, attempt: i64) -> Vec<i64> {
    table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(table_name.to_owned(), id, attempt))
        .cloned()
        .unwrap_or_default()
}

#[derive(Default)]
struct Settlements {
    next_span: AtomicU64,
}

#[derive(Default)]
struct Fields {
    message: bool,
    table: Option<String>,
    id: Option<i64>,
    attempt: Option<i64>,
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
        if field.name() == "table" {
            self.table = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}") == "settled";
        }
    }
}

impl Subscriber for Settlements {
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
        if let (true, Some(table_name), Some(id), Some(attempt)) =
            (f.message, f.table, f.id, f.attempt)
        {
            let now = unix_micros();
            if PRINT.load(Ordering::SeqCst) {
                println!("{SETTLED_LINE}{table_name} {id} {attempt} {now}");
            } else {
                note(&table_name, id, attempt, now);
            }
        }
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}
