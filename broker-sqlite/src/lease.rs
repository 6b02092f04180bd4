//! Lease mode on SQLite: one `UPDATE .. RETURNING` claims, writing the expiry and counting the
//! attempt; settlements and renewals are fenced on the token (expiry and attempt).

use std::sync::Arc;

use broker_core::driver::{ClaimedRow, LeaseStrategy, LeaseToken, Settle};
use broker_core::{Result, SqlxBrokerError, TableDescription};
use sqlx::{Sqlite, SqlitePool};

use crate::keys::KeyTable;
use crate::sql::{Fence, SettleStatements, Statements, ident};

/// The lease strategy of one SQLite table.
#[derive(Debug)]
pub struct SqliteLease {
    pool: SqlitePool,
    table: Arc<TableDescription>,
    /// The file's shared state: writes take turns through it.
    file: Arc<KeyTable>,
    claim: String,
    renew: String,
    settle: SettleStatements,
}

impl SqliteLease {
    pub(crate) fn new(pool: SqlitePool, table: Arc<TableDescription>, file: Arc<KeyTable>) -> Self {
        let s = Statements::new(&table);
        let lu = ident(table.locked_until().expect("lease mode has locked_until"));
        // Rows come back from RETURNING in no particular order; the engine does not rely on it.
        let claim = format!(
            "UPDATE {t} SET {lu} = ?2, {a} = {a} + 1 WHERE {id} IN \
             (SELECT {id} FROM {t} WHERE {claimable} ORDER BY {order} LIMIT ?3) {ret}",
            t = s.table,
            a = s.attempt,
            id = s.id,
            claimable = s.claimable,
            order = s.order,
            ret = s.returning_counted(),
        );
        let renew = format!(
            "UPDATE {t} SET {lu} = ?1 WHERE {id} = ?2 AND {lu} = ?3 AND {a} = ?4",
            t = s.table,
            id = s.id,
            a = s.attempt,
        );
        let fence = format!(" AND {lu} = ?3 AND {} = ?4", s.attempt);
        let settle = s.settle(&table, &fence);
        Self {
            pool,
            table,
            file,
            claim,
            renew,
            settle,
        }
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![
            ("claim", self.claim.as_str()),
            ("renew", self.renew.as_str()),
        ];
        out.extend(self.settle.named());
        out
    }

    fn err(&self, name: &'static str) -> impl FnOnce(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }
}

impl LeaseStrategy for SqliteLease {
    type Db = Sqlite;

    async fn claim(
        &self,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
    ) -> Result<Vec<ClaimedRow<Sqlite>>> {
        let _turn = self.file.write_turn().await;
        let rows = sqlx::query(sqlx::AssertSqlSafe(self.claim.clone()))
            .bind(now_ms)
            .bind(expires_ms)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(self.err("claim"))?;
        rows.into_iter()
            .map(|row| crate::backend::claimed(&self.table, row, None))
            .collect()
    }

    async fn renew(&self, id: i64, token: LeaseToken, expires_ms: i64) -> Result<bool> {
        let _turn = self.file.write_turn().await;
        let done = sqlx::query(sqlx::AssertSqlSafe(self.renew.clone()))
            .bind(expires_ms)
            .bind(id)
            .bind(token.expires_ms)
            .bind(token.attempt)
            .execute(&self.pool)
            .await
            .map_err(self.err("renew"))?;
        Ok(done.rows_affected() == 1)
    }

    async fn settle(&self, token: LeaseToken, settle: Settle) -> Result<bool> {
        let changed = self
            .settle
            .run(
                &self.pool,
                &self.file,
                self.table.name(),
                settle,
                Fence::Lease(token),
            )
            .await?;
        Ok(changed == 1)
    }
}
