//! Reading just the payload column of a row.

use sqlx::{ColumnIndex, Decode, FromRow, Row, Type};

use crate::strategy::alias;

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
        row.try_get(alias::PAYLOAD).map(Payload)
    }
}
