//! MariaDB Galera Cluster: what holds when every node takes writes.
//!
//! Galera replicates a transaction's row changes to the other nodes when it commits and
//! certifies them there: two transactions on two nodes that changed the same row conflict, and
//! the later one fails with error 1213 (the same number as an InnoDB deadlock). Locks do not
//! travel: `SELECT .. FOR UPDATE SKIP LOCKED` and `GET_LOCK` hold only on the node that took
//! them. So, per claim mode:
//!
//!   //! - **lease** is the mode that can hold: a claim is an `UPDATE` of the rows it takes,
//!   committed at once, so two
//!   nodes claiming one row conflict at certification and one claim fails before any handler
//!   runs. The subscription claims again at once (counted as a claim conflict, not a claim
//!   error) instead of backing off. Settlements are fenced on the lease token, an update or
//!   delete of the row that certification orders the same way. FIFO groups should hold as well: a
//!   claim
//!   takes a group's head only while no row of the group is leased, and a node's view of the
//!   table is always a prefix of the cluster's commit order, so a claim that saw a group free
//!   either takes the same head row as a claim on another node (and one of them loses
//!   certification) or saw the group after that claim's row was settled.
//! - **row lock** is refused: the claim's row lock is local, so a broker on another node can
//!   claim and run the same row at once; one of the two transactions then fails at commit, after
//!   both handlers ran.
//! - **advisory** is refused: a `GET_LOCK` key is held on one node only, so rows with one key
//!   could run on two nodes at once.
//!
//! A node is seen as a Galera node when `wsrep_on` is `ON` for the session and a provider is
//! loaded (`wsrep_provider` is not `none`).

use broker_core::{ClaimMode, Result, SqlxBrokerError, TableDescription};
use sqlx::{MySqlConnection, Row};

/// A Galera node as one of its sessions sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    /// `wsrep_node_name`.
    pub name: String,
    /// `wsrep_cluster_size`, when the status says it.
    pub cluster_size: Option<u32>,
}

impl std::fmt::Display for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.cluster_size {
            Some(n) => write!(f, "Galera node \"{}\" of a {n}-node cluster", self.name),
            None => write!(f, "Galera node \"{}\"", self.name),
        }
    }
}

/// The Galera node behind `conn`, or `None` for a server that is not one (MySQL has no
/// `wsrep_*` variables; a plain MariaDB server has `wsrep_on` off).
pub(crate) async fn node(conn: &mut MySqlConnection) -> Result<Option<Node>, sqlx::Error> {
    let rows = sqlx::raw_sql(
        "SHOW VARIABLES WHERE Variable_name IN ('wsrep_on', 'wsrep_provider', 'wsrep_node_name')",
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut on = false;
    let mut provider = false;
    let mut name = String::new();
    for row in rows {
        let variable: String = row.try_get(0)?;
        let value: String = row.try_get(1)?;
        match variable.to_ascii_lowercase().as_str() {
            "wsrep_on" => on = value.eq_ignore_ascii_case("on"),
            "wsrep_provider" => provider = !value.is_empty() && !value.eq_ignore_ascii_case("none"),
            "wsrep_node_name" => name = value,
            _ => {}
        }
    }
    if !(on && provider) {
        return Ok(None);
    }
    let size = sqlx::raw_sql("SHOW STATUS LIKE 'wsrep_cluster_size'")
        .fetch_optional(&mut *conn)
        .await?
        .and_then(|r| r.try_get::<String, _>(1).ok())
        .and_then(|v| v.parse().ok());
    Ok(Some(Node {
        name,
        cluster_size: size,
    }))
}

/// Why `mode` does not hold on a Galera node, with what to use instead; `None` for a mode
/// that holds (see the module docs).
pub(crate) fn unsafe_mode(mode: ClaimMode) -> Option<&'static str> {
    match mode {
        ClaimMode::RowLock => Some(
            "row lock mode does not hold on a Galera cluster: SELECT .. FOR UPDATE SKIP LOCKED \
             locks a row on this node only, so a broker on another node can run the same row at \
             the same time; describe the table for lease mode (.locked_until(..)), whose claims \
             the cluster certifies",
        ),
        ClaimMode::Advisory => Some(
            "advisory mode does not hold on a Galera cluster: GET_LOCK holds a key on this node \
             only, so rows with one key can run on two nodes at the same time; describe the \
             table for lease mode (.locked_until(..)) and put rows that must run one at a time \
             in a FIFO group (.group(..).fifo(true))",
        ),
        _ => None,
    }
}

/// Refuses a claim mode that does not hold on `node`.
pub(crate) fn check_mode(table: &TableDescription, node: &Node) -> Result<()> {
    match unsafe_mode(table.mode()) {
        Some(why) => Err(SqlxBrokerError::Unsupported {
            table: table.name().to_owned(),
            message: format!("the server is {node}; {why}"),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lease_holds_on_galera() {
        assert!(unsafe_mode(ClaimMode::Lease).is_none());
        assert!(
            unsafe_mode(ClaimMode::RowLock)
                .unwrap()
                .contains("lease mode")
        );
        assert!(
            unsafe_mode(ClaimMode::Advisory)
                .unwrap()
                .contains("GET_LOCK")
        );
        let node = Node {
            name: "node1".into(),
            cluster_size: Some(3),
        };
        assert_eq!(
            node.to_string(),
            "Galera node \"node1\" of a 3-node cluster"
        );
    }
}
