//! The PostgreSQL backend: connection, preparation, publish, and row inspection.

use std::str::FromStr;
use std::sync::Arc;

use broker_core::driver::{ClaimedRow, Prepared, PublishPlan, ScheduleRow, connect};
use broker_core::{
    Backend, Broker, Capabilities, ClaimMode, ColumnType, DeadLetter, ModeColumns, NewJob,
    Published, Result, RowState, SqlxBrokerError, TableDescription, Value,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool, Postgres, Row};

use crate::advisory::PgAdvisory;
use crate::lease::PgLease;
use crate::listener::Listener;
use crate::row_lock::PgRowLock;
use crate::sql::{ident, ms, on_pool, ts};
use crate::stats::StatsWatch;
use crate::{notify, schema, version};

/// How many times a keyed insert runs when each conflicting row is gone by the time it is read.
const UNIQUE_TRIES: usize = 5;

/// A broker on PostgreSQL.
pub type PgBroker = Broker<PgBackend>;

/// The PostgreSQL backend: row lock, lease and advisory modes, with `LISTEN/NOTIFY` wake-ups
/// across processes.
#[derive(Debug, Clone)]
pub struct PgBackend {
    pool: PgPool,
    notifier: Arc<notify::Notifier>,
    /// The one `LISTEN` connection every subscription of this backend shares.
    listener: Arc<Listener>,
    /// Whether the pool reaches the server through a transaction-mode pooler: set by
    /// [`behind_transaction_pooler`](Self::behind_transaction_pooler), or found out once, at the
    /// first prepare.
    pooled: Arc<std::sync::OnceLock<bool>>,
    /// Whether queues prepared from now on analyze their table when a burst left its
    /// statistics stale (see [`analyze_stale_tables`](Self::analyze_stale_tables)).
    analyze_stale: bool,
}

