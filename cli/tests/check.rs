//! `sqlx-broker check` against the local servers: it runs cases from the suite, reports them,
//! leaves nothing behind (after a case that fails too), and refuses a user without the rights it
//! needs before it runs anything.
//!
//! Each run is cut to a few cases with `--case`: the whole suite runs in CI through the
//! backends' own tests, and the check runs those same functions (see `src/check`).

use std::collections::BTreeSet;
use std::process::{Command, Output};

use sqlx::{AssertSqlSafe, Connection, Executor};

fn pg_url() -> String {
    std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn mysql_url() -> String {
    std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// Runs `sqlx-broker check` on `url` with `args` (and `envs`); returns its output and pid.
fn check(url: &str, args: &[&str], envs: &[(&str, &str)]) -> (Output, u32) {
    let child = Command::new(env!("CARGO_BIN_EXE_sqlx-broker"))
        .args(["check", "--url", url])
        .args(args)
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run sqlx-broker check");
    let pid = child.id();
    (child.wait_with_output().expect("its output"), pid)
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Two quick cases, one of a mode and one of no mode, and a kill case whose worker is this
/// program re-run as a child.
const CASES: &[&str] = &[
    "lease::ack_deletes_the_row",
    "a_publish_in_a_rolled_back_transaction_leaves_no_row",
    "lease::a_killed_worker_gives_its_rows_back",
];

fn case_args(extra: &[&'static str]) -> Vec<&'static str> {
    let mut args = Vec::new();
    for c in CASES {
        args.push("--case");
        args.push(*c);
    }
    args.extend_from_slice(extra);
    args
}

/// Asserts a passing run's report: each case held, in the table and in JSON.
fn assert_held(o: &Output) {
    let out = text(o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(json["held"], true, "{out}");
    let cases = json["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), CASES.len(), "{out}");
    assert!(cases.iter().all(|c| c["verdict"] == "held"), "{out}");
    assert_eq!(json["cleaned_up"], true, "{out}");
}

/// Everything on the PostgreSQL server whose name a check run of `pid` gives: schemas, tables in
/// any schema of the database, databases.
async fn pg_objects_of(conn: &mut sqlx::PgConnection, pid: u32) -> BTreeSet<String> {
    let pattern = format!("%\\_{pid}\\_%");
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT 'schema ' || nspname FROM pg_namespace WHERE nspname LIKE $1 \
         UNION ALL SELECT 'table ' || schemaname || '.' || tablename FROM pg_tables \
           WHERE tablename LIKE $1 OR schemaname LIKE $1 \
         UNION ALL SELECT 'database ' || datname FROM pg_database WHERE datname LIKE $1",
    )
    .bind(pattern)
    .fetch_all(conn)
    .await
    .unwrap();
    rows.into_iter().collect()
}

/// The schemas of the PostgreSQL database (other tests make databases, not schemas).
async fn pg_schemas(conn: &mut sqlx::PgConnection) -> BTreeSet<String> {
    sqlx::query_scalar("SELECT nspname::text FROM pg_namespace")
        .fetch_all(conn)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn check_on_postgres_reports_the_cases_and_leaves_no_schema_or_table() {
    let url = pg_url();
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let before = pg_schemas(&mut conn).await;
    let (o, pid) = check(&url, &case_args(&["--json"]), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("schema sqlx_broker_check_{pid}_")),
        "{err}"
    );
    // What is left first: a failed clean-up also fails the run, and its leftovers say more.
    assert_eq!(pg_objects_of(&mut conn, pid).await, BTreeSet::new());
    assert_eq!(pg_schemas(&mut conn).await, before);
    assert_held(&o);

    // A case that fails (a one-second limit it cannot meet): reported as not held, by name,
    // and the scratch schema is dropped all the same.
    let (o, pid) = check(
        &url,
        &["--case", "renewal_keeps_a_handler_that_runs_three_leases"],
        &[("SQLX_BROKER_CASE_TIMEOUT", "1")],
    );
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("NOT HELD"), "{out}");
    assert!(
        out.contains("renewal_keeps_a_handler_that_runs_three_leases ("),
        "{out}"
    );
    assert!(
        out.contains("did not finish within its limit of 1 s"),
        "{out}"
    );
    assert!(
        out.contains("Cleaned up: schema sqlx_broker_check_"),
        "{out}"
    );
    assert_eq!(pg_objects_of(&mut conn, pid).await, BTreeSet::new());
    assert_eq!(pg_schemas(&mut conn).await, before);
    conn.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn check_on_mariadb_leaves_no_database_or_table() {
    let url = mysql_url();
    let mut conn = sqlx::MySqlConnection::connect(&url).await.unwrap();
    let databases = |pid: u32| {
        format!(
            "SELECT CAST(SCHEMA_NAME AS CHAR) FROM information_schema.SCHEMATA \
             WHERE SCHEMA_NAME LIKE '%\\_{pid}\\_%' UNION ALL \
             SELECT CAST(CONCAT(TABLE_SCHEMA, '.', TABLE_NAME) AS CHAR) \
             FROM information_schema.TABLES WHERE TABLE_NAME LIKE '%\\_{pid}\\_%'"
        )
    };
    let (o, pid) = check(&url, &case_args(&["--json"]), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("database sqlx_broker_check_{pid}_")),
        "{err}"
    );
    let left: Vec<String> = sqlx::query_scalar(AssertSqlSafe(databases(pid)))
        .fetch_all(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, Vec::<String>::new());
    assert_held(&o);
    conn.close().await.unwrap();
}

#[test]
fn check_on_sqlite_leaves_no_file() {
    let dir = std::env::temp_dir().join(format!("sqlx-broker-check-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/app.db", dir.display());
    let (o, _) = check(&url, &case_args(&["--json"]), &[]);
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        left.is_empty(),
        "the check left {left:?} in {}",
        dir.display()
    );
    assert_held(&o);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn check_refuses_a_postgres_role_without_create_and_says_what_to_grant() {
    let url = pg_url();
    let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
    let role = format!("sbc_norights_{}", std::process::id());
    // The role may connect and use one schema, and create nothing: no CREATE on the database
    // (for a schema of its own), none on the schema its search_path names (the fallback).
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("CREATE SCHEMA {role}"),
        format!("GRANT CONNECT ON DATABASE test TO {role}"),
        format!("GRANT USAGE ON SCHEMA {role} TO {role}"),
        format!("ALTER ROLE {role} SET search_path = {role}"),
    ] {
        admin.execute(AssertSqlSafe(sql)).await.unwrap();
    }
    let base = url.split_once("://").unwrap().1;
    let host_and_db = base.rsplit_once('@').map_or(base, |(_, h)| h);
    let role_url = format!("postgres://{role}@{host_and_db}");
    let (o, pid) = check(&role_url, &case_args(&[]), &[]);
    let out = text(&o);
    let leftover = pg_objects_of(&mut admin, pid).await;
    for sql in [
        format!("DROP SCHEMA {role}"),
        format!("REVOKE CONNECT ON DATABASE test FROM {role}"),
        format!("DROP ROLE {role}"),
    ] {
        admin.execute(AssertSqlSafe(sql)).await.unwrap();
    }
    admin.close().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains(&format!("role \"{role}\" may not create a schema")),
        "{out}"
    );
    assert!(
        out.contains(&format!("GRANT CREATE ON DATABASE \"test\" TO \"{role}\"")),
        "{out}"
    );
    assert!(!out.contains("[  1/"), "no case ran: {out}");
    assert_eq!(leftover, BTreeSet::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn check_refuses_a_mariadb_user_without_create_and_says_what_to_grant() {
    let url = mysql_url();
    let mut admin = sqlx::MySqlConnection::connect(&url).await.unwrap();
    let user = format!("sbc_nocreate_{}", std::process::id());
    // A database of the test's own, so what other software left in the server's `test`
    // database (the broker's shared tables, say) cannot change which refusal the check gives.
    let database = format!("sbc_nocreate_db_{}", std::process::id());
    for sql in [
        format!("CREATE DATABASE `{database}`"),
        format!("CREATE USER '{user}'@'%'"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.* TO '{user}'@'%'"),
    ] {
        admin.execute(AssertSqlSafe(sql)).await.unwrap();
    }
    let base = url.split_once("://").unwrap().1;
    let host = base.rsplit_once('@').map_or(base, |(_, h)| h);
    let host = host.split_once('/').map_or(host, |(h, _)| h);
    let user_url = format!("mysql://{user}@{host}/{database}");
    let (o, pid) = check(&user_url, &case_args(&[]), &[]);
    let out = text(&o);
    let left: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT CAST(SCHEMA_NAME AS CHAR) FROM information_schema.SCHEMATA \
         WHERE SCHEMA_NAME LIKE '%\\_{pid}\\_%'"
    )))
    .fetch_all(&mut admin)
    .await
    .unwrap();
    for sql in [
        format!("DROP USER '{user}'@'%'"),
        format!("DROP DATABASE `{database}`"),
    ] {
        admin.execute(AssertSqlSafe(sql)).await.unwrap();
    }
    admin.close().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("may not create a database"), "{out}");
    assert!(
        out.contains("GRANT ALL ON `sqlx\\_broker\\_check\\_%`.*"),
        "{out}"
    );
    assert!(out.contains("nor CREATE"), "{out}");
    assert!(!out.contains("[  1/"), "no case ran: {out}");
    assert_eq!(left, Vec::<String>::new());
}
