//! Settlement statements as every backend holds them: the backend writes a
//! [`SettleStatements`] in its database's SQL, and what is common to all of them (which
//! statements a settlement runs for its [`Action`], in what order, under which names, and the
//! advisory settlement's retry on pool connections) is written once here. A backend keeps
//! binding and executing one statement, and its own transaction handling.

use std::future::Future;
use std::time::Duration;

use sqlx::query::Query;
use sqlx::{Database, Encode, Type};

use super::retry::{Classify, class_of, fenced_by};
use super::{Action, ErrorClass, Fence, Settle, clock};
use crate::error::{Result, SqlxBrokerError};

/// The statements of one mode's settlements, built once at subscribe time. `S` is the
/// backend's statement (its SQL text, or the text with what it binds).
///
/// Every statement takes the row's id and the time it writes ([`Settle::written_ms`]), then
/// the values of the settlement's [`Fence`](super::Fence); it changes one row while the fence
/// holds and none once it does not.
#[derive(Debug, Clone)]
pub struct SettleStatements<S> {
    /// Deletes the row, or sets `processed_at`.
    pub ack: S,
    /// Puts the row back, due at the time it writes (NULL: at once). `None` where a retry has
    /// nothing to write and no fence to check: the retry then holds without a statement.
    pub retry: Option<S>,
    /// Dead-letters the row.
    pub dead: DeadStatements<S>,
    /// Puts the row back due at the time it writes without spending the delivery's attempt
    /// (see [`Action::Snooze`]); `None` on a table without a due-time column, where snoozes are
    /// refused before they reach the backend.
    pub snooze: Option<S>,
    /// Deletes the row, whatever the table keeps of acked rows: an operator's cancel of a row in
    /// work ([`Action::Cancel`]), fenced as the ack is.
    pub cancel: S,
}

/// How a backend dead-letters a row.
#[derive(Debug, Clone)]
pub enum DeadStatements<S> {
    /// No target: dead letters are refused before they reach the backend.
    None,
    /// Sets the dead-letter column.
    Mark(S),
    /// Moves the row to the dead-letter table.
    Move(DeadMove<S>),
}

/// The statements that move a row to the dead-letter table, run in the order of the fields
/// ([`steps`](Self::steps)); a backend fills the steps its database needs, and runs them in a
/// transaction where there is more than one that writes.
#[derive(Debug, Clone)]
pub struct DeadMove<S> {
    /// A locking read that checks the fence and holds the row while it is copied: no row, and
    /// the move stops without changing anything ([`MoveStep::Lock`]).
    pub lock: Option<S>,
    /// Counts the attempt first, where the mode counts it at settlement (row lock): the
    /// statements that move the row cannot also update it ([`MoveStep::Count`]).
    pub count: Option<S>,
    /// Copies the row into the dead-letter table ([`MoveStep::Copy`]).
    pub copy: Option<S>,
    /// Deletes the row from the queue table; the rows it changes are the move's. Without a
    /// `copy` it moves the row in one statement, its deleted row written into the dead-letter
    /// table ([`MoveStep::Move`]); else it only deletes ([`MoveStep::Delete`]).
    pub delete: S,
}

/// A step of a [`DeadMove`], which names its statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveStep {
    /// [`DeadMove::lock`].
    Lock,
    /// [`DeadMove::count`].
    Count,
    /// [`DeadMove::copy`].
    Copy,
    /// [`DeadMove::delete`] after a copy.
    Delete,
    /// [`DeadMove::delete`] without a copy: the whole move in one statement.
    Move,
}

impl MoveStep {
    /// The statement's name, as errors and the startup check show it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lock => "dead letter lock",
            Self::Count => "dead letter count",
            Self::Copy => "dead letter copy",
            Self::Delete => "dead letter delete",
            Self::Move => "dead letter move",
        }
    }
}

impl<S> DeadMove<S> {
    /// The move's statements in the order they run.
    pub fn steps(&self) -> impl Iterator<Item = (MoveStep, &S)> {
        let last = match self.copy {
            Some(_) => MoveStep::Delete,
            None => MoveStep::Move,
        };
        [
            self.lock.as_ref().map(|s| (MoveStep::Lock, s)),
            self.count.as_ref().map(|s| (MoveStep::Count, s)),
            self.copy.as_ref().map(|s| (MoveStep::Copy, s)),
            Some((last, &self.delete)),
        ]
        .into_iter()
        .flatten()
    }
}

