//! What a backend found wrong with the indexes a table's claims read, said the same way by
//! every backend: as a warning when a queue is prepared, and as the doctor's "indexes" check.
//!
//! A missing or outdated claim index never makes a claim wrong, only slow: the claim then reads
//! rows it cannot take (not due yet, finished, in a busy group) on every call, so the cost grows
//! with them. That is why these are warnings and never refuse a queue.

use crate::doctor::Check;

/// One index the claims of a table should have and do not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexAdvice {
    /// The index, as the DDL helper names it.
    pub name: String,
    /// What was found instead: missing, or an index under that name with other columns.
    pub found: String,
    /// The statements that put it right, in order.
    pub fix: Vec<String>,
}

/// Logs one warning per piece of advice, naming the statements to run, or one saying the
/// indexes could not be listed. The advice also reaches [`Queue::warnings`](crate::Queue::warnings)
/// and [`Health::warnings`](crate::Health::warnings), and standard error when no `tracing`
/// subscriber is installed (see the `warnings` module).
pub fn warn<E: std::fmt::Display>(table: &str, advice: Result<Vec<IndexAdvice>, E>) {
    let advice = match advice {
        Ok(advice) => advice,
        Err(e) => {
            tracing::warn!(
                table,
                error = %e,
                "cannot list the table's indexes; check them with the doctor"
            );
            return;
        }
    };
    for a in advice {
        crate::warnings::report(
            table,
            format!(
                "index {}: {}: claims will slow down as rows they cannot take pile up; run: {}",
                a.name,
                a.found,
                a.fix.join("; ")
            ),
        );
        tracing::warn!(
            table,
            index = a.name,
            "{}: claims will slow down as rows they cannot take pile up; run: {}",
            a.found,
            a.fix.join("; ")
        );
    }
}

/// The doctor's "indexes" check from a backend's advice (or the error that kept it from looking).
pub fn check<E: std::fmt::Display>(advice: Result<Vec<IndexAdvice>, E>) -> Check {
    let name = "indexes";
    match advice {
        Err(e) => Check::warn(
            name,
            format!("cannot list the table's indexes: {e}"),
            "check them by hand against the DDL helper's (broker.ddl(&table))",
        ),
        Ok(advice) if advice.is_empty() => {
            Check::pass(name, "the indexes the claim reads are there")
        }
        Ok(advice) => Check::warn(
            name,
            format!(
                "{}: claims then read rows they cannot take, and slow down as those pile up",
                advice
                    .iter()
                    .map(|a| format!("{}: {}", a.name, a.found))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            advice
                .iter()
                .flat_map(|a| a.fix.iter().map(|s| format!("{s};")))
                .collect::<Vec<_>>()
                .join(" "),
        ),
    }
}

/// The doctor's checks where the table does not exist: a failed "table" check that says how to
/// create it, and the "indexes" check marked not run (the indexes of a missing table cannot
/// pass), so a backend's doctor never passes a check on a table that is not there.
pub fn table_missing(table: &str) -> Vec<Check> {
    vec![
        Check::fail(
            "table",
            format!("table \"{table}\" does not exist (or this role cannot see it)"),
            "create it with broker.create_tables(&table), or run the statements broker.ddl(&table) returns",
        ),
        Check::warn(
            "indexes",
            "not checked: the table does not exist",
            "create the table, then run the doctor again",
        ),
    ]
}
