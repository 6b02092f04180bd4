//! The PostgreSQL checks of [`Broker::doctor`](broker_core::Broker::doctor): server version,
//! pooler, prepared statements, `LISTEN`, settings that cut row-lock deliveries short, the
//! clock, the indexes the claim reads, vacuum, and whether the role may analyze the table.
//!
//! Every statement here runs unprepared (the simple protocol, or an unnamed statement), and the
//! probes that could leave session state behind run on connections of their own that are closed
//! afterwards: the doctor must work, and change nothing, behind the very poolers it looks for.

use broker_core::doctor::{Check, DoctorOptions, UniqueIndex, WAIT, clock_check};
use broker_core::{ClaimMode, TableDescription, driver::clock};
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Row};

use crate::sql::{ident, literal};
use crate::{schema, stats, version};

/// A connection of the doctor's own, with the pool's options (through the same pooler, if any).
async fn own_connection(pool: &PgPool) -> Result<PgConnection, sqlx::Error> {
    PgConnection::connect_with(&pool.connect_options()).await
}

async fn one_row(conn: &mut PgConnection, sql: &str) -> Result<PgRow, sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .fetch_one(&mut *conn)
        .await
}

async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    one_row(conn, "SELECT pg_backend_pid()").await?.try_get(0)
}

/// Runs every check; see the module docs.
pub(crate) async fn checks(
    pool: &PgPool,
    table: &TableDescription,
    _options: &DoctorOptions,
) -> Vec<Check> {
    let mut out = Vec::new();
    let (mut a, mut b) = match (own_connection(pool).await, own_connection(pool).await) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            out.push(Check::fail(
                "connection",
                format!("cannot connect: {e}"),
                "check the URL, the server and the role's rights",
            ));
            return out;
        }
    };
    out.push(server_version(&mut a).await);
    out.push(pooler(&mut a, &mut b, table).await);
    out.push(prepared_statements(&mut a, &mut b).await);
    out.push(listen(pool, table).await);
    if table.mode() == ClaimMode::RowLock {
        out.extend(row_lock_settings(&mut a).await);
    }
    out.push(clock(&mut a, table).await);
    let found = indexes(&mut a, table).await;
    let exists = found.iter().all(|c| c.name != "table");
    out.extend(found);
    if exists {
        if let Some(fix) = schema::unique_index(table) {
            let found = unique_index(&mut a, table).await.map_err(|e| e.to_string());
            out.extend(broker_core::doctor::unique_index_check(table, found, &fix));
        }
        out.push(vacuum(&mut a, table).await);
        out.push(statistics(&mut a, table).await);
    }
    let _ = a.close().await;
    let _ = b.close().await;
    out
}

async fn server_version(conn: &mut PgConnection) -> Check {
    let name = "server version";
    let row = one_row(
        conn,
        "SELECT current_setting('server_version_num'), current_setting('server_version')",
    )
    .await;
    let (num, text): (String, String) = match row.and_then(|r| Ok((r.try_get(0)?, r.try_get(1)?))) {
        Ok(v) => v,
        Err(e) => {
            return Check::fail(
                name,
                format!("cannot read it: {e}"),
                "check the role's rights",
            );
        }
    };
    match version::check(&num, &text) {
        Ok(_) => Check::pass(name, format!("PostgreSQL {text} (11 or newer needed)")),
        Err(e) => Check::fail(name, e.to_string(), "upgrade to PostgreSQL 11 or newer"),
    }
}

/// Whether session state survives: one connection's statements reach one server session, and
/// two connections do not share one. Behind a transaction-mode pooler (PgBouncer
/// `pool_mode = transaction`), a server session serves one client per transaction: a client's
/// next transaction may reach another session, and a session a client just left is handed to
/// the next client (PgBouncer reuses the most recently freed one).
async fn pooler(a: &mut PgConnection, b: &mut PgConnection, table: &TableDescription) -> Check {
    let name = "pooler";
    let pids = async {
        let first = backend_pid(a).await?;
        let other_client = backend_pid(b).await?;
        let again = backend_pid(a).await?;
        Ok::<_, sqlx::Error>((first, other_client, again))
    };
    let (first, other_client, again) = match pids.await {
        Ok(p) => p,
        Err(e) => {
            return Check::fail(
                name,
                format!("cannot read the server session: {e}"),
                "check the role's rights",
            );
        }
    };
    if first == again && first != other_client {
        return Check::pass(
            name,
            "each connection keeps a server session of its own (direct, or a session-mode pooler)",
        );
    }
    let found = format!(
        "server sessions are shared between connections, per transaction (session {first} served this connection, then {again}; another connection got {other_client}): a transaction-mode pooler"
    );
    match table.mode() {
        ClaimMode::Advisory => Check::fail(
            name,
            format!(
                "{found}; advisory locks live in the session, so two deliveries could hold one key"
            ),
            "connect directly or through a session-mode pooler, or use lease mode (a locked_until column)",
        ),
        _ => Check::warn(
            name,
            format!("{found}; LISTEN is lost, so wake-ups across processes fall back to the poll"),
            "connect directly or through a session-mode pooler for LISTEN; row lock and lease work through it once statements are sent unprepared (see the prepared statements check)",
        ),
    }
}

