//! The claim modes by name.

use std::fmt;

use crate::table::KeyTemplate;

/// What holds a claimed row while its handler runs (SPEC section 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClaimMode {
    /// An open transaction holds the row (`FOR UPDATE SKIP LOCKED`). Chosen when the description
    /// sets neither `locked_until` nor `advisory_lock`.
    RowLock,
    /// An expiry written into the `locked_until` column holds the row.
    Lease,
    /// A key lock, on a connection of its own, holds every row with that key.
    Advisory,
}

impl fmt::Display for ClaimMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RowLock => "row lock",
            Self::Lease => "lease",
            Self::Advisory => "advisory lock",
        })
    }
}

/// A table's claim mode together with the column that holds a row in it, borrowed from the
/// [`TableDescription`](crate::TableDescription) (see
/// [`mode_columns`](crate::TableDescription::mode_columns)).
///
/// A backend matches on this rather than on [`ClaimMode`] wherever it builds SQL for one mode:
/// the arm hands it the lease column or the key template, so no backend has to unwrap an
/// `Option` that the mode already guarantees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ModeColumns<'a> {
    /// Row lock mode: the transaction holds the row; no column.
    RowLock,
    /// Lease mode, with its `locked_until` column.
    Lease {
        /// The lease expiry column.
        locked_until: &'a str,
    },
    /// Advisory mode, with its key template.
    Advisory {
        /// The template a row's key is built from.
        key: &'a KeyTemplate,
    },
}

impl ModeColumns<'_> {
    /// The claim mode, without its columns.
    pub fn mode(&self) -> ClaimMode {
        match self {
            Self::RowLock => ClaimMode::RowLock,
            Self::Lease { .. } => ClaimMode::Lease,
            Self::Advisory { .. } => ClaimMode::Advisory,
        }
    }
}