/// What a settlement runs, from [`SettleStatements::for_action`].
#[derive(Debug, Clone, Copy)]
pub enum Run<'a, S> {
    /// One statement, with its name; the rows it changes are the settlement's.
    One(&'static str, &'a S),
    /// No statement: the settlement holds as it is (a retry with nothing to write).
    Nothing,
    /// The steps of a move to the dead-letter table ([`DeadMove::steps`]).
    Move(&'a DeadMove<S>),
}

impl<S> SettleStatements<S> {
    /// What a settlement with `action` runs.
    ///
    /// # Panics
    /// On a dead letter without a target ([`DeadStatements::None`]): the engine refuses those
    /// before they reach the backend.
    pub fn for_action(&self, action: Action) -> Run<'_, S> {
        match action {
            Action::Ack => Run::One("ack", &self.ack),
            Action::Retry { .. } => match &self.retry {
                Some(retry) => Run::One("retry", retry),
                None => Run::Nothing,
            },
            Action::DeadLetter => match &self.dead {
                DeadStatements::Mark(mark) => Run::One("dead letter", mark),
                DeadStatements::Move(moved) => Run::Move(moved),
                DeadStatements::None => {
                    unreachable!("dead letters without a target are refused before settlement")
                }
            },
            Action::Snooze { .. } => match &self.snooze {
                Some(snooze) => Run::One("snooze", snooze),
                None => unreachable!(
                    "snoozes on a table without a due-time column are refused before settlement"
                ),
            },
            Action::Cancel => Run::One("cancel", &self.cancel),
        }
    }

    /// Every statement with its name, for the startup check: the ack, the retry, the dead
    /// letter's in the order they run, the snooze, then the cancel.
    pub fn named(&self) -> Vec<(&'static str, &S)> {
        let mut out = vec![("ack", &self.ack)];
        out.extend(self.retry.as_ref().map(|s| ("retry", s)));
        match &self.dead {
            DeadStatements::None => {}
            DeadStatements::Mark(s) => out.push(("dead letter", s)),
            DeadStatements::Move(moved) => out.extend(moved.steps().map(|(k, s)| (k.name(), s))),
        }
        out.extend(self.snooze.as_ref().map(|s| ("snooze", s)));
        out.push(("cancel", &self.cancel));
        out
    }

    /// The same statements, each turned into another form by `f` (text into a shared text,
    /// say).
    pub fn map<T>(self, mut f: impl FnMut(S) -> T) -> SettleStatements<T> {
        let dead = match self.dead {
            DeadStatements::None => DeadStatements::None,
            DeadStatements::Mark(s) => DeadStatements::Mark(f(s)),
            DeadStatements::Move(m) => DeadStatements::Move(DeadMove {
                lock: m.lock.map(&mut f),
                count: m.count.map(&mut f),
                copy: m.copy.map(&mut f),
                delete: f(m.delete),
            }),
        };
        SettleStatements {
            ack: f(self.ack),
            retry: self.retry.map(&mut f),
            dead,
            snooze: self.snooze.map(&mut f),
            cancel: f(self.cancel),
        }
    }
}

impl Settle {
    /// The time the settlement's statements write: now for an ack or a dead letter, the due
    /// time (or NULL: due at once) for a retry, the due time for a snooze.
    pub fn written_ms(&self) -> Option<i64> {
        match self.action {
            Action::Ack | Action::DeadLetter | Action::Cancel => Some(self.now_ms),
            Action::Retry { due_ms } => due_ms,
            Action::Snooze { due_ms } => Some(due_ms),
        }
    }
}