/// Whether a named prepared statement outlives its transaction on this connection, while
/// another connection holds a transaction open (so a pooler must serve this connection's next
/// transaction from another server session): sqlx prepares every statement under a name and
/// reuses it, so where names do not survive (or collide on a shared server session), queries
/// fail.
async fn prepared_statements(a: &mut PgConnection, b: &mut PgConnection) -> Check {
    let name = "prepared statements";
    let stmt = format!(
        "sqlx_broker_doctor_{}_{}",
        std::process::id(),
        clock::now_ms()
    );
    let run = |sql: String| sqlx::raw_sql(AssertSqlSafe(sql));
    if let Err(e) = run(format!("BEGIN; PREPARE {stmt} AS SELECT 1; COMMIT"))
        .execute(&mut *a)
        .await
    {
        return Check::fail(
            name,
            format!("PREPARE failed: {e}"),
            "check the role's rights",
        );
    }
    // The other connection holds a transaction, and so (behind a pooler) a server session.
    if let Err(e) = run("BEGIN; SELECT pg_backend_pid()".into())
        .execute(&mut *b)
        .await
    {
        return Check::fail(
            name,
            format!("cannot open a transaction: {e}"),
            "check the role's rights",
        );
    }
    let executed = run(format!("EXECUTE {stmt}")).execute(&mut *a).await;
    let _ = run("ROLLBACK".into()).execute(&mut *b).await;
    match executed {
        Ok(_) => {
            let _ = run(format!("DEALLOCATE {stmt}")).execute(&mut *a).await;
            Check::pass(
                name,
                "a named statement outlives its transaction on its connection",
            )
        }
        Err(e) => Check::warn(
            name,
            format!(
                "a statement prepared in one transaction is gone in the next ({e}); sqlx's named statements would fail here, so the backend sends its statements unnamed, each inside a transaction (two more round trips per statement)"
            ),
            "connect directly or through a session-mode pooler, or use PgBouncer 1.21+ with max_prepared_statements > 0, to keep statements prepared",
        ),
    }
}

/// Whether a notification reaches a listener on a connection of the pool.
async fn listen(pool: &PgPool, table: &TableDescription) -> Check {
    let name = "LISTEN";
    let channel = format!("sqlx_broker_doctor_{}", std::process::id());
    let heard = async {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(&channel).await?;
        let mut conn = own_connection(pool).await?;
        sqlx::raw_sql(AssertSqlSafe(format!("NOTIFY {}", ident(&channel))))
            .execute(&mut conn)
            .await?;
        let _ = conn.close().await;
        let got = tokio::time::timeout(WAIT, listener.recv()).await;
        let _ = listener.unlisten_all().await;
        Ok::<_, sqlx::Error>(matches!(got, Ok(Ok(_))))
    };
    let poll = "subscriptions in other processes find new rows only at their poll interval";
    match heard.await {
        Ok(true) => Check::pass(name, "a notification reached a listener on the pool"),
        Ok(false) => Check::warn(
            name,
            format!(
                "a notification did not arrive within {} s; {poll} (for {})",
                WAIT.as_secs(),
                table.name()
            ),
            "LISTEN needs a session: connect directly or through a session-mode pooler, or keep the poll interval short",
        ),
        Err(e) => Check::warn(
            name,
            format!("LISTEN does not work through this connection ({e}); {poll}"),
            "LISTEN needs a session: connect directly or through a session-mode pooler",
        ),
    }
}