impl PgBackend {
    /// A backend on an existing pool. Size the pool above the concurrency of its subscriptions:
    /// row lock and advisory deliveries each hold a connection while in work. Wake-ups from
    /// other processes arrive on one `LISTEN` connection that every subscription of this backend
    /// shares; it is opened with the pool's connect options but outside the pool, so it takes
    /// none of the pool's connections (it is one more server connection per backend).
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            notifier: Arc::default(),
            listener: Arc::new(Listener::new()),
            pooled: Arc::default(),
            analyze_stale: true,
        }
    }

    /// Whether a queue analyzes its table when a burst has left the table's statistics stale
    /// (on unless switched off here; the switch applies to queues prepared after it).
    ///
    /// PostgreSQL plans from the row count its last vacuum or analyze recorded. An autovacuum
    /// that finds a queue nearly drained records a handful of rows; if a burst then fills the
    /// table before the next analyze (up to `autovacuum_naptime`, a minute by default), the
    /// planner reads and sorts the whole table for every claim instead of reading the claim
    /// index (40-48 ms a claim on 93,000 rows, against well under a millisecond). So after a
    /// claim that found rows and took 5 ms or more, each queue checks (at most once a second)
    /// whether the recorded count is under a tenth of the live rows PostgreSQL counts (`pg_stat_user_tables.n_live_tup`, at least
    /// 10,000 of them) and then runs `ANALYZE` on the table (with `SKIP_LOCKED` on PostgreSQL 12
    /// and newer, so it never waits for a vacuum). The check is one catalog read in a task of its
    /// own; no claim waits for it. It needs a role that may analyze the table (its owner, a
    /// member of the owner role, or the database owner); for another role it logs once and
    /// stops checking.
    #[must_use]
    pub fn analyze_stale_tables(self, on: bool) -> Self {
        Self {
            analyze_stale: on,
            ..self
        }
    }

    /// Says that the pool reaches PostgreSQL through a transaction-mode pooler (PgBouncer
    /// `pool_mode = transaction`, Supavisor or pgcat in transaction mode), where a connection's
    /// transactions may run on different server sessions:
    /// - statements are sent unnamed, as the pooler passes them through (sqlx names and caches
    ///   prepared statements per connection, and a named statement prepared on one server session
    ///   is missing, or already taken, on the next);
    /// - wake-ups from other processes are off (`LISTEN` needs a session): subscriptions find
    ///   their rows at the poll interval, and a publish in this process still wakes them at once;
    /// - advisory tables are refused (session locks need a session); row lock and lease work.
    ///
    /// Without this setting the backend checks at the first prepare whether two connections share
    /// a server session (a pooler reuses the session a client just left), and behaves as above
    /// when they do. Setting it saves that check and makes the choice explicit.
    #[must_use]
    pub fn behind_transaction_pooler(self) -> Self {
        let pooled = Arc::new(std::sync::OnceLock::new());
        let _ = pooled.set(true);
        Self { pooled, ..self }
    }

    /// Whether any session holds the advisory key `key` in the pool's database now (`pg_locks`),
    /// on any broker or process. Asked on a connection of its own, opened with the pool's
    /// options, so the probe never waits for a pool whose connections all hold keys.
    pub async fn is_key_held(&self, key: &str) -> Result<bool> {
        let err = |e| SqlxBrokerError::statement("", "key probe", e);
        let mut conn = PgConnection::connect_with(&self.pool.connect_options())
            .await
            .map_err(err)?;
        // Behind a transaction-mode pooler the server session is shared: a named statement
        // would clash with another client's of the same name, and an unnamed one is parsed and
        // run in two exchanges (sqlx syncs after the parse), which the pooler may send to two
        // server sessions ("unnamed prepared statement does not exist"). A transaction keeps
        // both on one.
        let prepared = self.prepared();
        let probe = async {
            let mut tx = conn.begin().await?;
            let held = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_locks AS l \
                 WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
                 AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database()) \
                 AND ((l.classid::int8 << 32) | l.objid::int8) = hashtextextended($1, 0))",
            )
            .persistent(prepared)
            .bind(key)
            .fetch_one(&mut *tx)
            .await?;
            tx.rollback().await?;
            Ok::<bool, sqlx::Error>(held)
        };
        let held = probe.await.map_err(err);
        let _ = conn.close().await;
        held
    }

    /// Whether statements go prepared under a name: not behind a transaction-mode pooler.
    fn prepared(&self) -> bool {
        !self.pooled.get().copied().unwrap_or(false)
    }

    /// Finds out, once, whether the pool is behind a transaction-mode pooler.
    async fn detect_pooler(&self, table: &str) -> Result<bool> {
        if let Some(p) = self.pooled.get() {
            return Ok(*p);
        }
        let pooled = notify::transaction_pooled(&self.pool)
            .await
            .map_err(|e| SqlxBrokerError::statement(table, "pooler check", e))?;
        if pooled {
            tracing::warn!(
                table,
                "two connections share a server session: a transaction-mode pooler; statements go unnamed, wake-ups poll, and advisory tables are refused (say so with PgBackend::behind_transaction_pooler to skip this check)"
            );
        }
        Ok(*self.pooled.get_or_init(|| pooled))
    }

    /// Opens a pool of up to 16 connections on `url` (e.g.
    /// `postgres://app@localhost/app?application_name=worker`) and returns a broker on it.
    ///
    /// The URL must be a `postgres://` or `postgresql://` one. One connection is opened first,
    /// so a wrong port, host or password fails within seconds with its cause
    /// ([`SqlxBrokerError::Connect`]) instead of after the pool's 30 s acquire timeout.
    pub async fn connect(url: &str) -> Result<PgBroker> {
        const DB: &str = "PostgreSQL";
        connect::check_scheme(url, DB, false)?;
        let options =
            PgConnectOptions::from_str(url).map_err(|e| SqlxBrokerError::connect(DB, e))?;
        connect::first_connection(&options, DB).await?;
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(options)
            .await
            .map_err(|e| SqlxBrokerError::connect(DB, e))?;
        Ok(Broker::owning_pool(Self::new(pool)))
    }
}

/// attempt, locked_until, due_at, processed, dead.
type StateRow = (i64, Option<i64>, Option<i64>, bool, bool);

/// Reads the broker's columns of a claimed row.
pub(crate) fn claimed(
    row: PgRow,
    key: Option<String>,
) -> Result<ClaimedRow<Postgres>, sqlx::Error> {
    ClaimedRow::read(row, key)
}

async fn acquire(pool: &PgPool, table: &str) -> Result<sqlx::pool::PoolConnection<Postgres>> {
    pool.acquire()
        .await
        .map_err(|e| SqlxBrokerError::statement(table, "acquire", e))
}

