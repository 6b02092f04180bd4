//! Issue #13: a claim's cost must not grow with the rows it cannot take. These cases check the
//! indexes that make it so (the DDL helper's, and what the doctor and prepare say when a table
//! lacks them); the benches measure the cost itself.

use broker_core::{ClaimMode, DoctorOptions, Status, TableDescription};

use crate::{Fixture, TestDb, describe, unique_name};

/// The DDL helper's claim indexes: none that copies the primary key (a plain table without a due
/// time claims in id order through the key), one that leads with the due time for a table with
/// one, and one over unfinished rows for a table whose acks mark rows.
pub async fn claim_indexes_follow_the_claim_order<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let claim_index = |t: &TableDescription| {
        fx.broker
            .ddl(t)
            .expect("the DDL of an offered mode")
            .into_iter()
            .filter(|s| s.contains("_claim"))
            .collect::<Vec<_>>()
    };
    let plain = TableDescription::builder(unique_name("plain"))
        .locked_until("locked_until")
        .build()
        .unwrap();
    assert!(
        claim_index(&plain).is_empty(),
        "{:?}",
        fx.broker.ddl(&plain)
    );
    let scheduled = describe(&unique_name("scheduled"), ClaimMode::Lease)
        .build()
        .unwrap();
    let index = claim_index(&scheduled);
    assert_eq!(index.len(), 1, "{:?}", fx.broker.ddl(&scheduled));
    let (due, id) = (index[0].find("due_at"), index[0].rfind("id"));
    assert!(
        due.is_some() && id.is_some() && due < id,
        "the due time leads the id: {index:?}"
    );
    let marked = TableDescription::builder(unique_name("marked"))
        .locked_until("locked_until")
        .processed_at("processed_at")
        .build()
        .unwrap();
    assert_eq!(
        claim_index(&marked).len(),
        1,
        "{:?}",
        fx.broker.ddl(&marked)
    );
    fx.cleanup().await;
}

/// A table whose claim index is from before (on the id alone, under the helper's name) still
/// prepares and claims, and the doctor names the index with the statements that replace it; run
/// as given, they satisfy the doctor.
pub async fn an_outdated_claim_index_is_named_with_the_statements_that_replace_it<D: TestDb>() {
    index_advice_round_trip::<D>(
        ClaimMode::Lease,
        D::outdated_claim_index,
        |fix| fix.contains("DROP INDEX") && fix.contains("due_at"),
        "the fix replaces the index with one that leads with the due time",
    )
    .await;
}

/// The doctor passes a table as the DDL helper made it; after `spoil` (statements on the
/// table's name) it warns on its indexes with a fix that `fix_ok` accepts; the queue still
/// prepares and claims a due row; and the fix, run as given, makes the doctor pass again.
async fn index_advice_round_trip<D: TestDb>(
    mode: ClaimMode,
    spoil: fn(&str) -> Vec<String>,
    fix_ok: fn(&str) -> bool,
    what_fix: &str,
) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let options = DoctorOptions::new();
    let indexes = |report: &broker_core::DoctorReport| {
        report
            .check("indexes")
            .cloned()
            .unwrap_or_else(|| panic!("the doctor checks indexes:\n{report}"))
    };
    let report = fx.broker.doctor(&fx.table, &options).await;
    assert_eq!(indexes(&report).status, Status::Pass, "{report}");
    for sql in spoil(fx.table.name()) {
        D::execute(&fx.broker, &sql).await;
    }
    let report = fx.broker.doctor(&fx.table, &options).await;
    let check = indexes(&report);
    assert_eq!(check.status, Status::Warn, "{report}");
    assert!(fix_ok(&check.fix), "{what_fix}: {report}");
    // Only slow: the queue still prepares, and claims what is due.
    let q = fx.queue().await;
    let ids = fx.publish(&q, 2).await;
    let d = q.claim(1).await.unwrap().pop().expect("a due row");
    assert!(ids.contains(&d.id()));
    d.ack().await.unwrap();
    for sql in check
        .fix
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        D::execute(&fx.broker, sql).await;
    }
    let report = fx.broker.doctor(&fx.table, &options).await;
    assert_eq!(indexes(&report).status, Status::Pass, "{report}");
    fx.cleanup().await;
}

