//! The MySQL and MariaDB checks of [`Broker::doctor`](broker_core::Broker::doctor): server
//! version, proxies that multiplex sessions, the isolation level, settings that cut deliveries
//! short, the clock, and the indexes the claim reads. Every probe runs on connections of the
//! doctor's own, closed afterwards.

use broker_core::doctor::{Check, DoctorOptions, clock_check};
use broker_core::{ClaimMode, TableDescription, driver::clock};
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, Connection, MySqlConnection, MySqlPool, Row};

use crate::{galera, version};

async fn own_connection(pool: &MySqlPool) -> Result<MySqlConnection, sqlx::Error> {
    MySqlConnection::connect_with(&pool.connect_options()).await
}

async fn one_row(conn: &mut MySqlConnection, sql: &str) -> Result<MySqlRow, sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .fetch_one(&mut *conn)
        .await
}

/// Runs every check; see the module docs.
pub(crate) async fn checks(
    pool: &MySqlPool,
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
                "check the URL, the server and the user's rights",
            ));
            return out;
        }
    };
    out.push(server_version(&mut a).await);
    out.push(cluster(&mut a, table).await);
    out.push(sessions(&mut a, &mut b, table).await);
    out.push(isolation(&mut a).await);
    if matches!(table.mode(), ClaimMode::RowLock | ClaimMode::Advisory) {
        out.push(wait_timeout(&mut a, table.mode()).await);
    }
    out.push(clock(&mut a, table).await);
    out.extend(indexes(&mut a, table).await);
    if table.unique_key().is_some() {
        let found = unique_index(&mut a, table).await.map_err(|e| e.to_string());
        let fix = match crate::schema::unique_index(table).as_slice() {
            [index] => format!(
                "ALTER TABLE {} ADD {index}",
                crate::sql::ident(table.name())
            ),
            parts => format!(
                "ALTER TABLE {} ADD COLUMN {}",
                crate::sql::ident(table.name()),
                parts.join(", ADD ")
            ),
        };
        out.extend(broker_core::doctor::unique_index_check(table, found, &fix));
    }
    let _ = a.close().await;
    let _ = b.close().await;
    out
}

async fn server_version(conn: &mut MySqlConnection) -> Check {
    let name = "server version";
    match one_row(conn, "SELECT VERSION()")
        .await
        .and_then(|r| r.try_get::<String, _>(0))
    {
        Ok(found) => match version::check(&found) {
            Ok(_) => Check::pass(
                name,
                format!("{found} (MySQL 8.0.1 or MariaDB 10.6 or newer needed)"),
            ),
            Err(e) => Check::fail(
                name,
                e.to_string(),
                "upgrade to MySQL 8.0.1+ or MariaDB 10.6+ (the first with SKIP LOCKED)",
            ),
        },
        Err(e) => Check::fail(
            name,
            format!("cannot read it: {e}"),
            "check the user's rights",
        ),
    }
}

/// Whether the server is a Galera node, and whether the table's claim mode holds there (see
/// [`crate::galera`]).
async fn cluster(conn: &mut MySqlConnection, table: &TableDescription) -> Check {
    let name = "cluster";
    match galera::node(conn).await {
        Ok(None) => Check::pass(name, "a single server (not a Galera node)"),
        Ok(Some(node)) => match galera::unsafe_mode(table.mode()) {
            None => Check::pass(
                name,
                format!(
                    "{node}: lease mode holds (claims on two nodes that take one row conflict at certification, one claims again); row lock and advisory mode do not"
                ),
            ),
            Some(why) => Check::fail(
                name,
                format!("{node}: {why}"),
                "describe the table for lease mode",
            ),
        },
        Err(e) => Check::fail(
            name,
            format!("cannot read the wsrep settings: {e}"),
            "check the user's rights",
        ),
    }
}

/// Whether a connection keeps one server session: a proxy that multiplexes (ProxySQL with
/// `multiplexing` on) may send a connection's statements to different backend sessions, which
/// breaks `GET_LOCK` keys and the transactions row lock holds open.
async fn sessions(
    a: &mut MySqlConnection,
    b: &mut MySqlConnection,
    table: &TableDescription,
) -> Check {
    let name = "session";
    let ids = async {
        let first: u64 = one_row(a, "SELECT CONNECTION_ID()").await?.try_get(0)?;
        let other: u64 = one_row(b, "SELECT CONNECTION_ID()").await?.try_get(0)?;
        let again: u64 = one_row(a, "SELECT CONNECTION_ID()").await?.try_get(0)?;
        Ok::<_, sqlx::Error>((first, other, again))
    };
    match ids.await {
        Ok((first, other, again)) if first == again && first != other => {
            Check::pass(name, "each connection keeps a server session of its own")
        }
        Ok((first, other, again)) => {
            let found = format!(
                "server sessions are shared between connections (session {first}, then {again}; another connection got {other}): a proxy multiplexes them"
            );
            let fix = "connect directly, or turn multiplexing off for this user in the proxy (ProxySQL: mysql_query_rules multiplex=0, or a dedicated hostgroup)";
            match table.mode() {
                ClaimMode::Lease => Check::warn(
                    name,
                    format!("{found}; lease claims run in short transactions and survive it"),
                    fix,
                ),
                _ => Check::fail(
                    name,
                    format!("{found}; row locks and GET_LOCK keys live in the session"),
                    fix,
                ),
            }
        }
        Err(e) => Check::fail(
            name,
            format!("cannot read the session id: {e}"),
            "check the user's rights",
        ),
    }
}

