//! What a broken invariant reports: one variant per guarantee of SPEC sections 2, 7 and 10 that
//! a history can show broken, with the deliveries that show it.

use std::fmt;

use broker_core::ClaimMode;

use super::{Final, Record};

/// A guarantee the history shows broken, with the deliveries that show it. `first` comes before
/// `second` in the order the guarantee is about (claim order for a row, start order for a key
/// or a group).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Violation {
    /// A handler had not returned when the history was checked: the run ended with work in
    /// hand.
    StillRunning {
        /// The delivery still running.
        delivery: Box<Record>,
    },
    /// One row in two deliveries at once (SPEC 10: never while its claim holds).
    RowInTwoDeliveries {
        /// The delivery that held the row.
        first: Box<Record>,
        /// The delivery that began before `first` ended.
        second: Box<Record>,
    },
    /// A timed-out delivery's handler had not ended (returned, or been dropped) when the row's
    /// next delivery began (issue #48: the future is dropped before the row is given back).
    TimedOutOverlapsNext {
        /// The timed-out delivery.
        first: Box<Record>,
        /// The row's next delivery, which began before `first` ended.
        second: Box<Record>,
    },
    /// Two rows of one advisory key in work at once (SPEC 5, 10).
    KeyInTwoDeliveries {
        /// The delivery that held the key.
        first: Box<Record>,
        /// The delivery that began before `first` ended.
        second: Box<Record>,
    },
    /// Two rows of one FIFO group in work at once (SPEC 7: one row at a time).
    GroupInTwoDeliveries {
        /// The delivery that held the group.
        first: Box<Record>,
        /// The delivery that began before `first` ended.
        second: Box<Record>,
    },
    /// A FIFO group went back to a row before the one it ran last (SPEC 7: in order).
    GroupOutOfOrder {
        /// The group.
        group: String,
        /// The later row's delivery.
        first: Box<Record>,
        /// The earlier row's delivery, which began after it.
        second: Box<Record>,
    },
    /// A FIFO group began a later row before its head row was finished (SPEC 7: the head
    /// first).
    GroupMovedOnEarly {
        /// The group.
        group: String,
        /// The last delivery of the head row before the group moved on.
        first: Box<Record>,
        /// The later row's delivery.
        second: Box<Record>,
        /// What the database holds for the head row after the run.
        database: Option<Final>,
        /// Every delivery of the head row, in claim order.
        deliveries: Vec<Record>,
    },
    /// A published row no handler ever saw (SPEC 10: no row is lost).
    RowNeverDelivered {
        /// The row id.
        id: i64,
        /// What the database holds for it after the run.
        database: Final,
    },
    /// A handler saw a row that was never published.
    RowNeverPublished {
        /// The row id.
        id: i64,
    },
    /// A row's first delivery did not read attempt 1 (SPEC 2).
    FirstAttemptNotOne {
        /// The first delivery.
        delivery: Box<Record>,
    },
    /// A row ran again after a delivery acked or dead-lettered it.
    RunAfterFinished {
        /// The delivery that finished the row.
        first: Box<Record>,
        /// The delivery after it.
        second: Box<Record>,
    },
    /// A row started again after an operator cancelled it while it ran (issue #48).
    RunAfterCancelled {
        /// The delivery the cancel reached.
        first: Box<Record>,
        /// The delivery after it.
        second: Box<Record>,
    },
    /// The next delivery of a row read another attempt than the claim mode counts after the
    /// previous one (SPEC 2).
    AttemptMiscounted {
        /// The previous delivery.
        first: Box<Record>,
        /// The next delivery.
        second: Box<Record>,
        /// The attempt `second` should have read.
        expected: i64,
        /// The claim mode that counts it.
        mode: ClaimMode,
    },
    /// A row was delivered again while the lease of a crashed holder still held (SPEC 4: a
    /// lease outlives its process).
    LeaseCutShort {
        /// The crashed holder.
        first: Box<Record>,
        /// The delivery that began before its lease ran out.
        second: Box<Record>,
    },
    /// The database does not hold what the row's last outcome says: a settlement was lost or
    /// another one landed (SPEC 8: every outcome is settled).
    SettlementLost {
        /// The row id.
        id: i64,
        /// What the last delivery's outcome makes of the row (`None`: back in the queue).
        said: Option<Final>,
        /// What the database holds.
        database: Final,
        /// The row's last delivery, in claim order.
        last: Box<Record>,
    },
}

