//! Reading just the payload column of a row.

use sqlx::{ColumnIndex, Decode, FromRow, Row, Type};

use crate::driver::alias;

/// A row read as its payload column alone (the table description names the column).
///
/// Use it as the queue's row type: `broker.queue::<Payload<String>>(table)`; the handler reads
/// `job.payload().0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload<P>(pub P);

impl<'r, R, P> FromRow<'r, R> for Payload<P>
where
    R: Row,
    P: Decode<'r, R::Database> + Type<R::Database>,
    &'static str: ColumnIndex<R>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        // SQLite decodes NULL as an empty string or zero where the other databases refuse it;
        // refuse it on every database unless the payload type is an `Option`, which reads it
        // as `None`. The type's name is the only way to tell without specialization.
        if std::any::type_name::<P>().starts_with("core::option::Option<") {
            return row.try_get(alias::PAYLOAD).map(Payload);
        }
        let raw = row.try_get_raw(alias::PAYLOAD)?;
        if sqlx::ValueRef::is_null(&raw) {
            return Err(sqlx::Error::ColumnDecode {
                index: format!("{:?}", alias::PAYLOAD),
                source: "the payload is NULL; read it as an Option to accept NULL payloads".into(),
            });
        }
        row.try_get(alias::PAYLOAD).map(Payload)
    }
}