async fn isolation(conn: &mut MySqlConnection) -> Check {
    let name = "isolation level";
    // MySQL 8 and MariaDB 11.1+ name it transaction_isolation; older MariaDB tx_isolation.
    let level = match one_row(conn, "SELECT @@SESSION.transaction_isolation").await {
        Ok(r) => r.try_get::<String, _>(0),
        Err(_) => one_row(conn, "SELECT @@SESSION.tx_isolation")
            .await
            .and_then(|r| r.try_get::<String, _>(0)),
    };
    match level {
        Ok(level) => Check::pass(
            name,
            format!(
                "the session default is {level}; claims open their transactions at READ COMMITTED (unless the table sets a level), so they lock only the rows they take"
            ),
        ),
        Err(e) => Check::warn(name, format!("cannot read it: {e}"), "check it by hand"),
    }
}

/// A delivery in row lock or advisory mode keeps its connection idle while the handler runs;
/// the server closes a connection idle for longer than `wait_timeout`.
async fn wait_timeout(conn: &mut MySqlConnection, mode: ClaimMode) -> Check {
    let name = "setting wait_timeout";
    match one_row(conn, "SELECT CAST(@@SESSION.wait_timeout AS SIGNED)")
        .await
        .and_then(|r| r.try_get::<i64, _>(0))
    {
        Ok(secs) if secs >= 3600 => Check::pass(name, format!("{secs} s")),
        Ok(secs) => Check::warn(
            name,
            format!(
                "{secs} s: a {mode} delivery holds its connection idle while the handler runs, and the server closes it after {secs} s (the row comes back; in row lock mode the handler's writes are lost)"
            ),
            "raise wait_timeout for this user (SET GLOBAL wait_timeout = 28800, or in the server's configuration), or use lease mode for long handlers",
        ),
        Err(e) => Check::warn(name, format!("cannot read it: {e}"), "check it by hand"),
    }
}

async fn clock(conn: &mut MySqlConnection, table: &TableDescription) -> Check {
    let before = clock::now_ms();
    let db = one_row(conn, "SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)")
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

/// The claim index the DDL helper creates, in claim order. (A FIFO table without its group index
/// is refused when a queue is prepared.)
async fn indexes(conn: &mut MySqlConnection, table: &TableDescription) -> Vec<Check> {
    let exists: Result<i64, _> = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .persistent(false)
    .bind(table.name())
    .fetch_one(&mut *conn)
    .await;
    if matches!(exists, Ok(0)) {
        return broker_core::driver::indexes::table_missing(table.name());
    }
    vec![broker_core::driver::indexes::check(
        crate::schema::index_advice(conn, table).await,
    )]
}

/// Looks for a unique index over the key column alone, or over the generated column that holds
/// the key only while the row is unfinished.
async fn unique_index(
    conn: &mut sqlx::MySqlConnection,
    table: &TableDescription,
) -> Result<broker_core::doctor::UniqueIndex, sqlx::Error> {
    use broker_core::doctor::UniqueIndex;
    // Unique indexes of one column: their name and column, with the column's generation rule.
    let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT CAST(s.index_name AS CHAR), CAST(s.column_name AS CHAR), \
         CAST(NULLIF(c.generation_expression, '') AS CHAR) \
         FROM information_schema.statistics s JOIN information_schema.columns c \
         ON c.table_schema = s.table_schema AND c.table_name = s.table_name AND c.column_name = s.column_name \
         WHERE s.table_schema = DATABASE() AND s.table_name = ? AND s.non_unique = 0 \
         AND s.index_name IN (SELECT index_name FROM information_schema.statistics \
           WHERE table_schema = DATABASE() AND table_name = ? GROUP BY index_name HAVING COUNT(*) = 1)",
    )
    .bind(table.name())
    .bind(table.name())
    .fetch_all(&mut *conn)
    .await?;
    let key = table.unique_key().unwrap_or_default();
    let unfinished = table.unfinished_columns();
    let mut found = UniqueIndex::Missing;
    for (index, column, generated) in rows {
        if column.eq_ignore_ascii_case(key) {
            if unfinished.is_empty() {
                return Ok(UniqueIndex::Found);
            }
            found = UniqueIndex::CoversFinishedRows(index);
        } else if let Some(rule) = generated {
            // The generation rule must read the key and every finishing column, and give NULL
            // otherwise (no ELSE, as the DDL helper writes it: `CASE WHEN .. THEN key END`).
            let rule = rule.to_ascii_lowercase();
            if rule.contains(&key.to_ascii_lowercase())
                && unfinished
                    .iter()
                    .all(|c| rule.contains(&c.to_ascii_lowercase()))
            {
                if !rule.contains(" else ") {
                    return Ok(UniqueIndex::Found);
                }
                found = UniqueIndex::CoversFinishedRows(index);
            }
        }
    }
    Ok(found)
}