/// Binds a settlement's parameters to `query`, one of its statements, in the order the
/// statements take them: the row's id, the time it writes ([`Settle::written_ms`]), then the
/// fence's values in [`Fence`]'s order (a lease token's expiry and attempt, or the attempt the
/// take wrote; none in row lock mode).
pub fn bind_settle<'q, DB: Database>(
    query: Query<'q, DB, DB::Arguments>,
    settle: &Settle,
    fence: Fence,
) -> Query<'q, DB, DB::Arguments>
where
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    Option<i64>: for<'t> Encode<'t, DB> + Type<DB>,
{
    let query = query.bind(settle.id).bind(settle.written_ms());
    match fence {
        Fence::None => query,
        Fence::Lease(token) => query.bind(token.expires_ms).bind(token.attempt),
        Fence::Attempt(attempt) => query.bind(attempt),
    }
}

/// How long an advisory settlement whose try met a lost connection runs again on pool
/// connections. Nothing else bounds it: the key lock is gone with its session (or, on SQLite,
/// held in this process), and the fence on the attempt keeps a late try from changing a row
/// claimed again meanwhile.
pub const ADVISORY_SETTLE_RETRY: Duration = Duration::from_secs(10);

/// An advisory settlement as the backends whose key lock holds a connection run it: `on_lock`,
/// the settlement on the lock's connection, whether it changed the row; when it fails with a
/// lost connection (under the backend's `classify`), `on_pool` runs it again, fenced on the
/// attempt the take wrote, under [`settle_advisory_on_pool`].
///
/// Rows changed: `Ok`; none: the row was claimed again ([`SqlxBrokerError::ClaimLost`]).
pub async fn settle_advisory<F, Fut>(
    classify: Classify,
    table: &str,
    id: i64,
    on_lock: impl Future<Output = Result<bool>>,
    on_pool: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    match on_lock.await {
        // The key's session went away under the delivery (its key is free now): the
        // settlement is fenced on the attempt the take wrote, so it runs again on pool
        // connections for a while, and changes nothing if the row was taken again meanwhile.
        Err(e) if class_of(classify, &e) == ErrorClass::Connection => {
            settle_advisory_on_pool(classify, table, id, on_pool).await
        }
        other => settled(table, id, other?),
    }
}

/// An advisory settlement `on_pool`, whether it changed the row, run under the fenced retry
/// policy ([`fenced_by`]) for [`ADVISORY_SETTLE_RETRY`]: the second half of
/// [`settle_advisory`], and the whole of it where the key lock holds no connection.
pub async fn settle_advisory_on_pool<F, Fut>(
    classify: Classify,
    table: &str,
    id: i64,
    on_pool: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let deadline = clock::after_ms(ADVISORY_SETTLE_RETRY);
    let changed = fenced_by(classify, deadline, on_pool).await?;
    settled(table, id, changed)
}

