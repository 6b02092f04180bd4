//! What only a MySQL-family server shows: user locks as the server sees them (`IS_USED_LOCK`),
//! open transactions (the InnoDB monitor), killed connections, lock names over 64 characters,
//! time columns without fractions, publish ids without `RETURNING`, and the startup checks. Each
//! test has a database, tables and brokers of its own (see `common`); every wait is bounded.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use broker_core::{Broker, ClaimMode, ColumnType, NewJob, SqlxBrokerError, TableDescription};
use broker_mysql::{MySqlBackend, lock_name};
use broker_testkit::{Fixture, Job, JobText, claim_one, describe, unique_name, wait_until};
use common::MySql;
use sqlx::{AssertSqlSafe, Connection, Executor};

type Fx = Fixture<MySql>;

async fn fixture(
    mode: ClaimMode,
    tweak: impl FnOnce(broker_core::TableBuilder) -> broker_core::TableBuilder,
) -> Fx {
    Fixture::<MySql>::new(mode, tweak).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_longer_than_64_characters_locks_and_unlocks_by_its_hash() {
    let fx = fixture(ClaimMode::Advisory, |b| b).await;
    let q = fx.queue().await;
    let long = "é".repeat(70);
    q.publish(NewJob::new("long".to_owned()).column("k", long.clone()))
        .await
        .unwrap();
    let key = format!("key-{long}");
    let db = sqlx::query_scalar::<_, String>("SELECT DATABASE()")
        .fetch_one(fx.broker.pool())
        .await
        .unwrap();
    let hashed = lock_name(&db, &key);
    assert_eq!(hashed.len(), 64, "{hashed}");
    assert_eq!(
        fx.broker.backend().lock_name(&key).as_deref(),
        Some(hashed.as_str())
    );
    let used = |name: String| {
        let pool = fx.broker.pool().clone();
        async move {
            sqlx::query_scalar::<_, Option<i64>>("SELECT CAST(IS_USED_LOCK(?) AS SIGNED)")
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap()
                .is_some()
        }
    };
    let d = claim_one(&q).await;
    assert_eq!(d.key(), Some(key.as_str()));
    assert!(used(hashed.clone()).await, "the key is held under its hash");
    let raw = format!("{db}:{key}");
    assert!(raw.chars().count() > 64);
    if raw.len() <= 192 {
        assert!(!used(raw).await, "not under the raw name");
    }
    d.ack().await.unwrap();
    wait_until("the hashed key to be free", Duration::from_secs(5), || {
        let held = used(hashed.clone());
        async move { !held.await }
    })
    .await;
    fx.cleanup().await;
}

/// `stats()` asks each key's lock by the name the claim locks it under, computed in SQL: kept
/// as `"<database>:<key>"`, or hashed past 64 characters or for a character outside the Basic
/// Multilingual Plane, with quotes and backslashes in the key taken as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stats_find_held_keys_under_the_names_the_claims_lock() {
    let fx = fixture(ClaimMode::Advisory, |b| b).await;
    let q = fx.queue().await;
    let long = "é".repeat(70);
    let keys = [long.as_str(), long.as_str(), "party-🎉", "a'b\\c", "k1"];
    for k in keys {
        q.publish(NewJob::new("job".to_owned()).column("k", k.to_owned()))
            .await
            .unwrap();
    }
    let mut held = Vec::new();
    for _ in 0..50 {
        held.extend(q.claim(10).await.unwrap());
        if held.len() >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(held.len(), 4, "one delivery per key");
    let s = q.stats().await.unwrap();
    assert_eq!(
        (s.in_work.rows, s.due.rows),
        (4, 1),
        "every held key is found, the row behind the long one is due: {s:?}"
    );
    for d in held {
        d.ack().await.unwrap();
    }
    let s = q.stats().await.unwrap();
    assert_eq!((s.in_work.rows, s.due.rows), (0, 1), "{s:?}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_on_datetime_columns_without_fractions_still_fences() {
    let url = common::create_database().await;
    let broker = common::connect(&url).await;
    let name = unique_name("lsec");
    broker
        .pool()
        .execute(AssertSqlSafe(format!(
            "CREATE TABLE `{name}` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
             payload LONGTEXT NULL, attempt INT NOT NULL DEFAULT 1, \
             locked_until DATETIME NULL, due_at DATETIME NULL) ENGINE=InnoDB"
        )))
        .await
        .unwrap();
    let table = describe(&name, ClaimMode::Lease)
        .lease_seconds(1)
        .build()
        .unwrap();
    let q = broker.queue::<Job>(table).await.unwrap();
    let id = q.publish(NewJob::new("job".to_owned())).await.unwrap();
    let mut stale = claim_one(&q).await;
    let state = q.row_state(id).await.unwrap().unwrap();
    assert_eq!(
        state.locked_until_ms,
        stale.lease_expires_ms(),
        "a whole-second expiry is stored exactly"
    );
    assert_eq!(state.locked_until_ms.unwrap() % 1000, 0);
    // Renewal is fenced on the stored expiry too.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    stale.renew().await.expect("the renewal finds its token");
    let fresh = claim_one(&q).await; // waits for the renewed lease to run out
    assert_eq!((fresh.id(), fresh.attempt()), (id, 2));
    let before = q.row_state(id).await.unwrap().unwrap();
    let err = stale.ack().await.unwrap_err();
    assert!(
        matches!(err, SqlxBrokerError::LeaseLost { id: lost, .. } if lost == id),
        "{err:?}"
    );
    assert_eq!(
        q.row_state(id).await.unwrap().unwrap(),
        before,
        "nothing changed"
    );
    fresh.ack().await.unwrap();
    assert!(q.row_state(id).await.unwrap().is_none());
    broker.close().await;
    common::drop_database(&url).await;
}

async fn publish_as_mysql_would(autoinc_lock_mode: i64) {
    let url = common::create_database().await;
    let plain = common::connect(&url).await;
    let backend = plain
        .backend()
        .clone()
        .publish_like_mysql(autoinc_lock_mode);
    let broker = Broker::new(backend);
    let table = TableDescription::builder(unique_name("ids"))
        .payload("payload", ColumnType::Text)
        .priority("prio")
        .build()
        .unwrap();
    broker.create_tables(&table).await.unwrap();
    let q = broker.queue::<Job>(table.clone()).await.unwrap();
    // A concurrent publisher interleaves its rows with ours.
    let noise = {
        let q = q.clone();
        tokio::spawn(async move {
            for i in 0..20 {
                q.publish(NewJob::new(format!("noise-{i}"))).await.unwrap();
            }
        })
    };
    for round in 0..5 {
        let jobs: Vec<_> = (0..7)
            .map(|i| NewJob::new(format!("r{round}-{i}")).priority(i))
            .collect();
        let ids = q.publish_batch(&jobs).await.unwrap();
        assert_eq!(ids.len(), 7);
        for (i, id) in ids.iter().enumerate() {
            let payload: String = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT payload FROM `{}` WHERE id = ?",
                table.name()
            )))
            .bind(id)
            .fetch_one(broker.pool())
            .await
            .unwrap();
            assert_eq!(payload, format!("r{round}-{i}"), "id {id}");
        }
    }
    noise.await.unwrap();
    broker.drop_tables(&table).await.unwrap();
    broker.close().await;
    common::drop_database(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_ids_are_right_when_published_one_row_per_statement_as_on_mysql_8() {
    publish_as_mysql_would(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_ids_are_right_when_taken_from_last_insert_id_as_on_consecutive_mysql() {
    publish_as_mysql_would(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_scheduled_after_2038_stays_scheduled() {
    let fx = fixture(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    // 2040-01-01T00:00:00.250Z: FROM_UNIXTIME gives NULL there on MariaDB before 11.5.
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(2_208_988_800_250);
    let id = q
        .publish(NewJob::new("later".to_owned()).run_at(at))
        .await
        .unwrap();
    assert_eq!(
        q.row_state(id).await.unwrap().unwrap().due_ms,
        Some(2_208_988_800_250)
    );
    assert!(q.claim(1).await.unwrap().is_empty(), "not due before 2040");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_of_a_priority_table_do_not_lock_rows_they_do_not_take() {
    // With the claim index, a held row lock claim locks one row; a filesort would have locked
    // every row it scanned, and the second broker would get nothing.
    let mut fx = fixture(ClaimMode::RowLock, |b| {
        b.priority("prio").processed_at("done_at")
    })
    .await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let jobs: Vec<_> = (0..40)
        .map(|i| fx.job(i).priority(i64::try_from(i % 5).unwrap()))
        .collect();
    q.publish_batch(&jobs).await.unwrap();
    let first = claim_one(&q).await;
    let mut held = vec![first];
    for _ in 0..5 {
        let got = other.claim(1).await.unwrap();
        assert_eq!(got.len(), 1, "another broker claims while rows are held");
        held.extend(got);
    }
    let mut ids: Vec<i64> = held.iter().map(|d| d.id()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 6);
    for d in held {
        d.ack().await.unwrap();
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timestamp_column_needs_utc_sessions() {
    let url = common::create_database().await;
    let name = unique_name("tz");
    let utc = common::connect(&url).await;
    utc.pool()
        .execute(AssertSqlSafe(format!(
            "CREATE TABLE `{name}` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
             payload LONGTEXT NULL, attempt INT NOT NULL DEFAULT 1, \
             locked_until TIMESTAMP NULL, due_at DATETIME(6) NULL) ENGINE=InnoDB"
        )))
        .await
        .unwrap();
    let table = describe(&name, ClaimMode::Lease).build().unwrap();
    utc.queue::<Job>(table.clone())
        .await
        .expect("a TIMESTAMP column on UTC sessions");
    let options = MySqlBackend::connect_options(&url)
        .unwrap()
        .timezone(Some("+02:00".to_owned()));
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    let shifted = Broker::new(MySqlBackend::new(pool));
    let err = shifted.queue::<Job>(table).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, SqlxBrokerError::Setup { .. }), "{err:?}");
    assert!(
        msg.contains("\"locked_until\"") && msg.contains("TIMESTAMP") && msg.contains("UTC"),
        "{msg}"
    );
    // DATETIME columns do not depend on the session's zone.
    let plain = describe(&name, ClaimMode::RowLock).build().unwrap();
    shifted
        .queue::<Job>(plain)
        .await
        .expect("DATETIME columns only");
    shifted.close().await;
    utc.close().await;
    common::drop_database(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fifo_table_without_a_group_index_is_refused_naming_it() {
    let url = common::create_database().await;
    let broker = common::connect(&url).await;
    let name = unique_name("noidx");
    broker
        .pool()
        .execute(AssertSqlSafe(format!(
            "CREATE TABLE `{name}` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
             payload LONGTEXT NULL, attempt INT NOT NULL DEFAULT 1, \
             grp VARCHAR(255) NULL, due_at DATETIME(6) NULL) ENGINE=InnoDB"
        )))
        .await
        .unwrap();
    let table = describe(&name, ClaimMode::RowLock)
        .group("grp")
        .fifo(true)
        .build()
        .unwrap();
    let err = broker.queue::<Job>(table.clone()).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&name) && msg.contains("index") && msg.contains("\"grp\""),
        "{msg}"
    );
    broker
        .pool()
        .execute(AssertSqlSafe(format!("CREATE INDEX g ON `{name}` (grp)")))
        .await
        .unwrap();
    broker
        .queue::<Job>(table)
        .await
        .expect("with an index on the group");
    broker.close().await;
    common::drop_database(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_time_column_of_the_wrong_type_is_refused_naming_it() {
    let url = common::create_database().await;
    let broker = common::connect(&url).await;
    let name = unique_name("ty");
    broker
        .pool()
        .execute(AssertSqlSafe(format!(
            "CREATE TABLE `{name}` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
             payload LONGTEXT NULL, attempt VARCHAR(10) NOT NULL DEFAULT '1', \
             locked_until BIGINT NULL, due_at DATETIME(6) NULL) ENGINE=InnoDB"
        )))
        .await
        .unwrap();
    let table = describe(&name, ClaimMode::Lease).build().unwrap();
    let msg = broker.queue::<Job>(table).await.unwrap_err().to_string();
    assert!(
        msg.contains("\"attempt\"") && msg.contains("integer"),
        "{msg}"
    );
    broker
        .pool()
        .execute(AssertSqlSafe(format!(
            "ALTER TABLE `{name}` MODIFY attempt INT NOT NULL DEFAULT 1"
        )))
        .await
        .unwrap();
    let table = describe(&name, ClaimMode::Lease).build().unwrap();
    let msg = broker.queue::<Job>(table).await.unwrap_err().to_string();
    assert!(
        msg.contains("\"locked_until\"") && msg.contains("DATETIME"),
        "{msg}"
    );
    broker.close().await;
    common::drop_database(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_rolls_back_the_handlers_writes_but_keeps_the_row_locked() {
    let mut fx = fixture(ClaimMode::RowLock, |b| {
        b.max_attempts(5)
            .dead_letter(broker_core::DeadLetter::Column("dead_at".into()))
    })
    .await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let id = fx.publish(&q, 1).await[0];
    let mut d = claim_one(&q).await;
    let tx = d.transaction().await.unwrap().unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE `{}` SET payload = 'changed by the handler' WHERE id = ?",
        fx.table.name()
    )))
    .bind(id)
    .execute(&mut **tx)
    .await
    .unwrap();
    assert!(other.claim(1).await.unwrap().is_empty());
    d.retry().await.unwrap();
    let again = claim_one(&other).await;
    assert_eq!(again.attempt(), 2);
    assert_eq!(
        again.payload().text(),
        "job-0",
        "the handler's write was rolled back"
    );
    again.dead_letter().await.unwrap();
    let state = q.row_state(id).await.unwrap().unwrap();
    assert!(state.dead);
    assert_eq!(state.attempt, 3, "the dead letter counted its attempt");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_advisory_settlement_is_fenced_on_the_attempt_its_take_wrote() {
    let fx = fixture(ClaimMode::Advisory, |b| b.processed_at("done_at")).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let d = claim_one(&q).await;
    // Stand-in for a take by another session after this delivery's key went away.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE `{}` SET attempt = attempt + 1 WHERE id = ?",
        fx.table.name()
    )))
    .bind(id)
    .execute(fx.broker.pool())
    .await
    .unwrap();
    let err = d.ack().await.unwrap_err();
    assert!(
        matches!(err, SqlxBrokerError::ClaimLost { id: lost, .. } if lost == id),
        "{err:?}"
    );
    let state = q.row_state(id).await.unwrap().unwrap();
    assert!(!state.processed, "the fenced ack changed nothing");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_lock_dropped_without_unlock_closes_its_connection_and_frees_the_key() {
    use broker_core::Backend;
    use broker_core::driver::{AdvisoryStrategy, Prepared};
    let fx = fixture(ClaimMode::Advisory, |b| b).await;
    let table = std::sync::Arc::new(fx.table.clone());
    let Prepared::Advisory(s) = fx.broker.backend().prepare(&table).await.unwrap() else {
        panic!("an advisory table prepares as advisory");
    };
    let lock = s
        .try_lock("key-dropped")
        .await
        .unwrap()
        .expect("a free key");
    let holder: u64 = sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)")
        .bind(lock.name())
        .fetch_one(fx.broker.pool())
        .await
        .unwrap();
    assert!(
        s.try_lock("key-dropped").await.unwrap().is_none(),
        "held once"
    );
    drop(lock);
    wait_until("the key to be free", Duration::from_secs(5), || {
        let broker = fx.broker.clone();
        async move { !common::key_is_held(&broker, "key-dropped").await }
    })
    .await;
    let mut admin = common::admin().await;
    let alive: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
            .bind(holder)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    assert_eq!(
        alive, 0,
        "the lock's connection was closed, not returned to the pool"
    );
    // An unlocked key's connection goes back to the pool instead.
    let lock = s.try_lock("key-unlocked").await.unwrap().unwrap();
    let holder: u64 = sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)")
        .bind(lock.name())
        .fetch_one(fx.broker.pool())
        .await
        .unwrap();
    s.unlock(lock).await.unwrap();
    assert!(!common::key_is_held(&fx.broker, "key-unlocked").await);
    let alive: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
            .bind(holder)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    assert_eq!(alive, 1, "an unlocked key's connection is kept");
    let _ = sqlx::Connection::close(admin).await;
    fx.cleanup().await;
}

/// Rows locked by another transaction, as deliveries in work under row lock hold them: a claim
/// window (32 ids, read without locks) sees them as candidates, so a claim must read on.
async fn a_claim_reads_on_past_windows_of_locked_rows(mode: ClaimMode) {
    let fx = fixture(mode, |b| b).await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 80).await;
    let mut holder = sqlx::MySqlConnection::connect(&fx.url).await.unwrap();
    holder
        .execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await
        .unwrap();
    let locked: Vec<(i64,)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id FROM `{}` ORDER BY id LIMIT 70 FOR UPDATE",
        fx.table.name()
    )))
    .fetch_all(&mut holder)
    .await
    .unwrap();
    assert_eq!(locked.len(), 70);
    let got = q.claim(1).await.unwrap();
    assert_eq!(
        got.iter().map(|d| d.id()).collect::<Vec<_>>(),
        vec![ids[70]],
        "{mode:?}: the first row nobody holds, past two full windows of held rows"
    );
    for d in got {
        d.ack().await.unwrap();
    }
    holder.execute("ROLLBACK").await.unwrap();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_lock_claim_reads_on_past_windows_of_locked_rows() {
    a_claim_reads_on_past_windows_of_locked_rows(ClaimMode::RowLock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_claim_reads_on_past_windows_of_locked_rows() {
    a_claim_reads_on_past_windows_of_locked_rows(ClaimMode::Lease).await;
}

/// The claim window's take locks in id order, so it may only take from a run of rising ids:
/// with priorities that rise with the id, every claim must still take the highest priority.
async fn claims_keep_priority_order_when_ids_fall(mode: ClaimMode) {
    let fx = fixture(mode, |b| b.priority("prio").processed_at("done_at")).await;
    let q = fx.queue().await;
    let jobs: Vec<_> = (0..12)
        .map(|i| fx.job(i).priority(i64::try_from(i).unwrap()))
        .collect();
    let ids = q.publish_batch(&jobs).await.unwrap();
    let mut order = Vec::new();
    for _ in 0..12 {
        let d = claim_one(&q).await;
        order.push(d.id());
        d.ack().await.unwrap();
    }
    let expected: Vec<i64> = ids.iter().rev().copied().collect();
    assert_eq!(order, expected, "{mode:?}: highest priority first");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn row_lock_claims_keep_priority_order_when_ids_fall() {
    claims_keep_priority_order_when_ids_fall(ClaimMode::RowLock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_claims_keep_priority_order_when_ids_fall() {
    claims_keep_priority_order_when_ids_fall(ClaimMode::Lease).await;
}

/// A fixture of `mode` with 10 rows published (their ids) and the strategy the backend prepares
/// for its table, to drive as the engine drives it.
async fn prepared_with_rows(
    mode: ClaimMode,
) -> (Fx, Vec<i64>, broker_core::driver::Prepared<MySqlBackend>) {
    use broker_core::Backend;
    let fx = fixture(mode, |b| b).await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 10).await;
    let described = std::sync::Arc::new(fx.table.clone());
    let prepared = fx
        .broker
        .backend()
        .prepare(&described)
        .await
        .expect("prepare");
    (fx, ids, prepared)
}

/// The rows after `first` (the rest of the window a claim of `first` read), gone as if other
/// claims took them, and a new row inserted by plain SQL.
async fn take_the_rest_and_insert_one(fx: &Fx, first: i64) {
    let table = fx.table.name();
    for sql in [
        format!("DELETE FROM `{table}` WHERE id > {first}"),
        format!("INSERT INTO `{table}` (payload) VALUES ('late')"),
    ] {
        fx.broker.pool().execute(AssertSqlSafe(sql)).await.unwrap();
    }
}

/// A row lock settlement that keeps its connection commits and begins without reading a window
/// when the rest of a recent window is kept (`Spare`); the next claim locks among those ids. When
/// other sessions have taken or removed every one of them meanwhile, that claim must read a
/// window instead of ending: ending would tell the subscription that the table looks drained
/// while a row is due. Driven through the strategy, as the engine drives it: a claim (a window
/// read; the rest of it kept), the rows after it deleted and a new row inserted by plain SQL,
/// the ack keeping its connection, and a claim that must find the new row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_whose_kept_ids_were_all_taken_reads_a_window_instead_of_ending() {
    use broker_core::driver::{Action, Prepared, RowLockStrategy, Settle, clock};

    let (fx, ids, prepared) = prepared_with_rows(ClaimMode::RowLock).await;
    let Prepared::RowLock(rows) = prepared else {
        panic!("a row lock table prepares its row lock strategy")
    };
    let (tx, first) = rows
        .claim(clock::now_ms(), None)
        .await
        .expect("claim")
        .expect("a due row");
    assert_eq!(first.id, ids[0]);
    take_the_rest_and_insert_one(&fx, ids[0]).await;
    let ack = Settle {
        id: first.id,
        action: Action::Ack,
        now_ms: clock::now_ms(),
        attempt: first.attempt,
    };
    rows.settle(tx, ack, false, true).await.expect("ack");
    let (tx, late) = rows
        .claim(clock::now_ms(), None)
        .await
        .expect("claim")
        .expect("the row inserted after the kept ids were taken is claimed");
    assert!(late.id > ids[9], "the new row, not {}", late.id);
    drop(tx);
    drop(rows);
    fx.cleanup().await;
}

/// The same for lease claims: a claim among kept ids that others took since reads a window
/// instead of ending. Driven through the strategy: a claim (a window read; the rest kept), the
/// rows after it deleted and a new row inserted by plain SQL, and a claim that must find the
/// new row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_claim_whose_kept_ids_were_all_taken_reads_a_window_instead_of_ending() {
    use broker_core::driver::{LeaseStrategy, Prepared, clock};

    let (fx, ids, prepared) = prepared_with_rows(ClaimMode::Lease).await;
    let Prepared::Lease(lease) = prepared else {
        panic!("a lease table prepares its lease strategy")
    };
    let claim = || async {
        let now = clock::now_ms();
        lease
            .claim(1, now, now + 60_000, None)
            .await
            .expect("claim")
    };
    let first = claim().await;
    assert_eq!(first.iter().map(|r| r.id).collect::<Vec<_>>(), [ids[0]]);
    take_the_rest_and_insert_one(&fx, ids[0]).await;
    let late = claim().await;
    assert_eq!(
        late.len(),
        1,
        "the row inserted after the kept ids were taken is claimed"
    );
    assert!(late[0].id > ids[9], "the new row, not {}", late[0].id);
    drop(lease);
    fx.cleanup().await;
}

/// The leak probe reads open transactions live. InnoDB refreshes `INNODB_TRX` only once nobody
/// has read it for 100 ms, so with another session polling it every 20 ms (as tests side by side
/// do) a transaction that ended stays in that table; the probe must see it end (#35).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_that_ended_is_not_reported_open_while_innodb_trx_is_polled() {
    let fx = fixture(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    fx.publish(&q, 1).await;
    // The case shows something only where the cache held the ended transaction while the
    // probe looked; a loaded machine can stall the poller past 100 ms, so up to 5 tries.
    let mut held = Vec::new();
    for _ in 0..5 {
        let after_commit = end_a_transaction_while_innodb_trx_is_polled(&fx).await;
        let kept = after_commit.first().is_some_and(|n| *n > 0);
        held.push(after_commit);
        if kept {
            break;
        }
    }
    assert!(
        held.last().and_then(|a| a.first()).is_some_and(|n| *n > 0),
        "INNODB_TRX, polled every 20 ms, never listed the ended transaction after its commit, \
         so the case showed nothing: {held:?}"
    );
    assert!(common::leaks(&fx.broker).await.is_empty());
    fx.cleanup().await;
}

/// Opens a transaction holding the fixture's rows on a connection of its broker, has another
/// session read `INNODB_TRX` every 20 ms (two reads at least before the commit), commits, and
/// waits (3 s at most) for the leak probe to see no transaction of the broker open. Returns what
/// `INNODB_TRX` counted in its reads after the commit.
async fn end_a_transaction_while_innodb_trx_is_polled(fx: &Fx) -> Vec<i64> {
    let mut conn = fx.broker.pool().acquire().await.unwrap();
    conn.execute("START TRANSACTION").await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id FROM `{}` FOR UPDATE",
        fx.table.name()
    )))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert_eq!(common::open_transactions(&fx.broker).await, 1);
    let (reads, committed, stop) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let poller = tokio::spawn({
        let (url, reads) = (fx.url.clone(), reads.clone());
        let (committed, stop) = (committed.clone(), stop.clone());
        async move {
            let mut other = sqlx::MySqlConnection::connect(&url).await.unwrap();
            let mut after_commit = Vec::new();
            // At least 10 reads after the commit, and on until the probe has seen it end.
            while after_commit.len() < 10 || !stop.load(Ordering::SeqCst) {
                let before = committed.load(Ordering::SeqCst);
                let n: i64 = sqlx::query_scalar(
                    "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.INNODB_TRX",
                )
                .fetch_one(&mut other)
                .await
                .unwrap();
                reads.fetch_add(1, Ordering::SeqCst);
                if before {
                    after_commit.push(n);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = other.close().await;
            after_commit
        }
    });
    wait_until(
        "two reads of INNODB_TRX",
        Duration::from_secs(10),
        || async { reads.load(Ordering::SeqCst) >= 2 },
    )
    .await;
    conn.execute("COMMIT").await.unwrap();
    committed.store(true, Ordering::SeqCst);
    drop(conn);
    wait_until(
        "the probe to see the transaction end",
        Duration::from_secs(3),
        || async { common::open_transactions(&fx.broker).await == 0 },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    poller.await.unwrap()
}

/// The monitor's transaction list: only `ACTIVE` transactions count, with the session of their
/// `thread id` line, as MariaDB and MySQL print them.
#[test]
fn the_monitor_lists_active_transactions_with_their_sessions() {
    let monitor = "\
------------
TRANSACTIONS
------------
Trx id counter 1261269
History list length 0
LIST OF TRANSACTIONS FOR EACH SESSION:
---TRANSACTION 421587029063000, not started
0 lock struct(s), heap size 1128, 0 row lock(s)
---TRANSACTION 1146538, ACTIVE 6 sec
2 lock struct(s), heap size 1128, 4 row lock(s)
MariaDB thread id 46017, OS thread handle 139670659847872, query id 30 127.0.0.1 root
---TRANSACTION 1146539, ACTIVE 2 sec fetching rows
mysql tables in use 1, locked 1
MySQL thread id 12, OS thread handle 1396, query id 31 localhost root executing
SELECT 1
--------
FILE I/O
--------
---TRANSACTION 9, ACTIVE 1 sec
MariaDB thread id 99, OS thread handle 1, query id 1
";
    let open = common::active_transactions(monitor);
    let ids: Vec<u64> = open.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, [46017, 12], "{open:?}");
    assert!(open[0].1.contains("4 row lock(s)"));
}

/// The conformance case of names and key pieces that end string literals, on sessions with
/// `NO_BACKSLASH_ESCAPES` (the conformance suite runs it on the server's default, where a
/// backslash escapes): the broker writes its own texts as hex, which reads the same either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_no_backslash_escapes_names_and_key_pieces_that_end_string_literals_work() {
    broker_testkit::cases::names_and_key_pieces_that_end_string_literals_work_in_every_statement::<
        common::MySqlNoBackslashEscapes,
    >()
    .await;
}

