//! The one retry policy every backend runs its statements under, so a deadlock or a lost
//! connection costs the same waiting on every database. A backend passes its own
//! [`Backend::classify`](super::Backend::classify) (through a closure that finds the driver
//! error in its error type); the policy decides what runs again.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use super::ErrorClass;
use super::clock;
use crate::{Result as BrokerResult, SqlxBrokerError};

/// How a backend's `classify` sorts its driver errors (each backend exports one).
pub type Classify = fn(&sqlx::Error) -> ErrorClass;

/// The class of a broker error under a backend's `classify`: by its driver error, if it has
/// one; an error the broker made itself is permanent.
pub fn class_of(classify: Classify, error: &SqlxBrokerError) -> ErrorClass {
    error.sqlx_source().map_or(ErrorClass::Permanent, classify)
}

/// Whether a broker error is worth trying again under a backend's `classify`: one the
/// database undid, or a lost connection. What every backend's public `is_transient` answers.
pub fn is_transient(classify: Classify, error: &SqlxBrokerError) -> bool {
    class_of(classify, error) != ErrorClass::Permanent
}

/// [`transient`] for work that fails with a broker error, classified by the backend's
/// `classify`: what a backend wraps each claim statement in.
pub async fn transient_by<T, F, Fut>(classify: Classify, work: F) -> BrokerResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = BrokerResult<T>>,
{
    transient(|e: &SqlxBrokerError| class_of(classify, e), work).await
}

/// [`fenced`] for work that fails with a broker error, classified by the backend's
/// `classify`: what a backend wraps each fenced settlement and renewal in.
pub async fn fenced_by<T, F, Fut>(classify: Classify, deadline_ms: i64, work: F) -> BrokerResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = BrokerResult<T>>,
{
    fenced(
        |e: &SqlxBrokerError| class_of(classify, e),
        deadline_ms,
        work,
    )
    .await
}

/// How many times a statement the server undid runs again before its error is returned.
pub const TRANSIENT_RETRIES: u32 = 3;

/// How long before a lease's expiry a fenced settlement stops trying again after lost
/// connections: past the expiry another claim may hold the row, and the fence would refuse.
pub const LEASE_MARGIN_MS: i64 = 1_000;

/// The first pause after a lost connection; it doubles up to [`MAX_CONNECTION_BACKOFF`].
pub const FIRST_CONNECTION_BACKOFF: Duration = Duration::from_millis(50);

/// The longest pause between two tries of a fenced statement after lost connections.
pub const MAX_CONNECTION_BACKOFF: Duration = Duration::from_secs(1);

/// Runs `work` again when it fails with an error `class` calls [`ErrorClass::Transient`] (the
/// server undid it: deadlock, lock wait, SQLite busy), up to [`TRANSIENT_RETRIES`] times after a
/// pause that grows with each try, so a claim that lost a race is not reported as failed.
///
/// Only for work that a failed try leaves unchanged: one statement in autocommit, or a
/// transaction that rolled back.
pub async fn transient<T, E, F, Fut>(class: impl Fn(&E) -> ErrorClass, work: F) -> Result<T, E>
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    transient_up_to(class, TRANSIENT_RETRIES, work).await
}

/// How many times a publish on the broker's own connection runs again after the server undid
/// it. More than [`TRANSIENT_RETRIES`]: publishers of one unique key contend with each other by
/// design, so a try run again loses again more often than a claim's does (on MariaDB, eight
/// publishers of one key beside a worker that acks each row saw one try in ten deadlock, and
/// one in ten of the tries run again). With the pauses of [`transient`], a publish waits
/// 0.36 s at most before its error is returned.
pub const PUBLISH_RETRIES: u32 = 8;