/// A fenced settlement's outcome: it changed the row, or the row was claimed again.
fn settled(table: &str, id: i64, changed: bool) -> Result<()> {
    if changed {
        Ok(())
    } else {
        Err(SqlxBrokerError::ClaimLost {
            table: table.to_owned(),
            id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn statements(
        retry: bool,
        dead: DeadStatements<&'static str>,
    ) -> SettleStatements<&'static str> {
        SettleStatements {
            ack: "A",
            retry: retry.then_some("R"),
            dead,
            snooze: None,
            cancel: "X!",
        }
    }

    fn settle(action: Action) -> Settle {
        Settle {
            id: 1,
            action,
            now_ms: 1_000,
            attempt: 2,
        }
    }

    /// The names and statements a settlement runs, one statement or the steps of a move.
    fn runs(
        s: &SettleStatements<&'static str>,
        action: Action,
    ) -> Vec<(&'static str, &'static str)> {
        match s.for_action(action) {
            Run::One(name, stmt) => vec![(name, *stmt)],
            Run::Nothing => vec![],
            Run::Move(m) => m.steps().map(|(k, s)| (k.name(), *s)).collect(),
        }
    }

    const RETRY: Action = Action::Retry { due_ms: None };

    #[test]
    fn each_action_runs_its_own_statement() {
        let s = statements(true, DeadStatements::Mark("D"));
        assert_eq!(runs(&s, Action::Ack), [("ack", "A")]);
        assert_eq!(runs(&s, RETRY), [("retry", "R")]);
        assert_eq!(runs(&s, Action::DeadLetter), [("dead letter", "D")]);
        assert_eq!(runs(&s, Action::Cancel), [("cancel", "X!")]);
    }

    #[test]
    fn a_retry_without_a_statement_runs_nothing() {
        let s = statements(false, DeadStatements::None);
        assert!(matches!(s.for_action(RETRY), Run::Nothing));
        assert_eq!(s.named(), [("ack", &"A"), ("cancel", &"X!")]);
    }

    #[test]
    fn a_move_runs_its_steps_in_order_and_names_a_lone_delete_a_move() {
        let one = statements(
            true,
            DeadStatements::Move(DeadMove {
                lock: None,
                count: Some("C"),
                copy: None,
                delete: "M",
            }),
        );
        assert_eq!(
            runs(&one, Action::DeadLetter),
            [("dead letter count", "C"), ("dead letter move", "M")]
        );
        let four = statements(
            false,
            DeadStatements::Move(DeadMove {
                lock: Some("L"),
                count: Some("C"),
                copy: Some("P"),
                delete: "X",
            }),
        );
        assert_eq!(
            runs(&four, Action::DeadLetter),
            [
                ("dead letter lock", "L"),
                ("dead letter count", "C"),
                ("dead letter copy", "P"),
                ("dead letter delete", "X"),
            ]
        );
        assert_eq!(
            four.named(),
            [
                ("ack", &"A"),
                ("dead letter lock", &"L"),
                ("dead letter count", &"C"),
                ("dead letter copy", &"P"),
                ("dead letter delete", &"X"),
                ("cancel", &"X!"),
            ]
        );
    }

    #[test]
    fn named_lists_ack_retry_then_the_dead_letter() {
        let s = statements(
            true,
            DeadStatements::Move(DeadMove {
                lock: None,
                count: None,
                copy: Some("P"),
                delete: "X",
            }),
        );
        assert_eq!(
            s.named(),
            [
                ("ack", &"A"),
                ("retry", &"R"),
                ("dead letter copy", &"P"),
                ("dead letter delete", &"X"),
                ("cancel", &"X!"),
            ]
        );
        let mapped = s.map(str::len);
        assert_eq!(mapped.named().len(), 5);
    }

    #[test]
    #[should_panic(expected = "refused before settlement")]
    fn a_dead_letter_without_a_target_never_reaches_the_statements() {
        let _ = statements(true, DeadStatements::None).for_action(Action::DeadLetter);
    }

    #[test]
    fn a_retry_writes_its_due_time_and_the_rest_write_now() {
        assert_eq!(settle(Action::Ack).written_ms(), Some(1_000));
        assert_eq!(settle(Action::DeadLetter).written_ms(), Some(1_000));
        assert_eq!(settle(RETRY).written_ms(), None);
        assert_eq!(
            settle(Action::Retry { due_ms: Some(5) }).written_ms(),
            Some(5)
        );
    }

    fn lost() -> SqlxBrokerError {
        SqlxBrokerError::statement("jobs", "ack", sqlx::Error::PoolTimedOut)
    }

    fn by_kind(e: &sqlx::Error) -> ErrorClass {
        match e {
            sqlx::Error::PoolTimedOut => ErrorClass::Connection,
            _ => ErrorClass::Permanent,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_advisory_settlement_runs_again_on_the_pool_only_after_a_lost_connection() {
        let pool_tries = std::cell::Cell::new(0);
        let on_pool = || {
            pool_tries.set(pool_tries.get() + 1);
            async { Ok(true) }
        };
        let out = settle_advisory(by_kind, "jobs", 7, async { Err(lost()) }, on_pool).await;
        assert!(out.is_ok(), "{out:?}");
        assert_eq!(pool_tries.get(), 1);

        let out = settle_advisory(by_kind, "jobs", 7, async { Ok(false) }, on_pool).await;
        assert!(
            matches!(out, Err(SqlxBrokerError::ClaimLost { id: 7, .. })),
            "{out:?}"
        );
        let refused = SqlxBrokerError::statement("jobs", "ack", sqlx::Error::RowNotFound);
        let out = settle_advisory(by_kind, "jobs", 7, async { Err(refused) }, on_pool).await;
        assert!(
            matches!(out, Err(SqlxBrokerError::Statement { .. })),
            "{out:?}"
        );
        assert_eq!(pool_tries.get(), 1, "only a lost connection runs it again");
    }
}
