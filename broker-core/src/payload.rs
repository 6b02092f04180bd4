//! Reading just the payload column of a row.

use sqlx::{ColumnIndex, Decode, FromRow, Row, Type, TypeInfo, ValueRef};

use crate::driver::alias;
use crate::table::TableDescription;

/// A row read as its payload column alone (the table description names the column).
///
/// Use it as the queue's row type: `broker.queue::<Payload<String>>(table)`; the handler reads
/// `job.payload().0`. [`Broker::queue`](crate::Broker::queue) refuses a payload type that the
/// column's SQL type does not decode into, naming the column and both types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload<P>(pub P);

impl<'r, R, P> FromRow<'r, R> for Payload<P>
where
    R: Row,
    P: Decode<'r, R::Database> + Type<R::Database>,
    &'static str: ColumnIndex<R>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        let raw = row.try_get_raw(alias::PAYLOAD)?;
        // sqlx checks the type of values only, so a NULL (or the NULL of the probe row that
        // `Broker::queue` reads) would pass whatever the column's type: check the column's.
        let column = raw.type_info().into_owned();
        if !column.is_null() && !P::compatible(&column) {
            return Err(sqlx::Error::ColumnDecode {
                index: format!("{:?}", alias::PAYLOAD),
                source: Box::new(PayloadTypeMismatch {
                    rust: std::any::type_name::<P>(),
                    reads: P::type_info().name().to_owned(),
                    column: column.name().to_owned(),
                }),
            });
        }
        // SQLite decodes NULL as an empty string or zero where the other databases refuse it;
        // refuse it on every database unless the payload type is an `Option`, which reads it
        // as `None`. The type's name is the only way to tell without specialization.
        if std::any::type_name::<P>().starts_with("core::option::Option<") {
            return row.try_get(alias::PAYLOAD).map(Payload);
        }
        if raw.is_null() {
            return Err(sqlx::Error::ColumnDecode {
                index: format!("{:?}", alias::PAYLOAD),
                source: "the payload is NULL; read it as an Option to accept NULL payloads".into(),
            });
        }
        row.try_get(alias::PAYLOAD).map(Payload)
    }
}

/// A [`Payload`] whose type the payload column's SQL type does not decode into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PayloadTypeMismatch {
    /// The Rust type inside `Payload`.
    rust: &'static str,
    /// The SQL type it reads.
    reads: String,
    /// The column's SQL type.
    column: String,
}

impl std::fmt::Display for PayloadTypeMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the column is {}, which Payload<{}> cannot read (it reads {}); read the payload as a type that decodes {} (e.g. Payload<i64> for a BIGINT, Payload<String> for a TEXT, Payload<Vec<u8>> for bytes), or make the column {}",
            self.column, self.rust, self.reads, self.column, self.reads
        )
    }
}

impl std::error::Error for PayloadTypeMismatch {}

/// Whether `error` is a [`Payload`] that cannot read its column's type.
pub(crate) fn is_type_mismatch(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::ColumnDecode { source, .. } if source.is::<PayloadTypeMismatch>())
}

/// `error` (from decoding a claimed row) with the broker's column aliases
/// ([`alias`]) replaced by the table's own column names, so that a message names the column
/// the user wrote: `"payload"`, not `"sqlx_broker_payload"`.
pub(crate) fn naming_columns(table: &TableDescription, error: sqlx::Error) -> sqlx::Error {
    match error {
        sqlx::Error::ColumnDecode { index, source } => {
            let named = match index.trim_matches('"') {
                a if a == alias::PAYLOAD => table.payload().map(|(c, _)| c),
                a if a == alias::ID => Some(table.id()),
                a if a == alias::ATTEMPT => Some(table.attempt()),
                _ => None,
            };
            sqlx::Error::ColumnDecode {
                index: named.map_or(index, |c| format!("{c:?}")),
                source,
            }
        }
        other => other,
    }
}