/// [`transient`] with its own bound: `work` runs at most `retries` + 1 times.
pub async fn transient_up_to<T, E, F, Fut>(
    class: impl Fn(&E) -> ErrorClass,
    retries: u32,
    mut work: F,
) -> Result<T, E>
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut tries = 0;
    loop {
        match work().await {
            Err(e) if tries < retries && class(&e) == ErrorClass::Transient => {
                tries += 1;
                tracing::debug!(error = ?e, tries, "the server undid the statement; running it again");
                tokio::time::sleep(Duration::from_millis(10 * u64::from(tries))).await;
            }
            other => return other,
        }
    }
}

/// Acquires a pool connection for a statement, bounded by the deadline of the fenced
/// settlement it runs in (see [`fenced`]): past it the wait gives up with
/// [`sqlx::Error::PoolTimedOut`], which every backend's `classify` reads as a lost connection.
/// Outside a fenced settlement it is the pool's own acquire. Only the wait for a connection is
/// bounded, never a statement in flight: a statement that a loaded server answers slowly still
/// lands (and its fence decides), while a server that went away, which sqlx keeps reconnecting
/// to until the pool's acquire timeout (30 s by default), no longer holds the settlement that
/// long past its lease.
///
/// # Errors
/// The pool's error, or `PoolTimedOut` at the deadline.
pub async fn acquire<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> Result<sqlx::pool::PoolConnection<DB>, sqlx::Error> {
    by_deadline(pool.acquire()).await
}

/// `acquiring` (a wait for a connection) bounded as [`acquire`] bounds it.
async fn by_deadline<T>(
    acquiring: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    let deadline = ACQUIRE_DEADLINE
        .try_with(std::cell::Cell::get)
        .ok()
        .flatten();
    let Some(deadline_ms) = deadline else {
        return acquiring.await;
    };
    let left = deadline_ms
        .saturating_sub(clock::now_ms())
        .max(0)
        .unsigned_abs();
    match tokio::time::timeout(Duration::from_millis(left), acquiring).await {
        Ok(acquired) => acquired,
        Err(_) => {
            tracing::debug!(
                "no connection before the settlement's deadline (the server may be gone); giving up"
            );
            Err(sqlx::Error::PoolTimedOut)
        }
    }
}

/// Runs a fenced settlement or renewal `work` under [`transient`], and again on a fresh
/// connection after a lost one (an [`ErrorClass::Connection`] error), with a pause from
/// [`FIRST_CONNECTION_BACKOFF`] doubling to [`MAX_CONNECTION_BACKOFF`], while the host's clock
/// is before `deadline_ms` (a lease's expiry less a margin: past it another claim may hold the
/// row; `i64::MAX` where nothing else can take it). A pause that would end past the deadline
/// is cut short, so the last try runs at the deadline.
///
/// Each try waits for a pool connection ([`acquire`]) only until the deadline, and at least
/// [`LEASE_MARGIN_MS`] (so the last try, at the deadline, or one of a settlement begun past
/// it, still has time to find one on a server that answers): a server that went away would
/// otherwise keep each try waiting for the pool's acquire timeout (30 s by default, as sqlx
/// keeps reconnecting to a refused port), carrying the settlement that far past its lease. A
/// statement in flight is never cut.
///
/// A try whose connection was lost may have landed; the fence makes the next try change
/// nothing then. So a server restart or a killed session costs a settlement some waiting, not a
/// second run of its handler.
pub async fn fenced<T, E, F, Fut>(
    class: impl Fn(&E) -> ErrorClass,
    deadline_ms: i64,
    mut work: F,
) -> Result<T, E>
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut backoff = FIRST_CONNECTION_BACKOFF;
    loop {
        // Each try may wait for a connection until the deadline, and at least the lease
        // margin (see `acquire`).
        let now = clock::now_ms();
        let acquire_by = deadline_ms.max(now.saturating_add(LEASE_MARGIN_MS));
        let tried = ACQUIRE_DEADLINE
            .scope(
                std::cell::Cell::new(Some(acquire_by)),
                transient(&class, &mut work),
            )
            .await;
        match tried {
            Ok(_) if take_lost_reply() => {
                // A test's stand-in for a reply lost after the statement landed: run it again,
                // as after a lost connection.
                tracing::debug!(
                    "a reply was dropped on a test's request; running the fenced statement again"
                );
                mark_lost_connection();
            }
            Err(e) if class(&e) == ErrorClass::Connection => {
                mark_lost_connection();
                let left = deadline_ms.saturating_sub(clock::now_ms());
                if left <= 0 {
                    return Err(e);
                }
                // The last pause ends at the deadline rather than past it, so a settlement cut
                // again and again (a server restarting, sessions killed in a row) still gets a
                // try before its lease can be taken.
                let pause = backoff.min(Duration::from_millis(left.unsigned_abs()));
                tracing::debug!(error = ?e, ?pause, "connection lost; running the fenced statement again on a fresh connection");
                tokio::time::sleep(pause).await;
                backoff = (backoff * 2).min(MAX_CONNECTION_BACKOFF);
            }
            other => return other,
        }
    }
}

