//! Backlog shapes (issue #13): what a claim costs when rows it cannot take come first.
//!
//! Each shape is a table of `total` rows whose first `ahead` rows (the lowest ids) cannot be
//! claimed now, drained by the engine (8 workers, an instant ack) until `acks` rows are acked;
//! its rate is reported as a ratio to the same engine on the plain version of the table (the
//! same number of rows, all claimable, spread the same way) in the same run:
//!
//! | shape | the rows ahead | plain version |
//! |---|---|---|
//! | `notdue` | scheduled an hour ahead (`due_at`), as after a retry storm or for scheduled jobs | every row due |
//! | `fifobusy` | one FIFO group (its head runs one at a time), the rest in 10,000 groups (row lock, lease, advisory) | every row in the 10,000 groups |
//! | `heldkey` | one advisory key (held by the delivery of its head), the rest under 10,000 keys | every row under the 10,000 keys |
//!
//! The tables are the DDL helper's (`broker.create_tables`), filled by one `INSERT .. SELECT`
//! written here per database, then analyzed, so the planner knows their size.

use std::time::{Duration, Instant};

use broker_core::{Backend, Broker, ClaimMode, TableDescription};
use sqlx::{AssertSqlSafe, Database, Executor, FromRow};

use crate::BoxError;
use crate::drain::{self, Row, RunLimits, RunResult};
use crate::scenario::{Db, Scenario};

/// Groups (or keys) the claimable rows of a shape are spread over.
pub const SPREAD: usize = 10_000;

/// A backlog shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Shape {
    /// The rows ahead are scheduled an hour ahead.
    NotDue,
    /// The rows ahead are one FIFO group.
    FifoBusy,
    /// The rows ahead are under one advisory key.
    HeldKey,
}

impl Shape {
    /// Every shape, in report order.
    pub const ALL: [Shape; 3] = [Shape::NotDue, Shape::FifoBusy, Shape::HeldKey];

    /// The command-line name.
    pub fn key(self) -> &'static str {
        match self {
            Shape::NotDue => "notdue",
            Shape::FifoBusy => "fifobusy",
            Shape::HeldKey => "heldkey",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|x| x.key() == s.trim())
    }

    /// The claim modes the shape is measured in on `db`.
    pub fn modes(self, db: Db) -> Vec<ClaimMode> {
        let modes = match self {
            Shape::NotDue => vec![ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory],
            Shape::FifoBusy => vec![ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory],
            Shape::HeldKey => vec![ClaimMode::Advisory],
        };
        modes
            .into_iter()
            .filter(|m| db.modes().contains(m))
            .collect()
    }
}

/// The sizes of one run of a shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Rows in the table.
    pub total: usize,
    /// Rows ahead of the claimable ones.
    pub ahead: usize,
    /// Acks counted (a tenth more are the warm-up).
    pub acks: u64,
    /// The time cap of one drain.
    pub cap: Duration,
}

/// One measured shape: the engine on the shape and on its plain version.
#[derive(Debug, Clone, Copy)]
pub struct ShapeResult {
    /// Which run.
    pub scenario: Scenario,
    /// Which shape.
    pub shape: Shape,
    /// Its sizes.
    pub sizes: Sizes,
    /// The plain table.
    pub plain: RunResult,
    /// The table with the backlog ahead.
    pub backlog: RunResult,
}

impl ShapeResult {
    /// Backlog rate over plain rate.
    pub fn ratio(&self) -> f64 {
        let plain = self.plain.rate();
        if plain > 0.0 {
            self.backlog.rate() / plain
        } else {
            0.0
        }
    }
}

/// The bench table of a shape: the benches' usual description (a text payload, a due time, the
/// mode's column), with a FIFO group for `fifobusy`.
pub fn describe(name: &str, shape: Shape, mode: ClaimMode) -> Result<TableDescription, BoxError> {
    let groups = (shape == Shape::FifoBusy).then_some(SPREAD);
    drain::describe(name, mode, groups)
}

/// What [`fill_sql`] writes differently per database.
struct Dialect {
    quote: char,
    i: &'static str,
    concat: fn(&str, &str) -> String,
    later: &'static str,
    source: String,
}

