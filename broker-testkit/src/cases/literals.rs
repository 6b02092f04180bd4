//! Names and texts that a statement writes in as string literals instead of binding them (key
//! template pieces, table and column names in catalog reads and DDL): each must stay one
//! literal whatever it holds and however the session reads backslashes.

use broker_core::{ClaimMode, ColumnType, JobState, NewJob, Page, Queue, Status, TableDescription};

use super::claim_one;
use crate::{JobText, TestDb, unique_name};

/// What the case puts at the end of each name and into each literal piece of the key
/// template: PostgreSQL's dollar-quote tag (which ended the block that dropped a queue's pause),
/// a backslash before a quote (an escaped quote where backslashes escape: MySQL and MariaDB
/// unless `NO_BACKSLASH_ESCAPES` is set, PostgreSQL with `standard_conforming_strings` off, so
/// a literal that only doubles quotes ends there), and a backslash last (which escapes the
/// closing quote there).
pub const AWKWARD: &str = "$sqlx_broker$\\'x\\";

/// The key the case's template renders for `value`.
fn key(value: &str) -> String {
    format!("{AWKWARD}{value}-{AWKWARD}")
}

/// Publishes a row whose key column holds `value` and whose unique key is `value` too.
async fn publish<D: TestDb>(q: &Queue<D::B, D::Job>, k: &str, value: &str) -> i64 {
    let job = NewJob::new(D::Text::from(format!("payload {value}")))
        .column(k, value.to_owned())
        .unique_key(value);
    q.publish(job).await.expect("publish")
}

/// A table, its key column, its unique key column and its key template's literal pieces all
/// end in [`AWKWARD`]; so do key values. Every statement still works: the DDL, the prepared
/// claim statements, the counts by state and the listing (which render the key in SQL), the
/// doctor's catalog reads, and dropping the tables, which deletes the queue's pause so that a
/// table made again under the name does not start paused. Backends stamp it again for sessions
/// that read backslashes as escapes (PostgreSQL with `standard_conforming_strings` off, MariaDB
/// without `NO_BACKSLASH_ESCAPES` and with it).
pub async fn names_and_key_pieces_that_end_string_literals_work_in_every_statement<D: TestDb>() {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let name = format!("{}{AWKWARD}", unique_name("lit"));
    let k = format!("k{AWKWARD}");
    let u = format!("u{AWKWARD}");
    let table = TableDescription::builder(name.as_str())
        .payload("payload", ColumnType::Text)
        .due_at("due_at")
        .column(k.as_str(), ColumnType::Text)
        .advisory_lock(key(&format!("{{{k}}}")).as_str())
        .unique_key(u.as_str())
        .build()
        .expect("the case's description is valid");
    assert_eq!(table.mode(), ClaimMode::Advisory);
    broker
        .create_tables(&table)
        .await
        .expect("the DDL keeps every name whole");
    let q = broker
        .queue::<D::Job>(table.clone())
        .await
        .expect("every statement prepares");
    let values = ["a", "b\\'c", "d\\"];
    for v in values {
        publish::<D>(&q, &k, v).await;
    }
    assert!(
        q.publish_unique(
            NewJob::new(D::Text::from("again".to_owned()))
                .column(k.as_str(), "a".to_owned())
                .unique_key("a")
        )
        .await
        .expect("publish a duplicate")
        .duplicate,
        "the unique key column is read whole"
    );

    let d = claim_one::<D>(&q).await;
    let held = d.key().expect("an advisory delivery has a key").to_owned();
    assert_eq!(held, key("a"), "the claim renders the key");
    let stats = q.stats().await.expect("the counts render the key in SQL");
    assert_eq!(
        (stats.due.rows, stats.in_work.rows),
        (2, 1),
        "the held key counts its row in work: {stats:?}"
    );
    let mut listed = q
        .jobs(JobState::Due, Page::first(10))
        .await
        .expect("the listing renders the key in SQL");
    listed.extend(
        q.jobs(JobState::InWork, Page::first(10))
            .await
            .expect("the listing of rows in work"),
    );
    let mut keys: Vec<String> = listed.iter().filter_map(|j| j.key.clone()).collect();
    keys.sort();
    let mut expected: Vec<String> = values.iter().map(|v| key(v)).collect();
    expected.sort();
    assert_eq!(keys, expected);
    assert_eq!(d.payload().text(), "payload a");
    d.ack().await.expect("ack");

    let report = broker
        .doctor(&table, &broker_core::DoctorOptions::new())
        .await;
    let unique = report
        .check("unique key index")
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(unique.status, Status::Pass, "{report}");
    assert!(
        report
            .checks
            .iter()
            .all(|c| !c.found.to_lowercase().contains("syntax")),
        "a catalog read broke on the name: {report}"
    );

    q.pause("operator").await.expect("pause");
    assert!(q.paused().await.expect("pause state").is_some());
    broker.drop_tables(&table).await.expect("drop the tables");
    broker
        .create_tables(&table)
        .await
        .expect("create the tables again");
    let q = broker
        .queue::<D::Job>(table.clone())
        .await
        .expect("prepare again");
    assert_eq!(
        q.paused().await.expect("pause state"),
        None,
        "dropping the tables deleted the queue's pause"
    );
    publish::<D>(&q, &k, "e").await;
    let d = claim_one::<D>(&q).await;
    assert_eq!(d.key(), Some(key("e").as_str()));
    d.ack().await.expect("ack");
    broker.drop_tables(&table).await.expect("drop the tables");
    broker.close().await;
    D::drop_database(&url).await;
}
