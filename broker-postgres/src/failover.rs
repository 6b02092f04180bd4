//! Following the writable server among several hosts: a primary with standbys that one of them
//! replaces when it fails (pg_auto_failover, Patroni, a managed service's standby, a promote by
//! hand).
//!
//! sqlx connects a pool to one host and takes no multi-host URL, so
//! [`PgBackend::connect_primary`] does what libpq's `target_session_attrs=read-write` does, with
//! a pool of its own:
//!
//! - at connect, it asks each host in turn (`SELECT pg_is_in_recovery()`) and points the pool at
//!   the first that takes writes;
//! - every connection the pool opens asks the same and is refused on a standby, so a pool never
//!   holds a read-only session (an old primary that comes back as a standby, say);
//! - a watcher task asks the current host once a second on a connection of its own, outside the
//!   pool; when that host stops answering or turns read-only, it asks every host and moves the
//!   pool to the writable one (`Pool::set_connect_options`): connections to the old host fail
//!   their next use and are replaced on the new one. The watcher ends when the pool closes.
//!
//! Between the primary's failure and the promotion nothing takes writes: claims and settlements
//! fail with connection errors (the subscription's `health()` says so), and a settlement keeps
//! trying until its lease is close to running out.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use broker_core::{Broker, Result, SqlxBrokerError};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

use crate::PgBackend;
use crate::backend::PgBroker;

/// How long one probe of a host may take before the host counts as down.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the watcher asks the current host whether it still takes writes.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// Whether the server behind `conn` takes writes.
async fn writable(conn: &mut PgConnection) -> std::result::Result<bool, sqlx::Error> {
    let recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&mut *conn)
        .await?;
    Ok(!recovery)
}

/// Connects to `options` and asks whether it takes writes; `None` when it does not answer in
/// time.
async fn probe(options: &PgConnectOptions) -> Option<(PgConnection, bool)> {
    let asked = async {
        let mut conn = PgConnection::connect_with(options).await?;
        let w = writable(&mut conn).await?;
        Ok::<_, sqlx::Error>((conn, w))
    };
    tokio::time::timeout(PROBE_TIMEOUT, asked).await.ok()?.ok()
}

/// The first host of `hosts` that takes writes, with an open connection to it.
async fn find_primary(hosts: &[PgConnectOptions]) -> Option<(usize, PgConnection)> {
    for (i, h) in hosts.iter().enumerate() {
        match probe(h).await {
            Some((conn, true)) => return Some((i, conn)),
            Some((conn, false)) => {
                let _ = conn.close().await;
            }
            None => {}
        }
    }
    None
}

impl PgBackend {
    /// A broker whose pool (`max_connections`) follows the writable server among `urls`, one
    /// URL per host of a primary and its standbys (see the module docs). Refuses an empty list
    /// or a URL that does not parse, and fails when no host takes writes now.
    pub async fn connect_primary(urls: &[&str], max_connections: u32) -> Result<PgBroker> {
        if urls.is_empty() {
            return Err(SqlxBrokerError::Setup {
                table: String::new(),
                what: "connect_primary needs at least one URL (one per host)".into(),
            });
        }
        let hosts = urls
            .iter()
            .map(|u| PgConnectOptions::from_str(u))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| SqlxBrokerError::connect("PostgreSQL", e))?;
        let Some((at, probe_conn)) = find_primary(&hosts).await else {
            return Err(SqlxBrokerError::Setup {
                table: String::new(),
                what: format!(
                    "none of the {} hosts takes writes now (each answered as a standby or not within {PROBE_TIMEOUT:?}): {}",
                    hosts.len(),
                    // The URLs carry the role's password; the message goes to logs.
                    broker_core::redact_passwords(&urls.join(", "))
                ),
            });
        };
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            // A claim waits this long for a connection while no host takes writes.
            .acquire_timeout(PROBE_TIMEOUT)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    if writable(conn).await? {
                        Ok(())
                    } else {
                        Err(sqlx::Error::Protocol(
                            "the server is a standby (in recovery); the pool wants the primary"
                                .into(),
                        ))
                    }
                })
            })
            .connect_with(hosts[at].clone())
            .await
            .map_err(|e| SqlxBrokerError::connect("PostgreSQL", e))?;
        tokio::spawn(watch(pool.clone(), Arc::new(hosts), at, probe_conn));
        Ok(Broker::owning_pool(Self::new(pool)))
    }
}

/// Asks the current host once a second; moves the pool when it stops taking writes. Ends when
/// the pool closes.
async fn watch(pool: PgPool, hosts: Arc<Vec<PgConnectOptions>>, mut at: usize, conn: PgConnection) {
    let mut conn = Some(conn);
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        if pool.is_closed() {
            break;
        }
        let still = match conn.as_mut() {
            Some(c) => tokio::time::timeout(PROBE_TIMEOUT, writable(c))
                .await
                .ok()
                .and_then(|r| r.ok())
                .unwrap_or(false),
            None => false,
        };
        if still {
            continue;
        }
        conn = None;
        if let Some((next, c)) = find_primary(&hosts).await {
            if next != at {
                tracing::warn!(
                    from = ?hosts[at].get_host(),
                    to = ?hosts[next].get_host(),
                    port = hosts[next].get_port(),
                    "the primary moved; the pool follows it"
                );
                pool.set_connect_options(hosts[next].clone());
                at = next;
            }
            conn = Some(c);
        }
    }
    if let Some(c) = conn {
        let _ = c.close().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_error_naming_the_hosts_hides_their_passwords() {
        // Port 1 refuses at once: no host takes writes.
        let e = PgBackend::connect_primary(
            &[
                "postgres://alice:S3CRETPW@127.0.0.1:1/app",
                "postgres://alice:OTHERPW@127.0.0.1:1/app?password=THIRDPW",
            ],
            2,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(e.contains("none of the 2 hosts takes writes"), "{e}");
        assert!(e.contains("postgres://alice:***@127.0.0.1:1/app"), "{e}");
        for secret in ["S3CRETPW", "OTHERPW", "THIRDPW"] {
            assert!(!e.contains(secret), "{e}");
        }
    }
}
