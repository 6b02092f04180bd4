//! Mode selection and every description error.

use broker_core::{
    ClaimMode, ColumnType, DeadLetter, SqlxBrokerError, TableBuilder, TableDescription,
};

use crate::{Fixture, TestDb, describe, unique_name};

/// SPEC section 2: no mode is row lock, `locked_until` is lease, a template is advisory.
pub async fn modes_follow_the_description<D: TestDb>() {
    let plain = TableDescription::builder("t").build().unwrap();
    assert_eq!(plain.mode(), ClaimMode::RowLock);
    let lease = TableDescription::builder("t")
        .locked_until("lu")
        .build()
        .unwrap();
    assert_eq!(lease.mode(), ClaimMode::Lease);
    assert_eq!(lease.lease_seconds(), 30);
    let adv = TableDescription::builder("t")
        .column("account", ColumnType::BigInt)
        .advisory_lock("accounts-{account}")
        .build()
        .unwrap();
    assert_eq!(adv.mode(), ClaimMode::Advisory);
    // And the backend prepares each mode it offers as that mode.
    for mode in [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory] {
        if D::offers(mode).await {
            let fx = Fixture::<D>::new(mode, |b| b).await;
            assert_eq!(fx.queue().await.mode(), mode);
            fx.cleanup().await;
        }
    }
}

fn refused(builder: TableBuilder, needle: &str) {
    let err = builder.build().expect_err(needle);
    assert!(
        matches!(err, SqlxBrokerError::Description { .. }),
        "{needle}: {err:?}"
    );
    let msg = err.to_string();
    assert!(msg.starts_with("table \"jobs\": "), "{msg}");
    assert!(msg.contains(needle), "expected {needle:?} in {msg:?}");
}

/// Every invalid description is refused when built, naming the table and what to change.
pub async fn every_description_error_is_refused_with_a_clear_message<D: TestDb>() {
    let b = || TableDescription::builder("jobs");
    refused(
        b().locked_until("lu")
            .column("a", ColumnType::Text)
            .advisory_lock("x-{a}"),
        "keep one of them",
    );
    refused(
        b().advisory_lock("x-{acount}")
            .column("account", ColumnType::Text),
        "\"acount\"",
    );
    refused(b().advisory_lock(""), "is empty");
    refused(
        b().advisory_lock("x-{a").column("a", ColumnType::Text),
        "never closed",
    );
    refused(
        b().advisory_lock("x-a}").column("a", ColumnType::Text),
        "closes nothing",
    );
    refused(b().advisory_lock("x-{}"), "empty {}");
    refused(b().advisory_lock("fixed"), "names no column");
    refused(
        b().locked_until("lu").lease_seconds(0),
        "lease_seconds is 0",
    );
    refused(b().lease_seconds(5), "only lease mode has a lease");
    refused(b().max_attempts(3), "no dead-letter target");
    refused(
        b().max_attempts(0)
            .dead_letter(DeadLetter::Table("dead".into())),
        "max_attempts is 0",
    );
    refused(b().fifo(true), "no group column");
    refused(b().group("attempt"), "two roles");
    refused(b().id(""), "id column name is empty");
    refused(
        b().dead_letter(DeadLetter::Table("jobs".into())),
        "queue table itself",
    );
    let err = TableDescription::builder("")
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("table name is empty"), "{err}");
}

/// A table that does not exist is refused at subscribe time, naming the table.
pub async fn a_missing_table_is_a_schema_error_naming_it<D: TestDb>() {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let name = unique_name("missing");
    let table = describe(&name, ClaimMode::Lease).build().unwrap();
    let err = broker.queue::<D::Job>(table).await.unwrap_err();
    assert!(matches!(err, SqlxBrokerError::Schema { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(&name) && msg.contains("does not exist"),
        "{msg}"
    );
    broker.close().await;
    D::drop_database(&url).await;
}

/// A column the description names but the table lacks is refused, naming the column.
pub async fn a_missing_column_is_a_schema_error_naming_it<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let wider = describe(fx.table.name(), ClaimMode::Lease)
        .priority("prio_missing")
        .build()
        .unwrap();
    let err = fx.broker.queue::<D::Job>(wider).await.unwrap_err();
    assert!(matches!(err, SqlxBrokerError::Schema { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("\"prio_missing\"") && msg.contains("priority"),
        "{msg}"
    );
    fx.cleanup().await;
}

/// A mode the backend lacks is refused at subscribe time with what to add; a mode it offers
/// prepares.
pub async fn an_unoffered_mode_is_refused_with_what_to_add<D: TestDb>() {
    let mut refused = 0;
    for mode in [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory] {
        if D::offers(mode).await {
            let fx = Fixture::<D>::new(mode, |b| b).await;
            fx.queue().await;
            fx.cleanup().await;
        } else {
            crate::fixture::assert_refused::<D>(mode).await;
            refused += 1;
        }
    }
    // The suite is stamped for a backend that lacks a mode only through this case: it must
    // then have refused something.
    assert_eq!(
        refused,
        usize::from(!D::offers(ClaimMode::RowLock).await),
        "only row lock is ever left out"
    );
}

/// The modes the suite was stamped for are exactly the ones the backend offers, and the
/// killed-connections cases are stamped exactly where the database has server connections: a
/// backend cannot drop a mode's cases by mistake.
pub async fn the_suite_covers_what_the_backend_offers<D: TestDb>(
    stamped: &[ClaimMode],
    server_connections: bool,
) {
    for mode in [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory] {
        assert_eq!(
            D::offers(mode).await,
            stamped.contains(&mode),
            "{mode}: the suite's modes and the backend's capabilities disagree"
        );
    }
    let url = D::database().await;
    let broker = D::connect(&url).await;
    assert_eq!(
        D::kill_connections(&broker).await.is_some(),
        server_connections,
        "server_connections and the backend's kill_connections disagree"
    );
    broker.close().await;
    D::drop_database(&url).await;
}