/// Settings that end a row-lock delivery's transaction or statement under it.
async fn row_lock_settings(conn: &mut PgConnection) -> Vec<Check> {
    let mut out = Vec::new();
    for (setting, what, fix) in [
        (
            "idle_in_transaction_session_timeout",
            "a row-lock delivery keeps its transaction open, idle, while the handler runs; the server ends the session of one whose handler runs longer, the row comes back and the handler's writes are lost",
            "ALTER ROLE <role> SET idle_in_transaction_session_timeout = 0 (or longer than any handler), or use lease mode for long handlers",
        ),
        (
            "transaction_timeout",
            "the server ends a row-lock delivery's transaction that runs longer, with the handler's writes",
            "ALTER ROLE <role> SET transaction_timeout = 0 (or longer than any handler), or use lease mode for long handlers",
        ),
    ] {
        let name = format!("setting {setting}");
        // `transaction_timeout` exists from PostgreSQL 17; a server without it has no such limit.
        let value = one_row(conn, &format!("SELECT current_setting('{setting}', true)")).await;
        match value.and_then(|r| r.try_get::<Option<String>, _>(0)) {
            Ok(None) => {}
            Ok(Some(v)) if v == "0" || v.is_empty() => {
                out.push(Check::pass(name, format!("{v} (no limit)")))
            }
            Ok(Some(v)) => out.push(Check::warn(name, format!("{v}: {what}"), fix)),
            Err(e) => out.push(Check::warn(
                name,
                format!("cannot read it: {e}"),
                "check it by hand",
            )),
        }
    }
    out
}

async fn clock(conn: &mut PgConnection, table: &TableDescription) -> Check {
    let before = clock::now_ms();
    let db = one_row(
        conn,
        "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::int8",
    )
    .await
    .and_then(|r| r.try_get::<i64, _>(0));
    let after = clock::now_ms();
    let lease = (table.mode() == ClaimMode::Lease).then(|| table.lease_seconds());
    match db {
        Ok(db) => clock_check(before, db, after, lease),
        Err(e) => Check::warn(
            "clock",
            format!("cannot read the database's clock: {e}"),
            "check it by hand",
        ),
    }
}

/// Whether this role may `ANALYZE` the table, which a queue does when a burst has left the
/// table's statistics stale (see `PgBackend::analyze_stale_tables`).
async fn statistics(conn: &mut PgConnection, table: &TableDescription) -> Check {
    let name = "statistics";
    let sql = stats::check_sql(&literal(&ident(table.name())));
    match one_row(conn, &sql)
        .await
        .and_then(|r| r.try_get::<bool, _>(2))
    {
        Ok(true) => Check::pass(
            name,
            "this role may ANALYZE the table: a queue analyzes it when a burst left its statistics stale",
        ),
        Ok(false) => Check::warn(
            name,
            "this role may not ANALYZE the table: when an autovacuum finds the queue nearly drained and a burst follows, claims read and sort the whole table until autovacuum analyzes it again (up to autovacuum_naptime)",
            "run the broker as the table's owner (or a member of the owner role), or lower autovacuum_naptime",
        ),
        Err(e) => Check::warn(
            name,
            format!("cannot read the table's owner: {e}"),
            "check by hand that the broker's role owns the table",
        ),
    }
}

/// How long a snapshot may be held before the vacuum check warns.
const OLD_SNAPSHOT_SECONDS: i64 = 600;

