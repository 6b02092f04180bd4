//! Settlements across killed connections on PostgreSQL (see the testkit case).

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_settlements_survive_killed_connections_without_reruns() {
    broker_testkit::cases::lease_settlements_survive_killed_connections_without_reruns::<common::Pg>()
        .await;
}