/// How a published value reaches its column: every placeholder is cast, so the statement's
/// types never depend on the bound values (NULL included).
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// Text (the group).
    Text,
    /// An integer (the priority).
    Int,
    /// A host time in unix ms (the due time).
    Time,
    /// A declared column: bound as text and cast to its type.
    Declared(&'static str),
}

impl Slot {
    fn sql(self, n: usize) -> String {
        match self {
            Self::Text => format!("${n}::text"),
            Self::Int => format!("${n}::int8"),
            Self::Time => ts(&format!("${n}")),
            Self::Declared(ty) => format!("CAST(${n}::text AS {ty})"),
        }
    }
}

fn as_text(v: Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::Text(s) => Some(s),
        Value::BigInt(i) => Some(i.to_string()),
    }
}

fn as_int(v: Value) -> Option<i64> {
    match v {
        Value::Null => None,
        Value::Text(s) => s.trim().parse().ok(),
        Value::BigInt(i) => Some(i),
    }
}

/// The slot of each column of a publish plan after the payload.
fn slots(table: &TableDescription, plan: &PublishPlan) -> Vec<Slot> {
    plan.columns()[1..]
        .iter()
        .map(|c| {
            if Some(c.as_str()) == table.group() {
                Slot::Text
            } else if Some(c.as_str()) == table.priority() {
                Slot::Int
            } else if Some(c.as_str()) == table.due_at() {
                Slot::Time
            } else {
                let ty = table
                    .columns()
                    .iter()
                    .find(|(d, _)| d == c)
                    .map_or(ColumnType::Text, |(_, ty)| *ty);
                Slot::Declared(schema::column_type(ty))
            }
        })
        .collect()
}

/// A publish to a FIFO table in lease or advisory mode holds the guard of each group it
/// publishes to, shared, from before its rows take their ids until its transaction ends (the
/// caller's, or one of the publish's own: an insert on its own would take its ids before any
/// guard, so outside the caller's transaction a publish to such groups runs in a transaction
/// too). Its rows take their ids now but are seen only once it commits; meanwhile a claim could
/// take a later row of the group, and these rows would then become the group's head while that
/// row is still in work (two rows of one group in work, out of id order). Claims try each
/// group's guard exclusively and skip a group whose guard they cannot take, so they leave the
/// group alone until the rows are seen. A claim holds the guard only for its own statement in
/// these modes, so the publish waits at most that long. Row lock is left out: its deliveries hold
/// the guard for as long as they run, which is what keeps its groups one row at a time already,
/// and a publish must not wait for a handler.
async fn hold_group_guards(
    conn: &mut PgConnection,
    table: &TableDescription,
    groups: &[&str],
    prepared: bool,
) -> Result<(), sqlx::Error> {
    if groups.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "SELECT pg_advisory_xact_lock_shared(hashtextextended($1::text || g, 0)) \
         FROM unnest($2::text[]) AS g",
    )
    .persistent(prepared)
    .bind(crate::fifo::guard_prefix(table))
    .bind(groups)
    .execute(&mut *conn)
    .await
    .map(drop)
}

/// The groups whose guards a publish of `jobs` must hold (see [`hold_group_guards`]), sorted
/// and without repeats: none unless `table` has FIFO groups in lease or advisory mode.
fn guarded_groups<'j, P>(table: &TableDescription, jobs: &'j [NewJob<P>]) -> Vec<&'j str> {
    if !table.fifo() || table.group().is_none() || table.mode() == ClaimMode::RowLock {
        return Vec::new();
    }
    let mut groups: Vec<&str> = jobs.iter().filter_map(NewJob::group_value).collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

