//! The claim modes by name.

use std::fmt;

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
