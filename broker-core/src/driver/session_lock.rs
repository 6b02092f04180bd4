//! An advisory key held by a database session (PostgreSQL's session advisory locks, MySQL's
//! `GET_LOCK`): the lock lives as long as the session, so the key's pool connection follows the
//! delivery and never goes back to the pool while it may hold the key.

use sqlx::pool::PoolConnection;
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Type};

use super::row_tx::WarmConnections;

/// A statement on a key's lock: what the database's try-lock or unlock function returns (`V`,
/// one column), and how that reads: `Some(true)` when the session took (or freed) the lock,
/// `Some(false)` when it did not, `None` when the function said neither.
#[derive(Debug, Clone, Copy)]
pub struct LockStatement<V> {
    /// The statement; it binds the lock's name.
    pub sql: &'static str,
    /// What its value says.
    pub read: fn(V) -> Option<bool>,
}

/// What [`SessionKeyLock::try_on`] found.
#[derive(Debug)]
pub enum TryLocked<DB: Database> {
    /// The session took the key's lock.
    Locked(SessionKeyLock<DB>),
    /// Another session holds the key; the connection is kept for the next try.
    Held,
    /// The lock statement said neither (MySQL's `GET_LOCK` returns NULL on an error inside it);
    /// the connection is closed.
    Unknown,
}

/// A held key: a pool connection of its own whose session holds the key's lock.
///
/// [`unlock`](Self::unlock) frees the key and keeps the connection for the next try-lock.
/// Dropped without it, the connection is closed instead of returned to the pool, so its session
/// ends and the server frees the key; so is a connection whose statement was cut short (its
/// future dropped), whatever the session holds then.
pub struct SessionKeyLock<DB: Database> {
    /// `None` once unlocked.
    conn: Option<PoolConnection<DB>>,
    key: String,
    name: String,
    /// A statement on the connection was started and has not finished (its future was dropped):
    /// the connection is closed rather than reused.
    in_flight: bool,
}

impl<DB: Database> std::fmt::Debug for SessionKeyLock<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKeyLock")
            .field("key", &self.key)
            .field("name", &self.name)
            .field("held", &self.conn.is_some())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl<DB: Database> SessionKeyLock<DB> {
    /// The lock of `key`, which `conn`'s session holds under `name` (what the database locks:
    /// the key itself, or a name derived from it).
    pub fn new(conn: PoolConnection<DB>, key: String, name: String) -> Self {
        Self {
            conn: Some(conn),
            key,
            name,
            in_flight: false,
        }
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The name the key is held under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lock's connection, for a statement that [`finished`](Self::finished) must follow: a
    /// statement left unfinished (its future dropped) closes the connection at
    /// [`unlock`](Self::unlock).
    ///
    /// # Panics
    /// After [`unlock`](Self::unlock), which consumes the lock, it cannot be called.
    pub fn conn(&mut self) -> &mut DB::Connection {
        self.in_flight = true;
        self.conn
            .as_mut()
            .expect("a key lock keeps its connection until unlocked")
    }

    /// The statement run on [`conn`](Self::conn) has finished (whether it worked or not).
    pub fn finished(&mut self) {
        self.in_flight = false;
    }
}

/// Taking and freeing the lock: the database's statements run on the lock's connection.
impl<DB> SessionKeyLock<DB>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    /// Runs `statement` on `conn` for lock name `name`.
    async fn run<V>(
        statement: LockStatement<V>,
        conn: &mut DB::Connection,
        name: &str,
    ) -> Result<Option<bool>, sqlx::Error>
    where
        V: for<'r> Decode<'r, DB> + Type<DB> + Send + Unpin,
    {
        let got = sqlx::query_scalar::<DB, V>(sqlx::AssertSqlSafe(statement.sql))
            .bind(name)
            .fetch_one(conn)
            .await?;
        Ok((statement.read)(got))
    }

    /// Tries `name`'s lock (the name `key` is held under) with the database's try-lock
    /// statement (`lock`) on `conn`. Where another session holds the key, `conn` is kept in
    /// `warm` for the next try. Where the statement fails, is cut short or says neither, `conn`
    /// is closed (whatever its session took is freed) and every connection in `warm` goes back
    /// to the pool (the server may have dropped them all).
    ///
    /// # Errors
    /// The statement's error.
    pub async fn try_on<V>(
        conn: PoolConnection<DB>,
        warm: &WarmConnections<PoolConnection<DB>>,
        key: String,
        name: String,
        lock: LockStatement<V>,
    ) -> Result<TryLocked<DB>, sqlx::Error>
    where
        V: for<'r> Decode<'r, DB> + Type<DB> + Send + Unpin,
    {
        let mut held = Self::new(conn, key, name);
        // In flight while the statement runs: dropped midway, the lock closes the connection.
        held.in_flight = true;
        let Some(conn) = held.conn.as_mut() else {
            return Ok(TryLocked::Unknown);
        };
        let got = Self::run(lock, conn, &held.name).await;
        held.in_flight = false;
        match got {
            Ok(Some(true)) => Ok(TryLocked::Locked(held)),
            Ok(Some(false)) => {
                if let Some(conn) = held.conn.take() {
                    warm.keep(conn);
                }
                Ok(TryLocked::Held)
            }
            Ok(None) => {
                warm.release();
                Ok(TryLocked::Unknown)
            }
            Err(e) => {
                warm.release();
                Err(e)
            }
        }
    }

    /// Frees the key with the database's unlock statement (`release`) and keeps the connection
    /// in `warm` for the next try-lock. The connection is closed instead, which
    /// frees the key as well, when a statement on it was cut short, when `release` finds the
    /// key not held (it cannot be while the connection is the lock's own: a session in an
    /// unknown state is not reused), and when `release` fails or is itself cut short.
    ///
    /// # Errors
    /// The statement's error, after the connection is closed.
    pub async fn unlock<V>(
        mut self,
        warm: &WarmConnections<PoolConnection<DB>>,
        table: &str,
        release: LockStatement<V>,
    ) -> Result<(), sqlx::Error>
    where
        V: for<'r> Decode<'r, DB> + Type<DB> + Send + Unpin,
    {
        if self.in_flight {
            // Dropping the lock closes the connection.
            return Ok(());
        }
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        // The connection stays in the lock while the statement runs: dropped midway, the lock
        // closes it.
        match Self::run(release, conn, &self.name).await {
            Ok(Some(true)) => {
                if let Some(conn) = self.conn.take() {
                    warm.keep(conn);
                }
                Ok(())
            }
            Ok(Some(false) | None) => {
                tracing::warn!(
                    table,
                    key = self.key,
                    "advisory unlock found the key not held; closing its connection instead"
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

impl<DB: Database> Drop for SessionKeyLock<DB> {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            // Returned to the pool, the session (and its lock) would live on.
            conn.close_on_drop();
        }
    }
}