/// Runs `f` with the connections it acquires through [`acquire`] waited for only until
/// `deadline_ms` (unix ms, at least [`LEASE_MARGIN_MS`] from now): what [`fenced`] does for each
/// try, for a statement that runs once outside it (the engine's shared ack statement).
pub(crate) async fn acquiring_by<F: Future>(deadline_ms: i64, f: F) -> F::Output {
    let by = deadline_ms.max(clock::now_ms().saturating_add(LEASE_MARGIN_MS));
    ACQUIRE_DEADLINE
        .scope(std::cell::Cell::new(Some(by)), f)
        .await
}

tokio::task_local! {
    /// Set by [`fenced`] (and [`acquiring_by`]): until when [`acquire`] waits for a connection.
    static ACQUIRE_DEADLINE: std::cell::Cell<Option<i64>>;
    /// Set by [`watching_lost_connections`]: whether a fenced statement inside ran again after
    /// a lost connection.
    static LOST_CONNECTION: std::cell::Cell<bool>;
    /// Set by [`lose_replies`]: how many replies of fenced statements that worked to drop.
    static LOSE_REPLIES: std::cell::Cell<u32>;
}

fn mark_lost_connection() {
    let _ = LOST_CONNECTION.try_with(|c| c.set(true));
}

/// Whether [`lose_replies`] asks to drop this reply (and counts it).
pub(crate) fn take_lost_reply() -> bool {
    LOSE_REPLIES
        .try_with(|c| {
            let n = c.get();
            c.set(n.saturating_sub(1));
            n > 0
        })
        .unwrap_or(false)
}

/// Runs `f` and says whether a fenced statement in it ran again after a lost connection: a try
/// whose reply never came may have landed, so a fence that then refuses may be refusing the
/// settlement's own work. The engine runs lease settlements under it (in the same task, so the
/// backend's [`fenced`] calls report here) and looks at the row before it reports a refusal.
pub(crate) async fn watching_lost_connections<F: Future>(f: F) -> (F::Output, bool) {
    LOST_CONNECTION
        .scope(std::cell::Cell::new(false), async {
            let out = f.await;
            (out, LOST_CONNECTION.with(std::cell::Cell::get))
        })
        .await
}

