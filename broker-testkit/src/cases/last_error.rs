//! Reading a row's `last_error`: the database cuts it to what the read shows, whoever wrote it.

use broker_core::admin::{LAST_ERROR_PREVIEW_CHARS, LAST_ERROR_READ_CHARS};
use broker_core::{ClaimMode, JobState, NewJob, Page};

use crate::{Fixture, TestDb};

/// An error text of `chars` characters of one, two and three bytes, so a cut that counted bytes
/// (or cut inside a character) shows.
fn error_text(chars: usize) -> String {
    "aé€".chars().cycle().take(chars).collect()
}

/// A `last_error` that other software wrote (20,000 characters) is cut when read: a listing
/// returns the characters it shows and says it cut them; the one-row read returns a bounded
/// prefix and says so too. A text of exactly the listing's length comes back whole, not marked
/// cut, and a row that does not exist reads as `None`.
pub async fn a_long_last_error_is_cut_when_read_and_the_read_says_so<D: TestDb>() {
    let f = Fixture::<D>::new(ClaimMode::Lease, |b| b.last_error("last_error")).await;
    let q = f.queue().await;
    let long_id = q
        .publish(NewJob::new(D::Text::from("long".to_owned())))
        .await
        .expect("publish");
    let exact_id = q
        .publish(NewJob::new(D::Text::from("exact".to_owned())))
        .await
        .expect("publish");
    // Past the one-row read's bound and within the DDL helper's MySQL `TEXT` (65,535 bytes).
    let long = error_text(20_000);
    let exact = error_text(LAST_ERROR_PREVIEW_CHARS);
    for (id, text) in [(long_id, &long), (exact_id, &exact)] {
        let sql = format!(
            "UPDATE {} SET {} = '{text}' WHERE {} = {id}",
            D::quote(f.table.name()),
            D::quote("last_error"),
            D::quote(f.table.id()),
        );
        assert_eq!(D::execute(&f.broker, &sql).await, 1, "write the error");
    }

    let listed = q.jobs(JobState::Due, Page::first(10)).await.expect("list");
    let by_id = |id: i64| listed.iter().find(|j| j.id == id).expect("listed");
    let preview: String = long.chars().take(LAST_ERROR_PREVIEW_CHARS).collect();
    assert_eq!(by_id(long_id).last_error.as_deref(), Some(preview.as_str()));
    assert!(by_id(long_id).last_error_cut, "the listing says it cut");
    assert_eq!(by_id(exact_id).last_error.as_deref(), Some(exact.as_str()));
    assert!(!by_id(exact_id).last_error_cut, "nothing was cut");

    let one = q
        .job(long_id)
        .await
        .expect("read one row")
        .expect("the row");
    let prefix: String = long.chars().take(LAST_ERROR_READ_CHARS).collect();
    assert_eq!(one.last_error.as_deref(), Some(prefix.as_str()));
    assert!(one.last_error_cut, "the one-row read says it cut");
    assert_eq!(one.payload.as_deref(), Some("long"));
    let one = q
        .job(exact_id)
        .await
        .expect("read one row")
        .expect("the row");
    assert_eq!(
        (one.last_error.as_deref(), one.last_error_cut),
        (Some(exact.as_str()), false)
    );
    assert_eq!(q.job(exact_id + 1000).await.expect("read one row"), None);
    f.cleanup().await;
}