/// Issue #13: rows of other keys are claimed while 200 rows of one held key come first in claim
/// order. A claim that reads one window of candidates and skips held keys afterwards found only
/// the held key's rows, and the other keys waited until those drained one at a time.
pub async fn rows_of_other_keys_are_claimed_past_many_rows_of_a_held_key<D: TestDb>() {
    use crate::{JobText as _, claim_within};
    use std::time::Duration;

    let fx = Fixture::<D>::new(ClaimMode::Advisory, |b| b).await;
    let q = fx.queue().await;
    let key = |k: &str, i: usize| {
        broker_core::NewJob::new(D::Text::from(format!("{k}-{i}"))).column("k", k.to_owned())
    };
    let mut jobs: Vec<_> = (0..200).map(|i| key("hot", i)).collect();
    jobs.extend(["a", "b", "c"].iter().map(|k| key(k, 0)));
    q.publish_batch(&jobs).await.unwrap();
    let hot = claim_within(&q, Duration::from_secs(10), "the hot key's first row").await;
    assert_eq!(hot.payload().text(), "hot-0");
    let mut others = Vec::new();
    for _ in 0..3 {
        let d = claim_within(
            &q,
            Duration::from_secs(10),
            "a row of another key while key-hot is held",
        )
        .await;
        others.push(d);
    }
    let mut texts: Vec<&str> = others.iter().map(|d| d.payload().text()).collect();
    texts.sort_unstable();
    assert_eq!(texts, ["a-0", "b-0", "c-0"]);
    for d in others {
        d.ack().await.unwrap();
    }
    hot.ack().await.unwrap();
    fx.cleanup().await;
}

/// Issue #13: rows of other keys are claimed past more rows of one held key than claims in
/// claim order ever read past (16 + 64 + .. + 4,096), because the claim visits the keys instead
/// (one probe per key); the keys are two columns, so the walk steps over tuples (two keys share
/// their first column). The walk goes round: a key before where the last walk stopped is found
/// again. The DDL helper makes the index the walk reads.
pub async fn the_key_walk_passes_a_held_key_of_any_length<D: TestDb>() {
    use crate::{JobText as _, claim_within};
    use broker_core::ColumnType;
    use std::time::Duration;

    let fx = Fixture::<D>::new(ClaimMode::Advisory, |b| {
        b.column("region", ColumnType::Text)
            .advisory_lock("key-{k}/{region}")
    })
    .await;
    let q = fx.queue().await;
    assert!(
        fx.broker
            .ddl(q.table())
            .expect("the DDL of an offered mode")
            .iter()
            .any(|s| s.contains("_key") && s.contains("region")),
        "the key index: {:?}",
        fx.broker.ddl(q.table())
    );
    let job = |k: &str, region: &str, i: usize| {
        broker_core::NewJob::new(D::Text::from(format!("{k}/{region}-{i}")))
            .column("k", k.to_owned())
            .column("region", region.to_owned())
    };
    let hot: Vec<_> = (0..6_000).map(|i| job("hot", "r", i)).collect();
    for chunk in hot.chunks(1_000) {
        q.publish_batch(chunk).await.unwrap();
    }
    q.publish_batch(&[job("a", "x", 0), job("a", "y", 0), job("b", "x", 0)])
        .await
        .unwrap();
    let held = claim_within(&q, Duration::from_secs(10), "the hot key's first row").await;
    assert_eq!(held.payload().text(), "hot/r-0");
    let mut texts = Vec::new();
    for _ in 0..3 {
        let d = claim_within(
            &q,
            Duration::from_secs(10),
            "a row of another key while key-hot/r is held",
        )
        .await;
        texts.push(d.payload().text().to_owned());
        d.ack().await.unwrap();
    }
    texts.sort_unstable();
    assert_eq!(texts, ["a/x-0", "a/y-0", "b/x-0"]);
    q.publish_batch(&[job("a", "x", 1)]).await.unwrap();
    let again = claim_within(&q, Duration::from_secs(10), "a key before the walk's last").await;
    assert_eq!(again.payload().text(), "a/x-1");
    again.ack().await.unwrap();
    held.ack().await.unwrap();
    fx.cleanup().await;
}

/// An advisory table without the key index (made by an earlier helper, or by hand) still
/// prepares and claims, and the doctor names the index with the statement that makes it; run as
/// given, it satisfies the doctor.
pub async fn a_missing_key_index_is_named_with_the_statement_that_makes_it<D: TestDb>() {
    index_advice_round_trip::<D>(
        ClaimMode::Advisory,
        D::drop_key_index,
        |fix| fix.contains("_key") && fix.contains('k'),
        "the fix makes the key index",
    )
    .await;
}
