//! The warnings a user must see even without a `tracing` subscriber: a lowered concurrency, a
//! missing claim index, rows that do not decode into the handler's type.
//!
//! Each goes three ways: a `tracing` event (as before), a line in [`Health`](crate::Health)
//! (`warnings`, `last_decode_error`) and [`Queue::warnings`](crate::Queue::warnings), and, when
//! the process has installed no `tracing` subscriber, one line on standard error the first time
//! it happens (`sqlx-broker warning: ...`). A service that installs a subscriber sees the events
//! there and nothing on standard error.

use std::cell::RefCell;
use std::future::Future;
use std::sync::Mutex;

tokio::task_local! {
    /// Warnings a backend reports while the core prepares a table (see [`collecting`]).
    static COLLECTED: RefCell<Vec<String>>;
}

/// Runs `f` (a backend's `prepare`) and returns the warnings it reported through [`report`].
pub(crate) async fn collecting<F: Future>(f: F) -> (F::Output, Vec<String>) {
    COLLECTED
        .scope(RefCell::new(Vec::new()), async {
            let out = f.await;
            (out, COLLECTED.with(|c| c.take()))
        })
        .await
}

/// Records a warning for the queue being prepared (if the core is preparing one in this task)
/// and prints it to standard error if no `tracing` subscriber is installed. The caller emits
/// its own `tracing` event.
pub(crate) fn report(table: &str, text: String) {
    print_once(table, &text);
    let _ = COLLECTED.try_with(|c| c.borrow_mut().push(text));
}

/// Prints `text` about `table` to standard error, once per process and text, if no `tracing`
/// subscriber is installed (where it would otherwise go nowhere).
pub(crate) fn print_once(table: &str, text: &str) {
    static PRINTED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    if tracing::dispatcher::has_been_set() {
        return;
    }
    let line = format!("sqlx-broker warning: table \"{table}\": {text}");
    let mut printed = PRINTED.lock().unwrap_or_else(|p| p.into_inner());
    if printed.contains(&line) {
        return;
    }
    eprintln!("{line} (install a tracing subscriber to receive these as events instead)");
    printed.push(line);
}

/// The decode failures of a queue's claimed rows, for [`Health`](crate::Health).
#[derive(Debug, Default)]
pub(crate) struct DecodeHealth {
    /// Claimed rows that did not decode since the last one that did.
    pub(crate) in_a_row: u32,
    /// The last one's error.
    pub(crate) last: Option<String>,
}

impl DecodeHealth {
    /// A claimed row decoded.
    pub(crate) fn decoded(&mut self) {
        if self.in_a_row > 0 {
            *self = Self::default();
        }
    }

    /// A claimed row did not decode.
    pub(crate) fn failed(&mut self, error: String) {
        self.in_a_row = self.in_a_row.saturating_add(1);
        self.last = Some(error);
    }
}