async fn publish_chunk<P>(
    conn: &mut PgConnection,
    table: &TableDescription,
    plan: &PublishPlan,
    slots: &[Slot],
    channel: Option<&str>,
    prepared: bool,
    jobs: &[NewJob<P>],
) -> Result<Vec<i64>, sqlx::Error>
where
    P: for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres> + Send + Sync,
{
    // $1 is the channel; each row's values follow, payload first.
    let mut n = 1;
    let rows: Vec<String> = jobs
        .iter()
        .map(|_| {
            n += 1;
            let mut row = vec![format!("${n}")];
            for slot in slots {
                n += 1;
                row.push(slot.sql(n));
            }
            format!("({})", row.join(", "))
        })
        .collect();
    let id = ident(table.id());
    let cols = plan
        .columns()
        .iter()
        .map(|c| ident(c))
        .collect::<Vec<_>>()
        .join(", ");
    let t = ident(table.name());
    let rows = rows.join(", ");
    // With a channel, the notification rides in the statement that inserts: PostgreSQL sends it
    // when the insert's transaction commits, and never when it rolls back. `$1` is bound either
    // way, so the parameter numbers do not depend on it.
    let sql = match channel {
        Some(_) => format!(
            "WITH sqlx_broker_ins AS (INSERT INTO {t} ({cols}) VALUES {rows} RETURNING {id}), \
             sqlx_broker_wake AS (SELECT pg_notify($1::text, '')) \
             SELECT sqlx_broker_ins.{id}::int8 FROM sqlx_broker_ins CROSS JOIN sqlx_broker_wake ORDER BY 1"
        ),
        None => format!(
            "WITH sqlx_broker_ins AS (INSERT INTO {t} ({cols}) VALUES {rows} RETURNING {id}) \
             SELECT sqlx_broker_ins.{id}::int8 FROM sqlx_broker_ins WHERE $1::text IS NULL ORDER BY 1"
        ),
    };
    let mut q = sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
        .persistent(prepared)
        .bind(channel);
    for job in jobs {
        q = q.bind(job.payload());
        for (value, slot) in plan.values(job).into_iter().zip(slots) {
            q = match slot {
                Slot::Text | Slot::Declared(_) => q.bind(as_text(value)),
                Slot::Int | Slot::Time => q.bind(as_int(value)),
            };
        }
    }
    q.fetch_all(&mut *conn).await
}

impl Backend for PgBackend {
    type Db = Postgres;

    type Admin<'a> = crate::admin::PgAdmin<'a>;

