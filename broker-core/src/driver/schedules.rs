//! The schedule tables ([`SCHEDULES_TABLE`], [`TICKS_TABLE`]) as every backend runs them: the
//! backend writes [`ScheduleStatements`] in its database's SQL, and the flow around them
//! (which statement runs when, what is bound, what a result means) is written once here.

use sqlx::{AssertSqlSafe, ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool};
use sqlx_core::database::HasStatementCache;

use super::on_pool::on_pool;
use crate::error::{Result, SqlxBrokerError};
use crate::schedule::ScheduleRow;
#[cfg(doc)]
use crate::schedule::{SCHEDULES_TABLE, TICKS_TABLE};

/// A value [`ScheduleStatements::raise_last_tick`] binds, for databases whose placeholders are
/// bound in the order they stand (`?`) and may need a value twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TickParam {
    /// The schedule's name.
    Name,
    /// The tick's time, unix milliseconds.
    Tick,
}

/// The statements of the schedule tables in one database's SQL. Every statement is run with the
/// backend's `prepared` setting (`persistent`), on a connection as [`on_pool`] gives it, or on
/// the connection of the transaction that publishes the tick.
///
/// A statement that reads schedules selects, in this order: the name, the queue, the
/// expression and the time zone as text, and the latest tick (unix ms, NULL for none) as a
/// 64-bit integer.
pub struct ScheduleStatements<DB: Database> {
    /// Inserts a schedule unless one of its name exists; binds the name, the queue, the
    /// expression and the time zone. It may read the stored row in the same statement; where
    /// it returns no row, [`read`](Self::read) does.
    pub register: String,
    /// Reads the schedule of a name; binds the name.
    pub read: String,
    /// Inserts a tick unless it is recorded, waiting for a transaction that is recording it;
    /// binds the name and the tick. Its count of rows changed says whether it inserted.
    pub record_tick: String,
    /// Raises the schedule's `last_tick_ms` to the tick; binds [`raise_params`](Self::raise_params).
    pub raise_last_tick: String,
    /// What [`raise_last_tick`](Self::raise_last_tick) binds, in order.
    pub raise_params: &'static [TickParam],
    /// Deletes the schedule's ticks older than a time; binds the name and the time.
    pub prune_ticks: String,
    /// Counts the tables named [`SCHEDULES_TABLE`] that the connection sees (0 or 1, as a 64-bit
    /// integer); binds the table's name.
    pub exists: String,
    /// Reads every schedule, by name.
    pub list: String,
    /// The count of rows a statement changed, from the database's result.
    pub rows_affected: fn(&DB::QueryResult) -> u64,
}

impl<DB: Database> std::fmt::Debug for ScheduleStatements<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScheduleStatements")
            .field("register", &self.register)
            .field("record_tick", &self.record_tick)
            .finish_non_exhaustive()
    }
}

/// What the tick statements other than the raise bind.
const NAME_TIME: &[TickParam] = &[TickParam::Name, TickParam::Tick];

type Row = (String, String, String, String, Option<i64>);

fn row((name, queue, expression, time_zone, last): Row) -> ScheduleRow {
    ScheduleRow::new(name, queue, expression, time_zone, last)
}

fn err(e: sqlx::Error) -> SqlxBrokerError {
    SqlxBrokerError::statement("", "schedule", e)
}

impl<DB> ScheduleStatements<DB>
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + sqlx::Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    /// Registers `s` unless a schedule of its name exists, and returns the one stored (see
    /// [`Backend::register_schedule`](super::Backend::register_schedule)).
    ///
    /// # Errors
    /// [`SqlxBrokerError::Statement`] when a statement fails.
    pub async fn register(
        &self,
        pool: &Pool<DB>,
        prepared: bool,
        s: &ScheduleRow,
    ) -> Result<ScheduleRow> {
        // Owned values: the future on the connection borrows nothing.
        let q = sqlx::query_as::<_, Row>(AssertSqlSafe(self.register.as_str()))
            .persistent(prepared)
            .bind(s.name.clone())
            .bind(s.queue.clone())
            .bind(s.expression.clone())
            .bind(s.time_zone.clone());
        let found = on_pool(pool, prepared, |c| Box::pin(q.fetch_optional(c)))
            .await
            .map_err(err)?;
        if let Some(found) = found {
            return Ok(row(found));
        }
        // The insert returns no row, or a concurrent registration committed after its snapshot:
        // read what is stored.
        let q = sqlx::query_as::<_, Row>(AssertSqlSafe(self.read.as_str()))
            .persistent(prepared)
            .bind(s.name.clone());
        on_pool(pool, prepared, |c| Box::pin(q.fetch_one(c)))
            .await
            .map(row)
            .map_err(err)
    }

    /// Records tick `tick_ms` of schedule `name` on `conn` unless it is recorded, then raises the
    /// schedule's latest tick and prunes its ticks before `prune_before_ms` (see
    /// [`Backend::record_tick`](super::Backend::record_tick)).
    ///
    /// # Errors
    /// [`SqlxBrokerError::Statement`] when a statement fails.
    pub async fn record_tick(
        &self,
        conn: &mut DB::Connection,
        prepared: bool,
        name: &str,
        tick_ms: i64,
        prune_before_ms: i64,
    ) -> Result<bool> {
        // The primary key decides: an insert of a tick another transaction is recording waits
        // for it, then inserts nothing if it committed.
        let done = self
            .run(&self.record_tick, NAME_TIME, conn, prepared, name, tick_ms)
            .await?;
        if (self.rows_affected)(&done) == 0 {
            return Ok(false);
        }
        let raise = &self.raise_last_tick;
        self.run(raise, self.raise_params, conn, prepared, name, tick_ms)
            .await?;
        self.run(
            &self.prune_ticks,
            NAME_TIME,
            conn,
            prepared,
            name,
            prune_before_ms,
        )
        .await?;
        Ok(true)
    }

    /// Runs `sql` on `conn`, binding `params` (`name`, and `ms` for a time).
    async fn run(
        &self,
        sql: &str,
        params: &[TickParam],
        conn: &mut DB::Connection,
        prepared: bool,
        name: &str,
        ms: i64,
    ) -> Result<DB::QueryResult> {
        let mut q = sqlx::query(AssertSqlSafe(sql)).persistent(prepared);
        for param in params {
            q = match param {
                TickParam::Name => q.bind(name),
                TickParam::Tick => q.bind(ms),
            };
        }
        q.execute(conn).await.map_err(err)
    }

    /// Every registered schedule, by name; empty when the table is missing (see
    /// [`Backend::schedules`](super::Backend::schedules)).
    ///
    /// # Errors
    /// [`SqlxBrokerError::Statement`] when a statement fails.
    pub async fn list(&self, pool: &Pool<DB>, prepared: bool) -> Result<Vec<ScheduleRow>> {
        let q = sqlx::query_scalar::<_, i64>(AssertSqlSafe(self.exists.as_str()))
            .persistent(prepared)
            .bind(crate::schedule::SCHEDULES_TABLE);
        if on_pool(pool, prepared, |c| Box::pin(q.fetch_one(c)))
            .await
            .map_err(err)?
            == 0
        {
            return Ok(Vec::new());
        }
        let q = sqlx::query_as::<_, Row>(AssertSqlSafe(self.list.as_str())).persistent(prepared);
        let rows = on_pool(pool, prepared, |c| Box::pin(q.fetch_all(c)))
            .await
            .map_err(err)?;
        Ok(rows.into_iter().map(row).collect())
    }
}