/// The `INSERT .. SELECT` that fills `table` with `total` rows, the first `ahead` of them the
/// shape's backlog (`ahead` = 0: the plain version). Written per database, sharing no text with
/// the backends.
pub fn fill_sql(
    db: Db,
    table: &TableDescription,
    shape: Shape,
    total: usize,
    ahead: usize,
) -> String {
    // Each database's quote, row counter, string concatenation, "an hour from now" as its due
    // times are kept, and row source.
    let dialect = match db {
        Db::Postgres => Dialect {
            quote: '"',
            i: "i",
            concat: |a, b| format!("{a} || {b}"),
            later: "now() + INTERVAL '1 hour'",
            source: format!("generate_series(1, {total}) AS s(i)"),
        },
        Db::MariaDb => Dialect {
            quote: '`',
            i: "seq",
            concat: |a, b| format!("CONCAT({a}, {b})"),
            // The backend keeps times in UTC.
            later: "UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
            source: format!("seq_1_to_{total}"),
        },
        Db::Sqlite => Dialect {
            quote: '"',
            i: "i",
            concat: |a, b| format!("{a} || {b}"),
            // Unix milliseconds, as the backend writes due times.
            later: "(CAST(strftime('%s', 'now') AS INTEGER) + 3600) * 1000",
            source: "s".to_owned(),
        },
    };
    let Dialect {
        quote,
        i,
        concat,
        later,
        source,
    } = dialect;
    let q = |c: &str| format!("{quote}{c}{quote}");
    let spread = format!("({i} % {SPREAD})");
    let mut cols = vec![q("payload")];
    let mut values = vec![concat("'job-'", i)];
    if table.due_at().is_some() {
        cols.push(q("due_at"));
        values.push(if shape == Shape::NotDue && ahead > 0 {
            format!("CASE WHEN {i} <= {ahead} THEN {later} END")
        } else {
            "NULL".to_owned()
        });
    }
    if table.group().is_some() {
        cols.push(q("grp"));
        let spread_group = concat("'g'", &spread);
        values.push(if shape == Shape::FifoBusy && ahead > 0 {
            format!("CASE WHEN {i} <= {ahead} THEN 'busy' ELSE {spread_group} END")
        } else {
            spread_group
        });
    }
    if table.advisory_lock().is_some() {
        cols.push(q("k"));
        let (keys, hot) = if shape == Shape::HeldKey {
            (SPREAD, ahead)
        } else {
            (drain::KEYS, 0)
        };
        let spread_key = concat("'k'", &format!("({i} % {keys})"));
        values.push(if hot > 0 {
            format!("CASE WHEN {i} <= {hot} THEN 'hot' ELSE {spread_key} END")
        } else {
            spread_key
        });
    }
    let insert = format!(
        "INSERT INTO {} ({}) SELECT {} FROM {source}",
        q(table.name()),
        cols.join(", "),
        values.join(", ")
    );
    match db {
        // SQLite counts with a recursive CTE.
        Db::Sqlite => format!(
            "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {total}) {insert}"
        ),
        _ => insert,
    }
}

/// The statement that brings the table's planner statistics up to date.
pub fn analyze_sql(db: Db, table: &str) -> String {
    match db {
        Db::Postgres => format!("ANALYZE \"{table}\""),
        Db::MariaDb => format!("ANALYZE TABLE `{table}`"),
        Db::Sqlite => format!("ANALYZE \"{table}\""),
    }
}

/// Creates a table of the shape (the backlog `ahead`, or the plain version with 0), fills and
/// analyzes it, runs `f` on it and drops it.
async fn on_filled<B, R>(
    broker: &Broker<B>,
    db: Db,
    table: &TableDescription,
    shape: Shape,
    total: usize,
    ahead: usize,
    f: impl AsyncFnOnce() -> Result<R, BoxError>,
) -> Result<R, BoxError>
where
    B: Backend,
    for<'c> &'c sqlx::Pool<B::Db>: Executor<'c, Database = B::Db>,
{
    broker.create_tables(table).await?;
    let result = async {
        let pool = broker.pool();
        pool.execute(AssertSqlSafe(fill_sql(db, table, shape, total, ahead)))
            .await?;
        pool.execute(AssertSqlSafe(analyze_sql(db, table.name())))
            .await?;
        f().await
    }
    .await;
    let dropped = broker.drop_tables(table).await;
    let result = result?;
    dropped?;
    Ok(result)
}

/// Measures one shape in one mode and batch size: the plain version, then the backlog.
pub async fn measure<B>(
    broker: &Broker<B>,
    scenario: Scenario,
    shape: Shape,
    sizes: Sizes,
) -> Result<ShapeResult, BoxError>
where
    B: Backend,
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    for<'c> &'c sqlx::Pool<B::Db>: Executor<'c, Database = B::Db>,
{
    let limits = RunLimits {
        rows: sizes.acks + sizes.acks / 10,
        warmup: sizes.acks / 10,
        cap: sizes.cap,
    };
    let mut runs = Vec::new();
    for ahead in [0, sizes.ahead] {
        let table = describe(&drain::table_name("b"), shape, scenario.mode)?;
        let run = on_filled(
            broker,
            scenario.db,
            &table,
            shape,
            sizes.total,
            ahead,
            async || {
                let queue = broker.queue::<Row>(table.clone()).await?;
                drain::engine_run(&queue, &scenario, limits, None).await
            },
        )
        .await?;
        runs.push(run);
    }
    Ok(ShapeResult {
        scenario,
        shape,
        sizes,
        plain: runs[0],
        backlog: runs[1],
    })
}

/// The mean time of one claim and its ack, claimed one at a time by hand (`claims` of them), on
/// a `notdue` lease table of `total` rows with a fifth of them scheduled ahead.
pub async fn claim_time<B>(
    broker: &Broker<B>,
    db: Db,
    total: usize,
    claims: usize,
) -> Result<Duration, BoxError>
where
    B: Backend,
    Row: for<'r> FromRow<'r, <B::Db as Database>::Row>,
    for<'c> &'c sqlx::Pool<B::Db>: Executor<'c, Database = B::Db>,
{
    let table = describe(&drain::table_name("g"), Shape::NotDue, ClaimMode::Lease)?;
    on_filled(
        broker,
        db,
        &table,
        Shape::NotDue,
        total,
        total / 5,
        async || {
            let queue = broker.queue::<Row>(table.clone()).await?;
            // Warm the connections and the statements first.
            for d in queue.claim(1).await? {
                d.ack().await?;
            }
            let started = Instant::now();
            for _ in 0..claims {
                let Some(d) = queue.claim(1).await?.pop() else {
                    return Err("the table ran out of due rows".into());
                };
                d.ack().await?;
            }
            Ok(started.elapsed() / u32::try_from(claims.max(1))?)
        },
    )
    .await
}