    fn admin(&self) -> Self::Admin<'_> {
        crate::admin::PgAdmin {
            pool: &self.pool,
            prepared: self.prepared(),
        }
    }

    type RowLock = PgRowLock;
    type Lease = PgLease;
    type Advisory = PgAdvisory;

    fn classify(&self, error: &sqlx::Error) -> broker_core::driver::ErrorClass {
        crate::sql::classify(error)
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::default_for("PostgreSQL");
        caps.row_lock = true;
        caps.process_local_keys = false;
        // LISTEN needs a session of its own.
        caps.cross_process_wakeups = self.prepared();
        caps
    }

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn check_names(&self, table: &TableDescription) -> Result<()> {
        // NAMEDATALEN - 1: PostgreSQL cuts longer identifiers to 63 bytes with only a notice.
        table.check_name_lengths("PostgreSQL", 63, "bytes", str::len)
    }

    async fn payload_probe(&self, table: &TableDescription) -> Option<PgRow> {
        let (payload, _) = table.payload()?;
        let sql = broker_core::driver::payload_probe_sql(&ident(table.name()), &ident(payload));
        // The simple protocol: no statement to name, so it passes through any pooler.
        sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await
            .ok()
            .flatten()
    }

    async fn prepare(&self, table: &Arc<TableDescription>) -> Result<Prepared<Self>> {
        let pooled = self.detect_pooler(table.name()).await?;
        let prepared = !pooled;
        if pooled && table.mode() == ClaimMode::Advisory {
            return Err(SqlxBrokerError::Unsupported {
                table: table.name().to_owned(),
                message: format!("advisory mode is refused: {}", notify::POOLER_HINT),
            });
        }
        let mut conn = acquire(&self.pool, table.name()).await?;
        // The simple protocol: no parameters, one message, through any pooler.
        let (num, text): (String, String) = sqlx::raw_sql(
            "SELECT current_setting('server_version_num'), current_setting('server_version')",
        )
        .fetch_one(&mut *conn)
        .await
        .and_then(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .map_err(|e| SqlxBrokerError::statement(table.name(), "version", e))?;
        let version = version::check(&num, &text)?;
        let columns = schema::table_columns(&mut conn, table, prepared).await?;
        let stats = StatsWatch::new(self.pool.clone(), table.name(), version);
        let stats = Arc::new(if self.analyze_stale {
            stats
        } else {
            stats.switched_off()
        });
        let strategy = match table.mode_columns() {
            ModeColumns::RowLock => {
                let mut s = PgRowLock::new(self.pool.clone(), table.clone(), &columns, stats);
                if pooled {
                    s = s.unprepared();
                } else if version >= version::CHAIN {
                    s = s.chained();
                }
                schema::check(&mut conn, table, &s.statements(), prepared).await?;
                Prepared::RowLock(s)
            }
            ModeColumns::Lease { locked_until } => {
                let mut s = PgLease::new(
                    self.pool.clone(),
                    table.clone(),
                    locked_until,
                    &columns,
                    stats,
                );
                if pooled {
                    s = s.unprepared();
                }
                schema::check(&mut conn, table, &s.statements(), prepared).await?;
                Prepared::Lease(s)
            }
            ModeColumns::Advisory { key } => {
                let s = PgAdvisory::new(self.pool.clone(), table.clone(), key, &columns, stats);
                schema::check(&mut conn, table, &s.statements(), prepared).await?;
                let pinned = notify::session_is_pinned(&mut conn)
                    .await
                    .map_err(|e| SqlxBrokerError::statement(table.name(), "session check", e))?;
                if !pinned {
                    return Err(SqlxBrokerError::Unsupported {
                        table: table.name().to_owned(),
                        message: format!("advisory mode is refused: {}", notify::POOLER_HINT),
                    });
                }
                Prepared::Advisory(s)
            }
            other => {
                return Err(SqlxBrokerError::mode_not_offered(
                    table.name(),
                    other.mode(),
                    self.capabilities().database,
                ));
            }
        };
        // Only after the table check: a missing table has no indexes to advise on.
        broker_core::driver::indexes::warn(
            table.name(),
            schema::index_advice(&mut conn, table, prepared).await,
        );
        Ok(strategy)
    }

    async fn publish<'c, P>(
        &self,
        conn: &'c mut PgConnection,
        table: &TableDescription,
        jobs: &[NewJob<P>],
    ) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres> + Send + Sync,
    {
        let plan = PublishPlan::new(table, jobs)?;
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let slots = slots(table, &plan);
        let notifier = self.notifier.table(&self.pool, table.name());
        // Inside the caller's transaction the insert may carry the notification (see
        // `notify`); on its own, it commits at once and the notifier follows it.
        let in_caller_tx = conn.is_in_transaction();
        let channel = (in_caller_tx && notifier.take_leading_edge()).then(|| notifier.channel());
        let err = |e| SqlxBrokerError::statement(table.name(), "publish", e);
        // Stay well under PostgreSQL's 65535 bound parameters per statement.
        let per_statement = (60_000 / plan.width()).clamp(1, 1000);
        let prepared = self.prepared();
        let groups = guarded_groups(table, jobs);
        if in_caller_tx {
            hold_group_guards(conn, table, &groups, prepared)
                .await
                .map_err(err)?;
        }
        let alone =
            jobs.len() <= per_statement && (in_caller_tx || (prepared && groups.is_empty()));
        let ids = if alone {
            publish_chunk(conn, table, &plan, &slots, channel, prepared, jobs)
                .await
                .map_err(err)?
        } else {
            // Unnamed statements outside a transaction would lose their session between parse
            // and execution behind a transaction-mode pooler (see `sql::on_pool`).
            // Several statements: one transaction (a savepoint inside the caller's), so the
            // batch lands whole or not at all. Outside the caller's transaction it takes the
            // groups' guards first.
            let mut tx = conn.begin().await.map_err(err)?;
            if !in_caller_tx {
                hold_group_guards(&mut tx, table, &groups, prepared)
                    .await
                    .map_err(err)?;
            }
            let mut ids = Vec::with_capacity(jobs.len());
            for (i, chunk) in jobs.chunks(per_statement).enumerate() {
                let channel = channel.filter(|_| i == 0);
                ids.extend(
                    publish_chunk(&mut tx, table, &plan, &slots, channel, prepared, chunk)
                        .await
                        .map_err(err)?,
                );
            }
            tx.commit().await.map_err(err)?;
            ids
        };
        if in_caller_tx {
            notifier.poke_after_window();
        } else {
            notifier.poke();
        }
        Ok(ids)
    }

    async fn publish_unique<'c, P>(
        &self,
        conn: &'c mut PgConnection,
        table: &TableDescription,
        job: &NewJob<P>,
    ) -> Result<Published>
    where
        P: for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres> + Send + Sync,
    {
        let plan = PublishPlan::new(table, std::slice::from_ref(job))?;
        let (Some(column), Some(key)) = (table.unique_key(), job.unique_key_value()) else {
            let ids = self.publish(conn, table, std::slice::from_ref(job)).await?;
            let id = ids.first().copied().unwrap_or_default();
            return Ok(Published {
                id,
                duplicate: false,
            });
        };
        let err = |e| SqlxBrokerError::statement(table.name(), "publish unique", e);
        let slots = slots(table, &plan);
        let mut values = vec!["$1".to_owned()];
        values.extend(slots.iter().enumerate().map(|(i, slot)| slot.sql(i + 2)));
        // No conflict target: DO NOTHING covers the partial unique index over unfinished rows,
        // and a duplicate is a statement that inserts nothing, not an error that would abort
        // the caller's transaction. A concurrent insert of the key waits for its transaction.
        let insert = format!(
            "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT DO NOTHING RETURNING {}::int8",
            ident(table.name()),
            plan.columns()
                .iter()
                .map(|c| ident(c))
                .collect::<Vec<_>>()
                .join(", "),
            values.join(", "),
            ident(table.id()),
        );
        let unfinished: String = table
            .unfinished_columns()
            .into_iter()
            .map(|c| format!(" AND {} IS NULL", ident(c)))
            .collect();
        // A statement of its own, so it reads the conflicting row that the insert waited for
        // (at READ COMMITTED each statement sees what committed before it began).
        let existing = format!(
            "SELECT {}::int8 FROM {} WHERE {} = $1::text{unfinished} LIMIT 1",
            ident(table.id()),
            ident(table.name()),
            ident(column),
        );
        let prepared = self.prepared();
        let in_caller_tx = conn.is_in_transaction();
        // Unnamed statements outside a transaction would lose their session behind a
        // transaction-mode pooler (see `sql::on_pool`).
        let tries = async |conn: &mut PgConnection| -> Result<Option<Published>> {
            // The conflicting row may finish between the two statements; then the insert runs
            // again.
            for _ in 0..UNIQUE_TRIES {
                let mut q = sqlx::query_scalar::<_, i64>(AssertSqlSafe(insert.clone()))
                    .persistent(prepared)
                    .bind(job.payload());
                for (value, slot) in plan.values(job).into_iter().zip(&slots) {
                    q = match slot {
                        Slot::Text | Slot::Declared(_) => q.bind(as_text(value)),
                        Slot::Int | Slot::Time => q.bind(as_int(value)),
                    };
                }
                if let Some(id) = q.fetch_optional(&mut *conn).await.map_err(err)? {
                    return Ok(Some(Published {
                        id,
                        duplicate: false,
                    }));
                }
                let found = sqlx::query_scalar::<_, i64>(AssertSqlSafe(existing.clone()))
                    .persistent(prepared)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(err)?;
                if let Some(id) = found {
                    return Ok(Some(Published {
                        id,
                        duplicate: true,
                    }));
                }
            }
            Ok(None)
        };
        // FIFO groups in lease or advisory mode: the group's guard from before the id is taken
        // (see `hold_group_guards`).
        let groups = guarded_groups(table, std::slice::from_ref(job));
        let done = if !in_caller_tx && (!prepared || !groups.is_empty()) {
            // Unnamed statements outside a transaction would lose their session behind a
            // transaction-mode pooler (see `sql::on_pool`).
            let mut tx = conn.begin().await.map_err(err)?;
            hold_group_guards(&mut tx, table, &groups, prepared)
                .await
                .map_err(err)?;
            let done = tries(&mut tx).await?;
            tx.commit().await.map_err(err)?;
            done
        } else {
            hold_group_guards(conn, table, &groups, prepared)
                .await
                .map_err(err)?;
            tries(conn).await?
        };
        let done = done.ok_or_else(|| SqlxBrokerError::Invariant {
            table: table.name().to_owned(),
            statement: "publish unique",
            what: format!("the key \"{key}\" conflicted {UNIQUE_TRIES} times with a row that was gone when read; at REPEATABLE READ or SERIALIZABLE a transaction does not see rows committed after it began, so publish unique jobs from a READ COMMITTED one"),
        })?;
        if !done.duplicate {
            let notifier = self.notifier.table(&self.pool, table.name());
            if in_caller_tx {
                notifier.poke_after_window();
            } else {
                notifier.poke();
            }
        }
        Ok(done)
    }

    async fn register_schedule(&self, row: &ScheduleRow) -> Result<ScheduleRow> {
        crate::schedule::STATEMENTS
            .register(&self.pool, self.prepared(), row)
            .await
    }

    async fn record_tick(
        &self,
        conn: &mut PgConnection,
        name: &str,
        tick_ms: i64,
        prune_before_ms: i64,
    ) -> Result<bool> {
        crate::schedule::STATEMENTS
            .record_tick(conn, self.prepared(), name, tick_ms, prune_before_ms)
            .await
    }

    async fn schedules(&self) -> Result<Vec<ScheduleRow>> {
        crate::schedule::STATEMENTS
            .list(&self.pool, self.prepared())
            .await
    }

    async fn row_state(&self, table: &TableDescription, id: i64) -> Result<Option<RowState>> {
        let time = |c: Option<&str>| c.map_or("NULL::int8".to_owned(), |c| ms(&ident(c)));
        let is_set =
            |c: Option<&str>| c.map_or("FALSE".to_owned(), |c| format!("{} IS NOT NULL", ident(c)));
        let dead_col = match table.dead_letter() {
            Some(DeadLetter::Column(c)) => Some(c.as_str()),
            _ => None,
        };
        let sql = format!(
            "SELECT {}::int8, {}, {}, {}, {} FROM {} WHERE {} = $1::int8",
            ident(table.attempt()),
            time(table.locked_until()),
            time(table.due_at()),
            is_set(table.processed_at()),
            is_set(dead_col),
            ident(table.name()),
            ident(table.id()),
        );
        let err = |e| SqlxBrokerError::statement(table.name(), "row state", e);
        let q = sqlx::query_as(AssertSqlSafe(sql))
            .persistent(self.prepared())
            .bind(id);
        let row: Option<StateRow> = on_pool(&self.pool, self.prepared(), |c| {
            Box::pin(q.fetch_optional(c))
        })
        .await
        .map_err(err)?;
        if let Some((attempt, lu, due, processed, dead)) = row {
            return Ok(Some(RowState::new(attempt, lu, due, processed, dead)));
        }
        if let Some(DeadLetter::Table(d)) = table.dead_letter() {
            let sql = format!(
                "SELECT {}::int8 FROM {} WHERE {} = $1::int8",
                ident(table.attempt()),
                ident(d),
                ident(table.id())
            );
            let q = sqlx::query_scalar(AssertSqlSafe(sql))
                .persistent(self.prepared())
                .bind(id);
            let attempt: Option<i64> = on_pool(&self.pool, self.prepared(), |c| {
                Box::pin(q.fetch_optional(c))
            })
            .await
            .map_err(err)?;
            return Ok(attempt.map(|a| RowState::new(a, None, None, false, true)));
        }
        Ok(None)
    }

    fn ddl(&self, table: &TableDescription) -> Vec<String> {
        schema::ddl(table)
    }

    fn drop_ddl(&self, table: &TableDescription) -> Vec<String> {
        schema::drop_ddl(table)
    }

    async fn execute_ddl(&self, statements: &[String]) -> Result<()> {
        let mut conn = acquire(&self.pool, "").await?;
        for sql in statements {
            match conn.execute(AssertSqlSafe(sql.clone())).await {
                Ok(_) => {}
                // Two sessions creating one table at once: `IF NOT EXISTS` checks before it
                // creates, and the second fails on the catalog's unique index. The table exists.
                Err(sqlx::Error::Database(e))
                    if sql.contains("IF NOT EXISTS") && e.code().as_deref() == Some("23505") => {}
                // No control table (the queue's tables were made by hand): no pause to delete.
                Err(sqlx::Error::Database(e))
                    if broker_core::driver::is_unpause_ddl(sql)
                        && e.code().as_deref() == Some("42P01") => {}
                Err(e) => return Err(SqlxBrokerError::ddl(sql, e)),
            }
        }
        Ok(())
    }

    async fn doctor(
        &self,
        table: &TableDescription,
        options: &broker_core::DoctorOptions,
    ) -> Vec<broker_core::Check> {
        crate::doctor::checks(&self.pool, table, options).await
    }

    async fn listen(
        &self,
        table: &Arc<TableDescription>,
        wakeup: Arc<broker_core::driver::Wakeup>,
    ) -> Result<Option<broker_core::driver::Listening>> {
        if !self.prepared() {
            // Behind a transaction-mode pooler LISTEN would be lost without a word: poll.
            return Ok(None);
        }
        let channel = notify::channel(table.name());
        self.listener
            .register(&self.pool, table.name(), channel, wakeup)
            .await
            .map(Some)
    }
}
