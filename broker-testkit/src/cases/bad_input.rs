//! Bad input: identifiers that need quoting, values that look like SQL, NULL keys, columns of
//! the wrong type. Each gets a clear error or is handled, and nothing is lost.

use broker_core::{
    ClaimMode, ColumnType, DeadLetter, NewJob, SqlxBrokerError, TableDescription, Value,
};

use super::claim_one;
use crate::{JobText, TestDb, unique_name};

/// Table and column names with spaces, quotes, backticks and reserved words, and payloads and
/// group values that look like SQL, round-trip through publish, claim and settlement: no
/// statement pastes a value or an unquoted name.
pub async fn identifiers_and_values_that_look_like_sql_round_trip<D: TestDb>(mode: ClaimMode) {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let name = format!("{} x\"y'z`order", unique_name("q"));
    let dead = format!("{} dead\"", unique_name("q"));
    let b = TableDescription::builder(name.as_str())
        .id("select")
        .attempt("group by")
        .payload("from", ColumnType::Text)
        .due_at("order")
        .group("table")
        .fifo(true)
        .priority("desc \"p\"")
        .max_attempts(2)
        .dead_letter(DeadLetter::Table(dead));
    let table = match mode {
        ClaimMode::RowLock => b,
        ClaimMode::Lease => b.locked_until("lock`ed"),
        ClaimMode::Advisory => b
            .column("where", ColumnType::Text)
            .advisory_lock("k-{where}"),
        other => panic!("the suite has no case for claim mode {other:?}"),
    }
    .build()
    .unwrap();
    broker
        .create_tables(&table)
        .await
        .expect("the DDL quotes every identifier");
    let queue = broker
        .queue::<D::Job>(table.clone())
        .await
        .expect("every statement prepares");
    let nasty = [
        "'); DROP TABLE jobs; --",
        "\" OR 1=1 --",
        "` ; DELETE FROM x",
        "$1 ? ?1 :name @x",
        "naïve ✓ 😀",
    ];
    for (i, text) in nasty.iter().enumerate() {
        let mut job = NewJob::new(D::Text::from((*text).to_owned()))
            .group(format!("g'{i}\""))
            .priority(1);
        if mode == ClaimMode::Advisory {
            job = job.column("where", format!("'; SELECT {i}"));
        }
        queue.publish(job).await.unwrap();
    }
    let mut seen = Vec::new();
    for _ in 0..nasty.len() {
        let d = claim_one::<D>(&queue).await;
        seen.push(d.payload().text().to_owned());
        if mode == ClaimMode::Advisory {
            assert!(
                d.key().unwrap().starts_with("k-'; SELECT "),
                "{:?}",
                d.key()
            );
        }
        d.ack().await.unwrap();
    }
    seen.sort();
    let mut expected: Vec<String> = nasty.iter().map(|s| (*s).to_owned()).collect();
    expected.sort();
    assert_eq!(seen, expected);
    let d = {
        queue
            .publish(NewJob::new(D::Text::from("to the dead".to_owned())).group("g"))
            .await
            .unwrap();
        claim_one::<D>(&queue).await
    };
    let id = d.id();
    d.dead_letter().await.unwrap();
    assert!(queue.row_state(id).await.unwrap().unwrap().dead);
    broker.drop_tables(&table).await.unwrap();
    broker.close().await;
    D::drop_database(&url).await;
}

/// An advisory key column that is NULL renders as the empty string: the row gets the key
/// `"key-"` and is delivered, not lost.
pub async fn a_null_key_value_is_delivered_under_the_empty_key<D: TestDb>() {
    let fx = crate::Fixture::<D>::new(ClaimMode::Advisory, |b| b).await;
    let q = fx.queue().await;
    let id = q
        .publish(NewJob::new(D::Text::from("no key".to_owned())).column("k", Value::Null))
        .await
        .unwrap();
    let d = claim_one::<D>(&q).await;
    assert_eq!((d.id(), d.key()), (id, Some("key-")));
    d.ack().await.unwrap();
    fx.cleanup().await;
}

/// An attempt column of the wrong type (text) is refused at subscribe time, naming the column.
pub async fn a_text_attempt_column_is_a_schema_error_naming_it<D: TestDb>() {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let name = unique_name("wrongtype");
    // Create the table with a text column called "attempt" (and the real counter elsewhere).
    let ddl = TableDescription::builder(name.as_str())
        .payload("payload", ColumnType::Text)
        .attempt("attempt_counter")
        .column("attempt", ColumnType::Text)
        .locked_until("locked_until")
        .build()
        .unwrap();
    broker.create_tables(&ddl).await.unwrap();
    let wrong = TableDescription::builder(name.as_str())
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .build()
        .unwrap();
    let err = broker.queue::<D::Job>(wrong).await.unwrap_err();
    assert!(matches!(err, SqlxBrokerError::Schema { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&name) && msg.contains("\"attempt\""), "{msg}");
    broker.drop_tables(&ddl).await.unwrap();
    broker.close().await;
    D::drop_database(&url).await;
}

/// A table with only the columns its mode needs (no due time, priority, group or dead letter)
/// claims, retries and acks: every statement still binds what it declares.
pub async fn a_table_with_only_the_required_columns_works<D: TestDb>(mode: ClaimMode) {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let b = TableDescription::builder(unique_name("bare")).payload("payload", ColumnType::Text);
    let table = match mode {
        ClaimMode::RowLock => b,
        ClaimMode::Lease => b.locked_until("locked_until"),
        ClaimMode::Advisory => b.column("k", ColumnType::Text).advisory_lock("key-{k}"),
        other => panic!("the suite has no case for claim mode {other:?}"),
    }
    .build()
    .unwrap();
    broker.create_tables(&table).await.unwrap();
    let q = broker
        .queue::<D::Job>(table.clone())
        .await
        .expect("prepare a bare table");
    let mut job = NewJob::new(D::Text::from("bare".to_owned()));
    if mode == ClaimMode::Advisory {
        job = job.column("k", "one");
    }
    let id = q.publish(job).await.unwrap();
    let d = claim_one::<D>(&q).await;
    assert_eq!((d.id(), d.attempt()), (id, 1));
    d.retry().await.unwrap();
    // A delayed retry of no delay needs no due-time column: it is a plain retry.
    let d = claim_one::<D>(&q).await;
    assert_eq!(d.attempt(), 2);
    d.retry_after(std::time::Duration::ZERO)
        .await
        .expect("a retry after zero is a plain retry, without a due-time column");
    let d = claim_one::<D>(&q).await;
    assert_eq!(d.attempt(), 3);
    d.ack().await.unwrap();
    assert!(q.row_state(id).await.unwrap().is_none());
    broker.drop_tables(&table).await.unwrap();
    broker.close().await;
    D::drop_database(&url).await;
}
