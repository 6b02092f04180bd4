//! The queue table the CLI works on: described by flags, or by a TOML file with the same roles.
//!
//! ```toml
//! url = "postgres://app@db/app"   # or pass it on the command line
//!
//! [table]
//! name = "jobs"
//! payload = "payload"
//! locked_until = "locked_until"
//! due_at = "due_at"
//! max_attempts = 5
//! dead_letter_table = "jobs_dead"
//! last_error = "last_error"
//! snoozes = "snoozes"
//! kind = "kind"                  # a table of many job kinds (payload then JSON)
//! columns = { account = "bigint" }
//! ```

use std::collections::BTreeMap;

use broker_core::{ColumnType, DeadLetter, TableBuilder, TableDescription};
use serde::Deserialize;

/// The roles of a table's columns, as flags or in a TOML file (`[table]`).
#[derive(Debug, Default, Clone, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TableArgs {
    /// The queue table.
    #[arg(long = "table", global = true)]
    #[serde(rename = "name")]
    pub(crate) name: Option<String>,
    /// The payload column (text).
    #[arg(long, global = true)]
    pub(crate) payload: Option<String>,
    /// The id column (default `id`).
    #[arg(long = "id-column", id = "id_column", global = true)]
    pub(crate) id: Option<String>,
    /// The attempt column (default `attempt`).
    #[arg(long, global = true)]
    pub(crate) attempt: Option<String>,
    /// The lease column: lease mode.
    #[arg(long, global = true)]
    pub(crate) locked_until: Option<String>,
    /// The lease length in seconds.
    #[arg(long, global = true)]
    pub(crate) lease_seconds: Option<u32>,
    /// The advisory key template, e.g. 'acct-{account}': advisory mode.
    #[arg(long, global = true)]
    pub(crate) advisory_lock: Option<String>,
    /// The due-time column.
    #[arg(long, global = true)]
    pub(crate) due_at: Option<String>,
    /// The processed-at column (acks mark it instead of deleting).
    #[arg(long, global = true)]
    pub(crate) processed_at: Option<String>,
    /// The column that keeps the handler's last error.
    #[arg(long, global = true)]
    pub(crate) last_error: Option<String>,
    /// The column that counts a row's snoozes (for `max_snoozes`).
    #[arg(long, global = true)]
    pub(crate) snoozes: Option<String>,
    /// The kind column of a table of many job kinds (the payload is then JSON).
    #[arg(long, global = true)]
    pub(crate) kind: Option<String>,
    /// The group column.
    #[arg(long, global = true)]
    pub(crate) group: Option<String>,
    /// Groups run in order, one row at a time.
    #[arg(long, global = true)]
    #[serde(default)]
    pub(crate) fifo: bool,
    /// The priority column.
    #[arg(long, global = true)]
    pub(crate) priority: Option<String>,
    /// Dead-letter after this many attempts.
    #[arg(long, global = true)]
    pub(crate) max_attempts: Option<u32>,
    /// The dead-letter table.
    #[arg(long, global = true)]
    pub(crate) dead_letter_table: Option<String>,
    /// The dead-letter column.
    #[arg(long, global = true)]
    pub(crate) dead_letter_column: Option<String>,
    /// Further columns, as name:type (text, bigint, json, bytes); e.g. the key template's.
    #[arg(long = "column", value_parser = parse_column, global = true)]
    #[serde(skip)]
    pub(crate) column_flags: Vec<(String, ColumnType)>,
    /// Further columns in a TOML file: `columns = { account = "bigint" }`.
    #[arg(skip)]
    #[serde(default)]
    pub(crate) columns: BTreeMap<String, String>,
}

/// What a TOML file holds.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    /// The database URL.
    pub(crate) url: Option<String>,
    /// The table.
    pub(crate) table: TableArgs,
}

pub(crate) fn parse_column(s: &str) -> Result<(String, ColumnType), String> {
    let (name, ty) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: write a column as name:type"))?;
    Ok((name.to_owned(), column_type(ty)?))
}

fn column_type(ty: &str) -> Result<ColumnType, String> {
    Ok(match ty.to_ascii_lowercase().as_str() {
        "text" => ColumnType::Text,
        "bigint" => ColumnType::BigInt,
        "json" => ColumnType::Json,
        "bytes" => ColumnType::Bytes,
        other => {
            return Err(format!(
                "{other:?}: a column type is text, bigint, json or bytes"
            ));
        }
    })
}

