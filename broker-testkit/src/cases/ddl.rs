//! The DDL helper against what `create_tables` runs.

use broker_core::{Backend as _, ClaimMode, TableDescription};

use crate::{TestDb, describe, unique_name};

/// `ddl()` refuses what `create_tables()` refuses, with the same error, and returns statements
/// for everything it accepts: a claim mode the database does not offer (SQLite's row lock) and
/// names longer than the database keeps.
pub async fn the_ddl_helper_refuses_what_create_tables_refuses_with_the_same_error<D: TestDb>() {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let base = unique_name("ddl");
    let long = format!("{base}_{}", "x".repeat(70 - base.len()));
    let mut tables: Vec<TableDescription> =
        [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory]
            .into_iter()
            .map(|mode| {
                describe(&unique_name("ddl"), mode)
                    .build()
                    .expect("the case's description is valid")
            })
            .collect();
    tables.push(
        describe(&long, ClaimMode::Lease)
            .build()
            .expect("the case's description is valid"),
    );
    let mut refused = 0;
    for table in &tables {
        let ddl = broker.ddl(table);
        match (ddl, broker.create_tables(table).await) {
            (Ok(statements), Ok(())) => {
                assert!(!statements.is_empty(), "{}", table.name());
                broker.drop_tables(table).await.expect("drop the tables");
            }
            (Err(d), Err(c)) => {
                assert_eq!(d.to_string(), c.to_string());
                refused += 1;
            }
            (d, c) => panic!(
                "table {:?} ({}): ddl() and create_tables() disagree: {d:?} / {c:?}",
                table.name(),
                table.mode()
            ),
        }
    }
    let offered = [ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory]
        .into_iter()
        .filter(|m| broker.backend().capabilities().offers(*m))
        .count();
    assert!(
        refused >= 3 - offered,
        "every mode the database does not offer is refused"
    );
    broker.close().await;
    D::drop_database(&url).await;
}
