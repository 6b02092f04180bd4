//! Which runs exist: databases, claim modes, worker counts, batch sizes and FIFO groups, and the
//! filters that pick some of them.

use std::fmt;

use broker_core::ClaimMode;

/// A database the benchmarks run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Db {
    /// SQLite, in a temporary file.
    Sqlite,
    /// PostgreSQL (`SQLX_BROKER_PG_URL`).
    Postgres,
    /// MariaDB or MySQL (`SQLX_BROKER_MYSQL_URL`).
    MariaDb,
}

impl Db {
    /// Every database, in report order.
    pub const ALL: [Db; 3] = [Db::Postgres, Db::MariaDb, Db::Sqlite];

    /// The short name used on the command line and in benchmark ids.
    pub fn key(self) -> &'static str {
        match self {
            Db::Sqlite => "sqlite",
            Db::Postgres => "postgres",
            Db::MariaDb => "mariadb",
        }
    }

    /// The name in reports.
    pub fn label(self) -> &'static str {
        match self {
            Db::Sqlite => "SQLite",
            Db::Postgres => "PostgreSQL",
            Db::MariaDb => "MariaDB",
        }
    }

    /// Parses a command-line name (`sqlite`, `postgres`/`pg`, `mariadb`/`mysql`).
    pub fn parse(s: &str) -> Option<Db> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sqlite" => Some(Db::Sqlite),
            "postgres" | "postgresql" | "pg" => Some(Db::Postgres),
            "mariadb" | "mysql" | "maria" => Some(Db::MariaDb),
            _ => None,
        }
    }

    /// The database a URL is for (`postgres://`, `mysql://` or `mariadb://`, `sqlite:`).
    pub fn of_url(url: &str) -> Option<Db> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Db::Postgres)
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            Some(Db::MariaDb)
        } else if url.starts_with("sqlite:") {
            Some(Db::Sqlite)
        } else {
            None
        }
    }

    /// The claim modes the database offers (SQLite has no row locks).
    pub fn modes(self) -> &'static [ClaimMode] {
        match self {
            Db::Sqlite => &[ClaimMode::Lease, ClaimMode::Advisory],
            Db::Postgres | Db::MariaDb => {
                &[ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory]
            }
        }
    }
}

impl fmt::Display for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The short name of a claim mode on the command line and in benchmark ids.
pub fn mode_key(mode: ClaimMode) -> &'static str {
    match mode {
        ClaimMode::RowLock => "rowlock",
        ClaimMode::Lease => "lease",
        ClaimMode::Advisory => "advisory",
        _ => "other",
    }
}

/// Parses a command-line mode name (`rowlock`/`row-lock`/`row_lock`, `lease`, `advisory`).
pub fn parse_mode(s: &str) -> Option<ClaimMode> {
    match s.trim().to_ascii_lowercase().as_str() {
        "rowlock" | "row-lock" | "row_lock" | "row" => Some(ClaimMode::RowLock),
        "lease" => Some(ClaimMode::Lease),
        "advisory" | "advisory-lock" | "advisory_lock" => Some(ClaimMode::Advisory),
        _ => None,
    }
}

/// One claim + ack throughput run, done by the engine and by the raw loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scenario {
    /// The database.
    pub db: Db,
    /// The claim mode.
    pub mode: ClaimMode,
    /// Deliveries in work at once (engine `concurrency`; raw: tasks).
    pub workers: usize,
    /// Rows per claim at most (engine `batch_size`; raw: the claim's limit).
    pub batch: usize,
    /// FIFO table with this many groups; `None` for a plain table.
    pub fifo_groups: Option<usize>,
}

impl Scenario {
    /// A stable id, e.g. `postgres/lease/w4/b16` or `sqlite/advisory/w4/b1/fifo64`.
    pub fn id(&self) -> String {
        let mut id = format!(
            "{}/{}/w{}/b{}",
            self.db.key(),
            mode_key(self.mode),
            self.workers,
            self.batch
        );
        if let Some(g) = self.fifo_groups {
            id.push_str(&format!("/fifo{g}"));
        }
        id
    }

    /// A short label for charts, e.g. `PG lease 4w b16` or `SQLite advisory 4w b1 fifo64`.
    pub fn label(&self) -> String {
        let db = match self.db {
            Db::Postgres => "PG",
            Db::MariaDb => "MariaDB",
            Db::Sqlite => "SQLite",
        };
        let mut s = format!(
            "{db} {} {}w b{}",
            mode_key(self.mode),
            self.workers,
            self.batch
        );
        if let Some(g) = self.fifo_groups {
            s.push_str(&format!(" fifo{g}"));
        }
        s
    }
}

