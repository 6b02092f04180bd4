//! Cross-process wake-ups with `LISTEN/NOTIFY`. A publish notifies the table's channel in the
//! statement that inserts (PostgreSQL delivers a notification when its transaction commits, so a
//! publish in a transaction that rolls back wakes nobody); each subscription listens on a
//! connection of the pool and wakes its claim loop per notification.
//!
//! Notifications can be lost (a dropped connection, a full queue): the poll stays the
//! correctness path, and a listener that reconnects wakes its subscription once to cover the gap.

use std::sync::Arc;
use std::time::Duration;

use broker_core::{Result, SqlxBrokerError, TableDescription};
use sha2::{Digest, Sha256};
use sqlx::postgres::PgListener;
use sqlx::{Acquire, PgConnection, PgPool};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// The channel of a table: `sqlx_broker_` and 16 hex digits of the SHA-256 of its name. Stable
/// across processes, and within PostgreSQL's 63-byte identifier limit whatever the name's length.
pub(crate) fn channel(table: &str) -> String {
    let digest = Sha256::digest(table.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("sqlx_broker_{hex}")
}

/// Whether two statements on one connection reach one server session. Behind a
/// transaction-mode pooler they may not, and session state (advisory locks, `LISTEN`) is lost
/// between them. Not a proof: a pooler with a single idle server connection passes.
pub(crate) async fn session_is_pinned(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    let first: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?;
    let second: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?;
    Ok(first == second)
}

/// What to say when a pooler breaks session state.
pub(crate) const POOLER_HINT: &str = "two statements on one connection reached different server sessions, as behind a transaction-mode pooler (PgBouncer pool_mode = transaction); advisory locks and LISTEN live in the session, so connect directly or through a session-mode pooler (row lock and lease mode work through any pooler)";

async fn listener(pool: &PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

/// Listens on the table's channel and starts the task that wakes `wake` per notification. The
/// first `LISTEN` runs before this returns, so a publish after it is heard.
pub(crate) async fn listen(
    pool: &PgPool,
    table: &TableDescription,
    wake: Arc<Notify>,
) -> Result<Option<JoinHandle<()>>> {
    let channel = channel(table.name());
    let err = |e| SqlxBrokerError::statement(table.name(), "listen", e);
    let mut first = listener(pool, &channel).await.map_err(err)?;
    let conn = (&mut first).acquire().await.map_err(err)?;
    if !session_is_pinned(conn).await.map_err(err)? {
        return Err(SqlxBrokerError::Unsupported {
            table: table.name().to_owned(),
            message: format!("cross-process wake-ups are off: {POOLER_HINT}"),
        });
    }
    let pool = pool.clone();
    let name = table.name().to_owned();
    Ok(Some(tokio::spawn(async move {
        let mut current = Some(first);
        let mut backoff = Duration::from_millis(250);
        loop {
            let Some(l) = current.as_mut() else {
                if pool.is_closed() {
                    return;
                }
                match listener(&pool, &channel).await {
                    Ok(l) => {
                        current = Some(l);
                        backoff = Duration::from_millis(250);
                        // Whatever was published while nobody listened is found by this wake.
                        wake.notify_one();
                    }
                    Err(sqlx::Error::PoolClosed) => return,
                    Err(e) => {
                        tracing::warn!(table = name, error = %e, "LISTEN failed; trying again (polling meanwhile)");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(30));
                    }
                }
                continue;
            };
            match l.try_recv().await {
                Ok(Some(_)) => wake.notify_one(),
                // The connection dropped and the listener reconnected: notifications in between
                // are lost, so look once.
                Ok(None) => wake.notify_one(),
                Err(sqlx::Error::PoolClosed) => return,
                Err(e) => {
                    tracing::warn!(table = name, error = %e, "LISTEN connection failed; reconnecting (polling meanwhile)");
                    current = None;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_are_stable_short_and_distinct() {
        let a = channel("jobs");
        assert_eq!(a, channel("jobs"));
        assert_ne!(a, channel("jobs2"));
        assert!(a.starts_with("sqlx_broker_"));
        assert_eq!(channel(&"x".repeat(500)).len(), "sqlx_broker_".len() + 16);
        assert!(a.len() <= 63);
    }
}
