//! PostgreSQL for `check`: a scratch schema of its own (the URL's database, `search_path` set
//! to the schema on every session the cases open), brokers whose sessions carry an
//! application name of this run, and the probes the cases ask for.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker_core::Broker;
use broker_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use broker_postgres::sqlx::{self, AssertSqlSafe, Connection, Executor, PgConnection};
use broker_postgres::{PgBackend, PgBroker};

use super::{Place, Scratch, quote_double, scratch_name};

/// The prefix of this run's application names: `sbc_<pid>_`.
fn app_prefix() -> String {
    format!("sbc_{}_", std::process::id())
}

async fn connect_one(url: &str) -> Result<PgConnection, String> {
    match tokio::time::timeout(Duration::from_secs(20), PgConnection::connect(url)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("cannot connect: {e}")),
        Err(_) => Err("the server did not answer within 20 s".to_owned()),
    }
}

/// `url` with `options=-c search_path=<schema>` added, so every session works in the schema.
fn in_schema(url: &str, schema: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20search_path%3D{schema}")
}

/// Checks the rights `check` needs and makes its scratch schema, or says what to grant.
pub(super) async fn prepare(url: &str) -> Result<Scratch, String> {
    let mut conn = connect_one(url).await?;
    let (user, database, may_create, schema_now, may_create_here): (
        String,
        String,
        bool,
        Option<String>,
        Option<bool>,
    ) = sqlx::query_as(
        "SELECT current_user::text, current_database()::text, \
         has_database_privilege(current_database(), 'CREATE'), current_schema()::text, \
         CASE WHEN current_schema() IS NULL THEN NULL \
              ELSE has_schema_privilege(current_schema(), 'CREATE') END",
    )
    .fetch_one(&mut conn)
    .await
    .map_err(|e| format!("reading the role's rights: {e}"))?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut conn)
        .await
        .map_err(|e| format!("reading the server version: {e}"))?;
    let server = format!("PostgreSQL {version}, database {database:?} as {user:?}");
    if may_create {
        let schema = scratch_name();
        conn.execute(AssertSqlSafe(format!(
            "CREATE SCHEMA {}",
            quote_double(&schema)
        )))
        .await
        .map_err(|e| format!("creating the scratch schema {schema}: {e}"))?;
        let _ = conn.close().await;
        return Ok(Scratch {
            server,
            url: in_schema(url, &schema),
            admin_url: url.to_owned(),
            place: Place::PgSchema(schema),
        });
    }
    // No schema of its own: tables of this run's own names in the role's current schema, where
    // it may create tables and the broker's shared tables are not (so all it creates is its own).
    let shared = shared_tables_in(&mut conn).await?;
    match (schema_now, may_create_here) {
        (Some(schema), Some(true)) if shared.is_empty() => {
            let before = own_tables(&mut conn, &schema).await?;
            let _ = conn.close().await;
            Ok(Scratch {
                server,
                url: url.to_owned(),
                admin_url: url.to_owned(),
                place: Place::PgPrefix { schema, before },
            })
        }
        (schema, _) => {
            let _ = conn.close().await;
            let schema_part = match (&schema, shared.is_empty()) {
                (Some(s), false) => format!(
                    "; it would fall back to tables of its own in schema {s:?}, but the broker's shared tables ({}) are there and the cases would write to them",
                    shared.join(", ")
                ),
                (Some(s), true) => format!(
                    ", nor a table in its current schema {s:?} (the fallback): GRANT CREATE ON SCHEMA {} TO {}",
                    quote_double(s),
                    quote_double(&user)
                ),
                (None, _) => {
                    ", and it has no current schema to fall back to (none on its search_path exists)"
                        .to_owned()
                }
            };
            Err(format!(
                "role {user:?} may not create a schema in database {database:?}: `sqlx-broker check` runs its cases in a scratch schema it creates and drops. Grant it with GRANT CREATE ON DATABASE {} TO {} (and revoke it after){schema_part}",
                quote_double(&database),
                quote_double(&user),
            ))
        }
    }
}

/// The broker's shared tables in the current schema (`sqlx_broker_control`, ..).
async fn shared_tables_in(conn: &mut PgConnection) -> Result<Vec<String>, String> {
    sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = ANY($1)",
    )
    .bind(super::SHARED_TABLES.map(str::to_owned).to_vec())
    .fetch_all(conn)
    .await
    .map_err(|e| format!("listing tables: {e}"))
}

/// Tables in `schema` whose names the cases of this process make (`sb_.._<pid>_..`), and the
/// broker's shared tables.
async fn own_tables(conn: &mut PgConnection, schema: &str) -> Result<Vec<String>, String> {
    sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = $1 AND (table_name LIKE $2 OR table_name = ANY($3))",
    )
    .bind(schema)
    .bind(super::own_pattern())
    .bind(super::SHARED_TABLES.map(str::to_owned).to_vec())
    .fetch_all(conn)
    .await
    .map_err(|e| format!("listing tables: {e}"))
}