/// For tests of what a lost reply does: runs `f` with the replies of its first `n` statements
/// that worked (fenced settlements and the engine's ack statements, in this task) treated as
/// lost after they landed, as when the connection drops between a commit and its reply. The
/// statement is then run again, as after a real lost connection. Nothing else is changed.
#[doc(hidden)]
pub async fn lose_replies<F: Future>(n: u32, f: F) -> F::Output {
    LOSE_REPLIES.scope(std::cell::Cell::new(n), f).await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn by_name(e: &&'static str) -> ErrorClass {
        match *e {
            "deadlock" => ErrorClass::Transient,
            "gone" => ErrorClass::Connection,
            _ => ErrorClass::Permanent,
        }
    }

    /// Fails with `errors` in turn, then succeeds; returns the result and how many tries ran.
    async fn run(
        errors: &[&'static str],
        fenced_until: Option<i64>,
    ) -> (Result<(), &'static str>, u32) {
        let tries = AtomicU32::new(0);
        let work = || {
            let n = tries.fetch_add(1, Ordering::SeqCst) as usize;
            let out = errors.get(n).map_or(Ok(()), |e| Err(*e));
            async move { out }
        };
        let out = match fenced_until {
            Some(deadline) => fenced(by_name, deadline, work).await,
            None => transient(by_name, work).await,
        };
        (out, tries.load(Ordering::SeqCst))
    }

    #[tokio::test(start_paused = true)]
    async fn transient_errors_run_again_a_bounded_number_of_times() {
        assert_eq!(run(&["deadlock", "deadlock"], None).await, (Ok(()), 3));
        assert_eq!(run(&["deadlock"; 4], None).await, (Err("deadlock"), 4));
        assert_eq!(run(&["constraint"], None).await, (Err("constraint"), 1));
        // Outside a fence a lost connection is not run again: the statement may have landed.
        assert_eq!(run(&["gone"], None).await, (Err("gone"), 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_publish_runs_again_up_to_its_own_bound() {
        let tries = AtomicU32::new(0);
        let work = || {
            tries.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>("deadlock") }
        };
        let out = transient_up_to(by_name, PUBLISH_RETRIES, work).await;
        assert_eq!(out, Err("deadlock"));
        assert_eq!(tries.load(Ordering::SeqCst), PUBLISH_RETRIES + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn fenced_work_runs_again_after_lost_connections_until_its_deadline() {
        assert_eq!(
            run(&["gone", "deadlock", "gone"], Some(i64::MAX)).await,
            (Ok(()), 4)
        );
        assert_eq!(
            run(&["gone", "constraint"], Some(i64::MAX)).await,
            (Err("constraint"), 2)
        );
        // A deadline already past: the lost connection is the answer.
        assert_eq!(run(&["gone"], Some(0)).await, (Err("gone"), 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_that_would_cross_the_deadline_ends_at_it_for_a_last_try() {
        // Doubling from 50 ms, the fifth pause (800 ms) would end past a deadline 1 s away; it
        // is cut short and the work runs again. (Paused time: the pauses take no wall time, so
        // the host's clock stays before the deadline here.)
        let deadline = clock::now_ms() + 1_000;
        assert_eq!(run(&["gone"; 6], Some(deadline)).await, (Ok(()), 7));
    }

    /// A wait for a connection to a server that went away: sqlx keeps reconnecting until the
    /// pool's acquire timeout.
    async fn connection_of_a_gone_server() -> Result<(), sqlx::Error> {
        std::future::pending().await
    }

    #[tokio::test]
    async fn a_settlement_waits_for_a_connection_only_until_its_deadline() {
        let tries = AtomicU32::new(0);
        let work = || {
            tries.fetch_add(1, Ordering::SeqCst);
            async {
                by_deadline(connection_of_a_gone_server())
                    .await
                    .map_err(|e| match e {
                        sqlx::Error::PoolTimedOut => "gone",
                        _ => "other",
                    })
            }
        };
        // Real time: the deadline is on the host's clock, so the test must not pause tokio's
        // (a paused clock runs the retries' sleeps at once while the host's clock stands
        // still, and the bound below would pass first on a busy machine). The bound is an
        // hour's tenth: generous, yet a wait that ignored the deadline would hit it.
        let deadline = clock::now_ms() + 200;
        let out =
            tokio::time::timeout(Duration::from_secs(360), fenced(by_name, deadline, work)).await;
        assert_eq!(out, Ok(Err("gone")), "the wait must end at the deadline");
        assert!(tries.load(Ordering::SeqCst) >= 1);
    }

    #[tokio::test(start_paused = true)]
    async fn outside_a_settlement_the_pools_own_wait_applies() {
        let waited = tokio::time::timeout(
            Duration::from_secs(3600),
            by_deadline(connection_of_a_gone_server()),
        )
        .await;
        assert!(waited.is_err(), "{waited:?}");
    }
}