impl TableArgs {
    /// These roles, with those of `file` where a flag sets none.
    pub(crate) fn or(self, file: TableArgs) -> TableArgs {
        TableArgs {
            name: self.name.or(file.name),
            payload: self.payload.or(file.payload),
            id: self.id.or(file.id),
            attempt: self.attempt.or(file.attempt),
            locked_until: self.locked_until.or(file.locked_until),
            lease_seconds: self.lease_seconds.or(file.lease_seconds),
            advisory_lock: self.advisory_lock.or(file.advisory_lock),
            due_at: self.due_at.or(file.due_at),
            processed_at: self.processed_at.or(file.processed_at),
            last_error: self.last_error.or(file.last_error),
            snoozes: self.snoozes.or(file.snoozes),
            kind: self.kind.or(file.kind),
            group: self.group.or(file.group),
            fifo: self.fifo || file.fifo,
            priority: self.priority.or(file.priority),
            max_attempts: self.max_attempts.or(file.max_attempts),
            dead_letter_table: self.dead_letter_table.or(file.dead_letter_table),
            dead_letter_column: self.dead_letter_column.or(file.dead_letter_column),
            column_flags: if self.column_flags.is_empty() {
                file.column_flags
            } else {
                self.column_flags
            },
            columns: if self.columns.is_empty() {
                file.columns
            } else {
                self.columns
            },
        }
    }

    /// The table description these roles make.
    pub(crate) fn describe(&self) -> Result<TableDescription, String> {
        let name = self.name.clone().ok_or(
            "name the queue table: --table NAME, or name = \"..\" under [table] in --config",
        )?;
        let mut b = TableDescription::builder(name);
        if let Some(c) = &self.payload {
            // A kinds table keeps its jobs' arguments as JSON.
            let ty = match self.kind {
                Some(_) => ColumnType::Json,
                None => ColumnType::Text,
            };
            b = b.payload(c, ty);
        }
        if let Some(k) = &self.kind {
            b = b.kind(k);
        }
        let set =
            |b: TableBuilder, c: &Option<String>, f: fn(TableBuilder, String) -> TableBuilder| {
                match c {
                    Some(c) => f(b, c.clone()),
                    None => b,
                }
            };
        b = set(b, &self.id, |b, c| b.id(c));
        b = set(b, &self.attempt, |b, c| b.attempt(c));
        b = set(b, &self.locked_until, |b, c| b.locked_until(c));
        b = set(b, &self.advisory_lock, |b, c| b.advisory_lock(c));
        b = set(b, &self.due_at, |b, c| b.due_at(c));
        b = set(b, &self.processed_at, |b, c| b.processed_at(c));
        b = set(b, &self.last_error, |b, c| b.last_error(c));
        b = set(b, &self.snoozes, |b, c| b.snoozes(c));
        b = set(b, &self.group, |b, c| b.group(c));
        b = set(b, &self.priority, |b, c| b.priority(c));
        b = set(b, &self.dead_letter_table, |b, c| {
            b.dead_letter(DeadLetter::Table(c))
        });
        b = set(b, &self.dead_letter_column, |b, c| {
            b.dead_letter(DeadLetter::Column(c))
        });
        if let Some(s) = self.lease_seconds {
            b = b.lease_seconds(s);
        }
        if let Some(n) = self.max_attempts {
            b = b.max_attempts(n);
        }
        for (c, ty) in &self.column_flags {
            b = b.column(c, *ty);
        }
        for (c, ty) in &self.columns {
            b = b.column(
                c,
                column_type(ty).map_err(|e| format!("column \"{c}\": {e}"))?,
            );
        }
        b.fifo(self.fifo).build().map_err(|e| e.to_string())
    }
}

/// Reads a TOML file of a URL and a table.
pub(crate) fn read_config(path: &std::path::Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| {
        // toml's own text quotes the offending line, which can be the URL's, password and all:
        // name the line and column instead.
        let at = e.span().map_or_else(String::new, |span| {
            let before = text.get(..span.start).unwrap_or(&text);
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!(", line {line}, column {column}")
        });
        format!("{}{at}: {}", path.display(), e.message())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_toml_file_describes_a_table_and_flags_win_over_it() {
        let config: Config = toml::from_str(
            r#"
            url = "sqlite://q.db"
            [table]
            name = "jobs"
            payload = "payload"
            locked_until = "locked_until"
            max_attempts = 3
            dead_letter_column = "dead_at"
            due_at = "due_at"
            snoozes = "snoozes"
            columns = { account = "bigint" }
            "#,
        )
        .unwrap();
        assert_eq!(config.url.as_deref(), Some("sqlite://q.db"));
        let flags = TableArgs {
            name: Some("other".into()),
            ..TableArgs::default()
        };
        let t = flags.or(config.table).describe().unwrap();
        assert_eq!(t.name(), "other");
        assert_eq!(t.max_attempts(), Some(3));
        assert_eq!(t.snoozes(), Some("snoozes"), "the snooze counter's column");
        assert_eq!(t.columns(), &[("account".to_owned(), ColumnType::BigInt)]);
    }

    #[test]
    fn an_unknown_key_or_type_is_named() {
        let e = toml::from_str::<Config>("[table]\nname = \"jobs\"\nlocked = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("locked"), "{e}");
        let t = TableArgs {
            name: Some("jobs".into()),
            columns: [("a".to_owned(), "float".to_owned())].into(),
            ..TableArgs::default()
        };
        let e = t.describe().unwrap_err();
        assert!(e.contains("\"a\"") && e.contains("float"), "{e}");
    }
}