/// Ends this run's sessions and drops what it made: the scratch schema with everything in it,
/// or (the fallback) the tables it made.
pub(super) async fn clean(scratch: &Scratch) -> Result<String, String> {
    let mut conn = connect_one(&scratch.admin_url).await?;
    let _ = sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name LIKE $1 AND pid <> pg_backend_pid()",
    )
    .bind(format!("{}%", app_prefix().replace('_', "\\_")))
    .execute(&mut conn)
    .await;
    let done = match &scratch.place {
        Place::PgSchema(schema) => {
            conn.execute(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {} CASCADE",
                quote_double(schema)
            )))
            .await
            .map_err(|e| format!("dropping the scratch schema {schema}: {e}"))?;
            let left: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                    .bind(schema)
                    .fetch_one(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
            if left {
                return Err(format!("the scratch schema {schema} is still there"));
            }
            format!("schema {schema} dropped")
        }
        Place::PgPrefix { schema, before } => {
            let now = own_tables(&mut conn, schema).await?;
            let made: Vec<_> = now.iter().filter(|t| !before.contains(t)).collect();
            for t in &made {
                conn.execute(AssertSqlSafe(format!(
                    "DROP TABLE IF EXISTS {}.{} CASCADE",
                    quote_double(schema),
                    quote_double(t)
                )))
                .await
                .map_err(|e| format!("dropping {t}: {e}"))?;
            }
            // The slow-delete triggers' functions are named after the tables.
            let functions: Vec<String> = sqlx::query_scalar(
                "SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                 WHERE n.nspname = $1 AND p.proname LIKE $2",
            )
            .bind(schema)
            .bind(super::own_pattern())
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
            for f in functions {
                let _ = conn
                    .execute(AssertSqlSafe(format!(
                        "DROP FUNCTION IF EXISTS {}.{}() CASCADE",
                        quote_double(schema),
                        quote_double(&f)
                    )))
                    .await;
            }
            format!(
                "{} tables of this run dropped from schema {schema}",
                made.len()
            )
        }
        _ => unreachable!("a PostgreSQL scratch place"),
    };
    let _ = conn.close().await;
    Ok(done)
}

/// A broker with a pool of its own on `url`, its sessions named `sbc_<pid>_<n>`.
async fn connect(url: &str) -> PgBroker {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let options = PgConnectOptions::from_str(url).expect("a PostgreSQL URL");
    let app = format!("{}{}", app_prefix(), NEXT.fetch_add(1, Ordering::Relaxed));
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .min_connections(0)
        .idle_timeout(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options.application_name(&app))
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL is unreachable: {e}"));
    Broker::new(PgBackend::new(pool))
}

fn app_name(broker: &PgBroker) -> String {
    broker
        .pool()
        .connect_options()
        .get_application_name()
        .unwrap_or_default()
        .to_owned()
}

async fn admin() -> PgConnection {
    connect_one(&super::scratch_url())
        .await
        .unwrap_or_else(|e| panic!("a probe connection: {e}"))
}

async fn count(sql: &'static str, app: &str) -> i64 {
    let mut conn = admin().await;
    let n = sqlx::query_scalar(sql)
        .bind(app)
        .fetch_one(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let _ = conn.close().await;
    n
}

/// The check's view of PostgreSQL: the scratch schema.
pub(crate) struct CheckPg;

impl broker_testkit::TestDb for CheckPg {
    type B = PgBackend;
    type Job = broker_testkit::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn database() -> String {
        super::scratch_url()
    }

    async fn connect(url: &str) -> Broker<PgBackend> {
        connect(url).await
    }

    async fn key_is_held(broker: &PgBroker, key: &str) -> bool {
        broker
            .backend()
            .is_key_held(key)
            .await
            .expect("probe the key")
    }

    async fn kill_connections(broker: &PgBroker) -> Option<usize> {
        let mut conn = admin().await;
        let killed: Vec<bool> = sqlx::query_scalar(
            "SELECT CASE WHEN current_setting('server_version_num')::int >= 140000 \
                    THEN pg_terminate_backend(pid, 5000) ELSE pg_terminate_backend(pid) END \
             FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
        )
        .bind(app_name(broker))
        .fetch_all(&mut conn)
        .await
        .expect("terminate the broker's sessions");
        let _ = conn.close().await;
        Some(killed.into_iter().filter(|k| *k).count())
    }

    async fn leaks(broker: &PgBroker) -> Vec<String> {
        let app = app_name(broker);
        for polls in 0.. {
            let mut out = Vec::new();
            let locks = count(
                "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND a.application_name = $1",
                &app,
            )
            .await;
            if locks > 0 {
                out.push(format!("{locks} advisory locks held"));
            }
            let open = count(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
                &app,
            )
            .await;
            if open > 0 {
                out.push(format!("{open} sessions idle in transaction"));
            }
            let pool = broker.pool();
            if !pool.is_closed() {
                let in_use = usize::try_from(pool.size())
                    .unwrap_or(usize::MAX)
                    .saturating_sub(pool.num_idle());
                if in_use > 0 {
                    out.push(format!("{in_use} pool connections in use"));
                }
            }
            if out.is_empty() || polls > 60 {
                return out;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        unreachable!()
    }

    async fn hold_row_lock(broker: &PgBroker, sql: &str) -> Option<Box<dyn std::any::Any + Send>> {
        Some(broker_testkit::hold_row_lock_on(broker.pool(), sql).await)
    }

    async fn session_id(conn: &mut sqlx::PgConnection) -> Option<i64> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("pg_backend_pid()");
        Some(i64::from(pid))
    }

    async fn execute(broker: &PgBroker, sql: &str) -> u64 {
        sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(broker.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn slow_down_deletes(broker: &PgBroker, table: &str) -> bool {
        let function = format!("{table}_slow_delete");
        let statements = [
            format!(
                "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN PERFORM pg_sleep(0.02); RETURN OLD; END $$",
                f = quote_double(&function)
            ),
            format!(
                "CREATE TRIGGER {t} BEFORE DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION {f}()",
                t = quote_double(&format!("{table}_slow")),
                table = quote_double(table),
                f = quote_double(&function)
            ),
        ];
        for sql in statements {
            broker
                .pool()
                .execute(AssertSqlSafe(sql))
                .await
                .expect("create the slow-delete trigger");
        }
        true
    }
}