/// Which scenarios (and which other measurements) to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    /// Databases to run on.
    pub dbs: Vec<Db>,
    /// Claim modes.
    pub modes: Vec<ClaimMode>,
    /// Worker counts of plain tables.
    pub workers: Vec<usize>,
    /// Batch sizes of plain tables (row lock always claims one row per transaction, so it runs
    /// batch 1 only).
    pub batches: Vec<usize>,
    /// Run plain tables.
    pub plain: bool,
    /// FIFO group counts; empty runs no FIFO table.
    pub fifo_groups: Vec<usize>,
    /// Workers of FIFO runs.
    pub fifo_workers: usize,
    /// Batch size of FIFO runs.
    pub fifo_batch: usize,
    /// Extra worker counts of plain advisory tables, at batch 1: advisory holds a connection
    /// per delivery, so more workers than the pool has must not mean less throughput (#15).
    pub advisory_crowd: Vec<usize>,
}

impl Default for Filter {
    fn default() -> Self {
        Self {
            dbs: Db::ALL.to_vec(),
            modes: vec![ClaimMode::RowLock, ClaimMode::Lease, ClaimMode::Advisory],
            workers: vec![1, 4, 8],
            batches: vec![1, 16],
            plain: true,
            fifo_groups: vec![1, 64],
            fifo_workers: 4,
            fifo_batch: 1,
            advisory_crowd: vec![200],
        }
    }
}

impl Filter {
    /// Every selected scenario, database by database, in report order.
    pub fn scenarios(&self) -> Vec<Scenario> {
        let mut out = Vec::new();
        for db in Db::ALL.into_iter().filter(|d| self.dbs.contains(d)) {
            for &mode in db.modes().iter().filter(|m| self.modes.contains(m)) {
                if self.plain {
                    for &workers in &self.workers {
                        for &batch in &self.batches {
                            // Row lock claims one row per transaction: a batch size changes
                            // nothing there, so only batch 1 runs.
                            if mode == ClaimMode::RowLock && batch != 1 {
                                continue;
                            }
                            out.push(Scenario {
                                db,
                                mode,
                                workers,
                                batch,
                                fifo_groups: None,
                            });
                        }
                    }
                    if mode == ClaimMode::Advisory {
                        for &workers in &self.advisory_crowd {
                            if !self.workers.contains(&workers) {
                                out.push(Scenario {
                                    db,
                                    mode,
                                    workers,
                                    batch: 1,
                                    fifo_groups: None,
                                });
                            }
                        }
                    }
                }
                for &groups in &self.fifo_groups {
                    out.push(Scenario {
                        db,
                        mode,
                        workers: self.fifo_workers,
                        batch: if mode == ClaimMode::RowLock {
                            1
                        } else {
                            self.fifo_batch
                        },
                        fifo_groups: Some(groups),
                    });
                }
            }
        }
        out
    }

    /// The databases that have at least one selected scenario.
    pub fn used_dbs(&self) -> Vec<Db> {
        Db::ALL
            .into_iter()
            .filter(|d| self.dbs.contains(d))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_matrix_covers_every_mode_each_database_offers() {
        let all = Filter::default().scenarios();
        // Plain: row lock 2 dbs x 3 workers x batch 1; lease and advisory 3 dbs x 3 x 2;
        // advisory at 200 workers on 3 dbs. FIFO: 8 (db, mode) pairs x 2 group counts.
        assert_eq!(all.len(), 6 + 18 + 18 + 3 + 16);
        assert!(
            !all.iter()
                .any(|s| s.db == Db::Sqlite && s.mode == ClaimMode::RowLock)
        );
        assert!(
            all.iter()
                .all(|s| s.mode != ClaimMode::RowLock || s.batch == 1)
        );
    }

    #[test]
    fn ids_name_every_dimension() {
        let s = Scenario {
            db: Db::Postgres,
            mode: ClaimMode::Lease,
            workers: 4,
            batch: 16,
            fifo_groups: Some(64),
        };
        assert_eq!(s.id(), "postgres/lease/w4/b16/fifo64");
        assert_eq!(s.label(), "PG lease 4w b16 fifo64");
    }
}
