//! A queue's row type against the table's columns: what `queue()` can tell before any claim, and
//! what a row that still does not decode says.

use std::time::Duration;

use broker_core::{
    ClaimMode, ColumnType, NewJob, Outcome, Payload, SqlxBrokerError, SubscribeOptions,
};

use sqlx::{Database, Encode, FromRow, Type};

use crate::{DbOf, Fixture, TestDb};

/// A `Payload<String>` over a `BIGINT` payload column is refused by `queue()`, naming the column
/// (not the claim's alias for it) and both types; `Payload<i64>` reads it. A row type of its own
/// that reads the payload as text (the suite's `Job`) passes `queue()`, and the decode error of
/// each claimed row names the column too.
pub async fn a_payload_type_the_column_cannot_read_is_refused_naming_the_column<D: TestDb>()
where
    Payload<String>: for<'r> FromRow<'r, <DbOf<D> as Database>::Row> + Send + 'static,
    Payload<i64>: for<'r> FromRow<'r, <DbOf<D> as Database>::Row> + Send + 'static,
    i64: for<'q> Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let fx = Fixture::<D>::build(ClaimMode::Lease, |name| {
        broker_core::TableDescription::builder(name)
            .payload("payload", ColumnType::BigInt)
            .locked_until("locked_until")
            .max_attempts(1)
            .dead_letter(broker_core::DeadLetter::Column("dead_at".into()))
    })
    .await;
    let err = fx
        .broker
        .queue::<Payload<String>>(fx.table.clone())
        .await
        .expect_err("a text payload over an integer column is refused");
    let msg = err.to_string();
    assert!(matches!(err, SqlxBrokerError::Schema { .. }), "{err:?}");
    assert!(
        msg.contains("column \"payload\"")
            && !msg.contains("sqlx_broker_payload")
            && msg.contains("Payload<alloc::string::String>")
            && msg.contains("Payload<i64>"),
        "{msg}"
    );

    let numbers = fx
        .broker
        .queue::<Payload<i64>>(fx.table.clone())
        .await
        .expect("an integer payload reads an integer column");
    numbers.publish(NewJob::new(7_i64)).await.expect("publish");
    let d = crate::claim_one(&numbers).await;
    assert_eq!(d.payload().0, 7);
    d.ack().await.expect("ack");

    let texts = fx.queue().await;
    numbers.publish(NewJob::new(8_i64)).await.expect("publish");
    let sub = texts
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
            |_job| async { Outcome::Ack },
        )
        .expect("subscribe");
    super::wait_for_a_decode_error(&sub).await;
    let last = sub.health().last_decode_error.unwrap_or_default();
    sub.shutdown().await;
    assert!(
        last.contains("column \"payload\"") && !last.contains("sqlx_broker_payload"),
        "{last}"
    );
    fx.cleanup().await;
}
