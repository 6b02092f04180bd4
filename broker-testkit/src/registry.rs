//! The cases [`conformance_suite!`](crate::conformance_suite) stamped, as a list a program can
//! run: beside each `#[test]` the macro enters the case here, with its test path, claim mode and
//! guarantee group. The list is defined once, by the macro's lists of cases; `sqlx-broker check`
//! reads it to run the same case functions the tests run, against a user's server.
//!
//! ```text
//! // In a binary (not a test build, so no #[test] is stamped):
//! mod suite { broker_testkit::conformance_suite!(MyDb); }
//! for case in broker_testkit::registry::cases_of::<MyDb>() { /* case.run(case.path) */ }
//! ```

use std::future::Future;
use std::pin::Pin;

/// A case's future, boxed so the registry can hold cases of every shape.
pub type CaseFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// One stamped case of one test database.
pub struct Case {
    /// The [`TypeId`](std::any::TypeId) of the [`TestDb`](crate::TestDb) it was stamped for.
    pub db: fn() -> std::any::TypeId,
    /// Its test path where it was stamped (`conformance::lease::ack_deletes_the_row`).
    pub path: &'static str,
    /// The claim mode it was stamped for (`"row_lock"`, `"lease"`, `"advisory"`), `None` for a
    /// case about no one mode (see [`Case::mode`]).
    pub mode: Option<&'static str>,
    /// Its guarantee group: the file of `cases/` it is written in.
    pub group: fn() -> &'static str,
    /// Starts the case; takes its test path, which the cases that re-run their program as
    /// child processes pass on to the children.
    pub run: fn(&'static str) -> CaseFuture,
}

inventory::collect!(Case);

/// How a case run by [`Case::run_to_end`] failed.
pub enum CaseFailed {
    /// The case panicked (a failed assertion): the panic's payload.
    Panicked(Box<dyn std::any::Any + Send>),
    /// The case went over its time limit, or its task was cancelled: what happened.
    Other(String),
}

impl Case {
    /// The case's name: the last part of its test path.
    pub fn name(&self) -> &'static str {
        self.path.rsplit("::").next().unwrap_or(self.path)
    }

    /// The claim mode it runs in: the one it was stamped for, or the mode module it sits in
    /// (cases of one mode stamped without one), else `None`.
    pub fn mode(&self) -> Option<&'static str> {
        self.mode.or_else(|| {
            ["row_lock", "lease", "advisory"]
                .into_iter()
                .find(|m| self.path.split("::").any(|part| part == *m))
        })
    }

    /// Whether it is one of the long cases (stress, killed workers and connections, schedules
    /// of many brokers), which run under the long time limit.
    pub fn is_long(&self) -> bool {
        crate::__private::is_long_case(self.path)
    }

    /// Runs the case under its time limit, as its test does; `Err` says how it failed.
    ///
    /// # Errors
    /// A panic (its payload), or going over the time limit.
    pub fn run_to_end(&'static self) -> Result<(), CaseFailed> {
        crate::__private::try_run_case(self.path, (self.run)(self.path))
    }
}

/// Every case stamped for the test database `D`, ordered by test path.
pub fn cases_of<D: 'static>() -> Vec<&'static Case> {
    let id = std::any::TypeId::of::<D>();
    let mut cases: Vec<&'static Case> = inventory::iter::<Case>
        .into_iter()
        .filter(|c| (c.db)() == id)
        .collect();
    cases.sort_by_key(|c| c.path);
    cases
}