/// Whether vacuum can clean the table up: autovacuum on for the server and the table, and no
/// transaction holding a snapshot for long (vacuum keeps every row deleted since that snapshot
/// began). Acked rows' dead entries do not slow claims down (they resume at the queue's head),
/// but the table and its indexes grow until vacuum runs.
async fn vacuum(conn: &mut PgConnection, table: &TableDescription) -> Check {
    let name = "vacuum";
    let table_literal = literal(&ident(table.name()));
    let sql = format!(
        "SELECT current_setting('autovacuum'), \
         (SELECT COALESCE(array_to_string(c.reloptions, ', '), '') FROM pg_class AS c \
          WHERE c.oid = to_regclass({table_literal})), \
         (SELECT s.n_dead_tup FROM pg_stat_user_tables AS s WHERE s.relid = to_regclass({table_literal})), \
         (SELECT a.pid FROM pg_stat_activity AS a WHERE a.backend_xmin IS NOT NULL \
          AND a.pid <> pg_backend_pid() AND a.xact_start IS NOT NULL ORDER BY a.xact_start LIMIT 1), \
         (SELECT (EXTRACT(EPOCH FROM now() - a.xact_start))::int8 FROM pg_stat_activity AS a \
          WHERE a.backend_xmin IS NOT NULL AND a.pid <> pg_backend_pid() AND a.xact_start IS NOT NULL \
          ORDER BY a.xact_start LIMIT 1)"
    );
    type Found = (
        String,
        Option<String>,
        Option<i64>,
        Option<i32>,
        Option<i64>,
    );
    let found: Result<Found, sqlx::Error> = one_row(conn, &sql).await.and_then(|r| {
        Ok((
            r.try_get(0)?,
            r.try_get(1)?,
            r.try_get(2)?,
            r.try_get(3)?,
            r.try_get(4)?,
        ))
    });
    let (server, options, dead, oldest_pid, oldest_age) = match found {
        Ok(f) => f,
        Err(e) => {
            return Check::warn(
                name,
                format!("cannot read the vacuum settings: {e}"),
                "check autovacuum and long transactions by hand",
            );
        }
    };
    let options = options.unwrap_or_default();
    let dead = dead.map_or_else(String::new, |d| format!("; {d} dead rows now"));
    let settings = format!(
        "the DDL helper creates queue tables WITH ({})",
        schema::VACUUM_SETTINGS
    );
    if server != "on" {
        return Check::warn(
            name,
            format!(
                "autovacuum is off for the server{dead}: acked rows stay in the table and its indexes until a VACUUM (claims read past them, but the table keeps growing)"
            ),
            format!(
                "ALTER SYSTEM SET autovacuum = on and SELECT pg_reload_conf(), or VACUUM the table regularly; {settings}"
            ),
        );
    }
    if options.contains("autovacuum_enabled=false") {
        return Check::warn(
            name,
            format!(
                "autovacuum is off for table \"{}\" ({options}){dead}",
                table.name()
            ),
            format!(
                "ALTER TABLE {} RESET (autovacuum_enabled); {settings}",
                ident(table.name())
            ),
        );
    }
    if let (Some(pid), Some(age)) = (oldest_pid, oldest_age)
        && age > OLD_SNAPSHOT_SECONDS
    {
        return Check::warn(
            name,
            format!(
                "a transaction (pid {pid}) has held its snapshot for {age} s{dead}: vacuum keeps every row deleted since it began"
            ),
            "end long transactions (idle_in_transaction_session_timeout helps); row lock mode holds one per delivery, so use lease mode for long handlers",
        );
    }
    let tuned = if options.contains("autovacuum_vacuum_threshold") {
        "with the queue settings"
    } else {
        "with the server's defaults (the DDL helper's queue settings would vacuum sooner)"
    };
    Check::pass(name, format!("autovacuum on, {tuned}{dead}"))
}

/// Looks for a unique index over the key column alone, and whether it is partial.
async fn unique_index(
    conn: &mut PgConnection,
    table: &TableDescription,
) -> Result<UniqueIndex, sqlx::Error> {
    let sql = format!(
        "SELECT i.relname::text, ix.indpred IS NOT NULL FROM pg_index ix \
         JOIN pg_class i ON i.oid = ix.indexrelid \
         JOIN pg_attribute a ON a.attrelid = ix.indrelid AND a.attnum = ix.indkey[0] \
         WHERE ix.indrelid = to_regclass({})::oid AND ix.indisunique AND ix.indnatts = 1 \
         AND ix.indexprs IS NULL AND a.attname = {}",
        literal(&ident(table.name())),
        literal(table.unique_key().unwrap_or_default()),
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await?;
    let mut found = UniqueIndex::Missing;
    for row in rows {
        let name: String = row.try_get(0)?;
        let partial: bool = row.try_get(1)?;
        if partial || table.unfinished_columns().is_empty() {
            return Ok(UniqueIndex::Found);
        }
        found = UniqueIndex::CoversFinishedRows(name);
    }
    Ok(found)
}

/// The indexes the DDL helper creates for the claim, by name; a failed "table" check instead
/// where the table does not exist.
async fn indexes(conn: &mut PgConnection, table: &TableDescription) -> Vec<Check> {
    // Unprepared, so its statements run inside a transaction: behind a transaction-mode pooler
    // a bound statement's parse and execution must reach one server session.
    if let Ok(columns) = schema::table_columns(conn, table, false).await
        && columns.is_empty()
    {
        return broker_core::driver::indexes::table_missing(table.name());
    }
    vec![broker_core::driver::indexes::check(
        schema::index_advice(conn, table, false).await,
    )]
}
