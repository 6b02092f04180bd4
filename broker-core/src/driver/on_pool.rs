//! One unit of statements on a pool connection, whether the backend's statements are prepared
//! (named, cached per connection) or go unnamed behind a transaction-mode pooler.

use std::future::Future;
use std::pin::Pin;

use sqlx::{Connection as _, Database, Pool};

/// A future on a borrowed connection, as [`on_pool`] takes.
pub type ConnFuture<'c, T> = Pin<Box<dyn Future<Output = Result<T, sqlx::Error>> + Send + 'c>>;

/// Runs `f` on a connection of `pool`: as it is when statements are prepared, or inside a
/// transaction of its own when they go unnamed (behind a transaction-mode pooler). sqlx sends an
/// unnamed statement as a parse and a sync, then a bind, an execute and another sync; between
/// the two syncs a transaction-mode pooler may give the server session to another client, and
/// the bind would then meet that client's statement (seen through PgBouncer 1.18: "unnamed
/// prepared statement does not exist", "bind message supplies 3 parameters, but prepared
/// statement \"\" requires 1"). Inside a transaction the pooler keeps the session. A backend
/// whose statements are always prepared passes `true`: that is one pool connection, as running
/// the statement on the pool would take.
///
/// # Errors
/// The pool's, the transaction's or `f`'s error.
pub async fn on_pool<DB: Database, T>(
    pool: &Pool<DB>,
    prepared: bool,
    f: impl for<'c> FnOnce(&'c mut DB::Connection) -> ConnFuture<'c, T>,
) -> Result<T, sqlx::Error> {
    // Inside a fenced settlement, waited for only until its deadline (see `retry::acquire`).
    let mut conn = super::retry::acquire(pool).await?;
    if prepared {
        return f(&mut conn).await;
    }
    let mut tx = conn.begin().await?;
    let out = f(&mut tx).await?;
    tx.commit().await?;
    Ok(out)
}
