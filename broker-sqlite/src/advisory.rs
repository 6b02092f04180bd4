//! Advisory mode on SQLite: keys are held in this process (see [`crate::keys`]); the take counts
//! the attempt only while the row is still claimable.

use std::sync::Arc;

use broker_core::driver::{AdvisoryStrategy, Candidate, ClaimedRow, Settle};
use broker_core::{KeyTemplate, Result, SqlxBrokerError, TableDescription};
use sqlx::{Row, Sqlite, SqlitePool};

use crate::keys::{KeyLock, KeyTable};
use crate::sql::{Fence, SettleStatements, Statements, ident};

/// The advisory strategy of one SQLite table.
#[derive(Debug)]
pub struct SqliteAdvisory {
    pool: SqlitePool,
    table: Arc<TableDescription>,
    keys: Arc<KeyTable>,
    template: KeyTemplate,
    candidates: String,
    take: String,
    settle: SettleStatements,
}

impl SqliteAdvisory {
    pub(crate) fn new(pool: SqlitePool, table: Arc<TableDescription>, keys: Arc<KeyTable>) -> Self {
        let s = Statements::new(&table);
        let template = table
            .advisory_lock()
            .expect("advisory mode has a template")
            .clone();
        let key_columns: Vec<String> = template
            .columns()
            .iter()
            .map(|c| format!("CAST({} AS TEXT)", ident(c)))
            .collect();
        let candidates = format!(
            "SELECT {id}, {keys} FROM {t} WHERE {claimable} ORDER BY {order} LIMIT ?2 OFFSET ?3",
            id = s.id,
            keys = key_columns.join(", "),
            t = s.table,
            claimable = s.claimable,
            order = s.order,
        );
        let take = format!(
            "UPDATE {t} SET {a} = {a} + 1 WHERE {id} = ?2 AND {claimable} {ret}",
            t = s.table,
            a = s.attempt,
            id = s.id,
            claimable = s.claimable,
            ret = s.returning_counted(),
        );
        let settle = s.settle(&table, &format!(" AND {} = ?3", s.attempt));
        Self {
            pool,
            table,
            keys,
            template,
            candidates,
            take,
            settle,
        }
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![
            ("candidates", self.candidates.as_str()),
            ("take", self.take.as_str()),
        ];
        out.extend(self.settle.named());
        out
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }
}

impl AdvisoryStrategy for SqliteAdvisory {
    type Db = Sqlite;
    type KeyLock = KeyLock;

    async fn candidates(&self, limit: usize, skip: usize, now_ms: i64) -> Result<Vec<Candidate>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(self.candidates.clone()))
            .bind(now_ms)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(i64::try_from(skip).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(self.err("candidates"))?;
        rows.iter()
            .map(|row| {
                let id: i64 = row.try_get(0).map_err(self.err("candidates"))?;
                let values = (1..row.len())
                    .map(|i| row.try_get::<Option<String>, _>(i))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(self.err("candidates"))?;
                Ok(Candidate {
                    id,
                    key: self.template.render(&values),
                })
            })
            .collect()
    }

    async fn try_lock(&self, key: &str) -> Result<Option<KeyLock>> {
        Ok(self.keys.try_lock(key))
    }

    async fn take(
        &self,
        lock: &mut KeyLock,
        id: i64,
        now_ms: i64,
    ) -> Result<Option<ClaimedRow<Sqlite>>> {
        let _turn = self.keys.write_turn().await;
        let row = sqlx::query(sqlx::AssertSqlSafe(self.take.clone()))
            .bind(now_ms)
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(self.err("take"))?;
        row.map(|row| crate::backend::claimed(&self.table, row, Some(lock.key().to_owned())))
            .transpose()
    }

    async fn settle(&self, _lock: &mut KeyLock, settle: Settle) -> Result<()> {
        let changed = self
            .settle
            .run(
                &self.pool,
                &self.keys,
                self.table.name(),
                settle,
                Fence::Attempt(settle.attempt),
            )
            .await?;
        if changed == 1 {
            Ok(())
        } else {
            Err(SqlxBrokerError::ClaimLost {
                table: self.table.name().to_owned(),
                id: settle.id,
            })
        }
    }

    async fn unlock(&self, lock: KeyLock) -> Result<()> {
        drop(lock);
        Ok(())
    }
}