impl Violation {
    /// The invariant's name, as the variant spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::StillRunning { .. } => "StillRunning",
            Self::RowInTwoDeliveries { .. } => "RowInTwoDeliveries",
            Self::TimedOutOverlapsNext { .. } => "TimedOutOverlapsNext",
            Self::KeyInTwoDeliveries { .. } => "KeyInTwoDeliveries",
            Self::GroupInTwoDeliveries { .. } => "GroupInTwoDeliveries",
            Self::GroupOutOfOrder { .. } => "GroupOutOfOrder",
            Self::GroupMovedOnEarly { .. } => "GroupMovedOnEarly",
            Self::RowNeverDelivered { .. } => "RowNeverDelivered",
            Self::RowNeverPublished { .. } => "RowNeverPublished",
            Self::FirstAttemptNotOne { .. } => "FirstAttemptNotOne",
            Self::RunAfterFinished { .. } => "RunAfterFinished",
            Self::RunAfterCancelled { .. } => "RunAfterCancelled",
            Self::AttemptMiscounted { .. } => "AttemptMiscounted",
            Self::LeaseCutShort { .. } => "LeaseCutShort",
            Self::SettlementLost { .. } => "SettlementLost",
        }
    }

    /// The two deliveries a violation of a pair is about.
    pub(super) fn pair(&self) -> Option<(&Record, &Record)> {
        match self {
            Self::RowInTwoDeliveries { first, second }
            | Self::TimedOutOverlapsNext { first, second }
            | Self::KeyInTwoDeliveries { first, second }
            | Self::GroupInTwoDeliveries { first, second }
            | Self::GroupOutOfOrder { first, second, .. }
            | Self::GroupMovedOnEarly { first, second, .. }
            | Self::RunAfterFinished { first, second }
            | Self::RunAfterCancelled { first, second }
            | Self::AttemptMiscounted { first, second, .. }
            | Self::LeaseCutShort { first, second } => Some((first, second)),
            _ => None,
        }
    }
}

/// The message reads as the guarantee broken, then the name of the invariant in brackets, then
/// the deliveries that show it, one a line.
impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        match self {
            Self::StillRunning { delivery } => {
                write!(f, "still running at the check [{name}]: {delivery:?}")?;
            }
            Self::RowInTwoDeliveries { .. } => write!(f, "one row in two deliveries at once")?,
            Self::TimedOutOverlapsNext { .. } => write!(
                f,
                "a timed-out delivery was still running when its row's next delivery began"
            )?,
            Self::KeyInTwoDeliveries { .. } => write!(f, "one key in two deliveries at once")?,
            Self::GroupInTwoDeliveries { .. } => write!(f, "one group in two deliveries at once")?,
            Self::GroupOutOfOrder {
                group,
                first,
                second,
            } => write!(
                f,
                "group {group} went back from row {} to row {}",
                first.id, second.id
            )?,
            Self::GroupMovedOnEarly { group, first, .. } => write!(
                f,
                "group {group} moved on from row {} before it finished",
                first.id
            )?,
            Self::RowNeverDelivered { id, database } => write!(
                f,
                "row {id} was never delivered (final state {database:?}) [{name}]"
            )?,
            Self::RowNeverPublished { id } => {
                write!(f, "row {id} was delivered but never published [{name}]")?;
            }
            Self::FirstAttemptNotOne { delivery } => write!(
                f,
                "row {}: first delivery reads attempt {}, not 1 [{name}]:\n  {delivery:?}",
                delivery.id, delivery.attempt
            )?,
            Self::RunAfterFinished { first, .. } => {
                write!(f, "row {} was delivered again after it finished", first.id)?;
            }
            Self::RunAfterCancelled { first, .. } => {
                write!(f, "row {} started again after it was cancelled", first.id)?;
            }
            Self::AttemptMiscounted {
                first,
                second,
                expected,
                mode,
            } => {
                write!(
                    f,
                    "row {}: attempt went from {} to {}",
                    first.id, first.attempt, second.attempt
                )?;
                match first.cut {
                    Some(cut) => write!(f, " across a {cut:?} in {mode} mode")?,
                    None => write!(
                        f,
                        " (expected +{} in {mode} mode)",
                        expected - first.attempt
                    )?,
                }
            }
            Self::LeaseCutShort { first, .. } => write!(
                f,
                "row {} was delivered again before the crashed holder's lease ran out",
                first.id
            )?,
            Self::SettlementLost {
                id,
                said,
                database,
                last,
            } => write!(
                f,
                "row {id}: outcomes say {said:?}, the database says {database:?} [{name}]; last delivery {last:?}"
            )?,
        }
        if let Some((first, second)) = self.pair() {
            write!(f, " [{name}]:\n  {first:?}\n  {second:?}")?;
        }
        if let Self::GroupMovedOnEarly {
            first,
            database,
            deliveries,
            ..
        } = self
        {
            write!(
                f,
                "\n  row {} ends {database:?} in the database; its deliveries by attempt:",
                first.id
            )?;
            for r in deliveries {
                write!(f, "\n    {r:?}")?;
            }
        }
        Ok(())
    }
}