/// The server's count of the bytes it sent this session (`Bytes_sent`), read on `pool`'s one
/// connection.
async fn bytes_sent(pool: &sqlx::MySqlPool) -> i64 {
    let row: (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Bytes_sent'")
        .fetch_one(pool)
        .await
        .expect("read Bytes_sent");
    row.1.parse().expect("a number")
}

/// A long `last_error` is cut by the server, not after it arrived: a listing of a row with
/// 60,000 bytes of error receives a few kilobytes (the pool has one connection, so the
/// session's `Bytes_sent` counts the listing alone, with the one status read before it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listing_receives_only_the_preview_of_a_long_last_error() {
    let fx = fixture(ClaimMode::Lease, |b| b.last_error("last_error")).await;
    let id = fx
        .queue()
        .await
        .publish(NewJob::new("p".to_owned()))
        .await
        .unwrap();
    let sql = format!(
        "UPDATE `{}` SET last_error = REPEAT('e', 60000) WHERE id = ?",
        fx.table.name()
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(id)
        .execute(fx.broker.pool())
        .await
        .unwrap();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(MySqlBackend::connect_options(&fx.url).unwrap())
        .await
        .unwrap();
    let broker = Broker::new(MySqlBackend::new(pool.clone()));
    let q = broker.queue::<Job>(fx.table.clone()).await.unwrap();
    let before = bytes_sent(&pool).await;
    let listed = q
        .jobs(broker_core::JobState::Due, broker_core::Page::first(10))
        .await
        .unwrap();
    let sent = bytes_sent(&pool).await - before;
    assert_eq!(listed.len(), 1);
    assert!(listed[0].last_error_cut);
    assert!(
        sent < 10_000,
        "the server sent {sent} bytes for a listing of one row"
    );
    broker.close().await;
    fx.cleanup().await;
}

/// On MariaDB a lease table that keeps acked rows (`processed_at`) acks one row per statement,
/// so `batched_acks` stays 0 however close together the acks finish: an ack there is an
/// `UPDATE`, and MariaDB returns rows from a `DELETE` but not from an `UPDATE`, so a shared
/// statement could not say which rows its per-row fence let through. (docs/operating.md says
/// so beside the counter.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_table_that_keeps_acked_rows_acks_each_row_alone_on_mariadb() {
    let fx = fixture(ClaimMode::Lease, |b| b.processed_at("processed_at")).await;
    let q = fx.queue().await;
    fx.publish(&q, 8).await;
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(claim_one(&q).await);
    }
    let mut acks = tokio::task::JoinSet::new();
    for d in held {
        acks.spawn(d.ack());
    }
    while let Some(done) = acks.join_next().await {
        done.expect("an ack task").expect("ack");
    }
    let m = q.metrics();
    assert_eq!((m.acked, m.batched_acks), (8, 0), "{m:?}");
    fx.cleanup().await;
}
