//! Issue #29: the counters, histograms and gauges reach the `metrics` facade, labelled by table,
//! and agree with `Queue::metrics()`. One recorder per process: this binary holds one test.

use std::time::Duration;

use broker_sqlite::{
    BoxError, ColumnType, NewJob, Outcome, Payload, SqliteBackend, SubscribeOptions,
    TableDescription,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// A metric's name, labels and value.
type Exported = (String, Vec<(String, String)>, DebugValue);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_counter_histogram_and_gauge_is_exported_by_table() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this process");

    let dir = std::env::temp_dir().join(broker_testkit::unique_name("metrics"));
    std::fs::create_dir_all(&dir).unwrap();
    let broker = SqliteBackend::connect(&format!("sqlite://{}/q.db", dir.display()))
        .await
        .unwrap();
    let table = TableDescription::builder("exported")
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .due_at("due_at")
        .max_attempts(1)
        .dead_letter(broker_sqlite::DeadLetter::Column("dead_at".into()))
        .build()
        .unwrap();
    broker.create_tables(&table).await.unwrap();
    let queue = broker.queue::<Payload<String>>(table).await.unwrap();
    let jobs: Vec<_> = (0..20).map(|i| NewJob::new(format!("{i}"))).collect();
    queue.publish_batch(&jobs).await.unwrap();
    // The depth sampler reads the 20 unfinished rows into its gauge.
    let export = queue.export_depth(Duration::from_millis(100));
    broker_testkit::wait_until("the depth gauge", Duration::from_secs(10), || {
        let snapshotter = &snapshotter;
        let depth = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find_map(|(key, _, _, value)| {
                (key.key().name() == "sqlx_broker_depth").then_some(value)
            });
        async move { matches!(depth, Some(DebugValue::Gauge(v)) if v.into_inner() == 20.0) }
    })
    .await;
    drop(export);
    let sub = queue
        .subscribe(SubscribeOptions::new().concurrency(2), |job| async move {
            match job.payload().0.as_str() {
                "3" => Err::<Outcome, BoxError>("fails for good".into()),
                "4" => panic!("a panic on purpose"),
                _ => Ok(Outcome::Ack),
            }
        })
        .unwrap();
    broker_testkit::wait_until("every job settled", Duration::from_secs(20), || {
        let queue = queue.clone();
        async move {
            let m = queue.metrics();
            m.acked + m.dead_lettered == 20
        }
    })
    .await;
    sub.shutdown().await;
    let m = queue.metrics();

    let values: Vec<Exported> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let labels = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (key.name().to_owned(), labels, value)
        })
        .collect();
    let find = |name: &str| -> &DebugValue {
        let (_, labels, value) = values
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("{name} was not exported: {values:?}"));
        assert_eq!(labels, &[("table".to_owned(), "exported".to_owned())]);
        value
    };
    let counter = |name: &str| match find(name) {
        DebugValue::Counter(v) => *v,
        other => panic!("{name} is not a counter: {other:?}"),
    };
    assert_eq!(counter("sqlx_broker_claimed_total"), m.claimed);
    assert_eq!(counter("sqlx_broker_acked_total"), m.acked);
    assert_eq!(counter("sqlx_broker_dead_lettered_total"), m.dead_lettered);
    assert_eq!(
        counter("sqlx_broker_handler_errors_total"),
        m.handler_errors
    );
    assert_eq!(counter("sqlx_broker_panics_total"), m.panics);
    assert_eq!(
        (m.acked, m.dead_lettered, m.handler_errors, m.panics),
        (18, 2, 1, 1)
    );
    for name in [
        "sqlx_broker_retried_total",
        "sqlx_broker_lease_lost_total",
        "sqlx_broker_claim_errors_total",
        "sqlx_broker_decode_errors_total",
        "sqlx_broker_settle_failed_total",
        "sqlx_broker_gone_total",
        "sqlx_broker_released_total",
        "sqlx_broker_batched_acks_total",
        "sqlx_broker_timed_out_total",
        "sqlx_broker_snoozed_total",
    ] {
        counter(name);
    }
    let histogram = |name: &str| match find(name) {
        DebugValue::Histogram(v) => v.len(),
        other => panic!("{name} is not a histogram: {other:?}"),
    };
    assert_eq!(histogram("sqlx_broker_handler_seconds"), 20);
    assert_eq!(histogram("sqlx_broker_due_to_start_seconds"), 20);
    assert!(histogram("sqlx_broker_claim_seconds") >= 1);
    match find("sqlx_broker_in_work") {
        DebugValue::Gauge(v) => assert_eq!(v.into_inner(), 0.0, "nothing in work at rest"),
        other => panic!("in_work is not a gauge: {other:?}"),
    }
    broker.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
