//! The conformance cases. Each is a generic async function over a [`TestDb`];
//! cases about a claim mode take it as an argument. [`conformance_suite!`](crate::conformance_suite)
//! stamps a mode's cases only for backends that offer the mode, so no case returns early.

mod admin;
mod attempts;
mod backlog;
mod bad_input;
mod cancel;
mod concurrency;
mod ddl;
mod description;
mod faults;
mod fencing;
mod fifo;
mod first_hour;
mod hardening;
mod head;
mod held;
mod kinds;
mod kinds_ops;
mod last_error;
mod lifecycle;
mod literals;
mod middleware;
mod outage;
mod periodic;
mod restart;
mod row_type;
mod settle;
mod signals;
mod signals_process;
mod snooze;
mod stress;
mod timeouts;
mod unique;

pub use admin::*;
pub use attempts::*;
pub use backlog::*;
pub use bad_input::*;
pub use cancel::*;
pub use concurrency::*;
pub use ddl::*;
pub use description::*;
pub use faults::*;
pub use fencing::*;
pub use fifo::*;
pub use first_hour::*;
pub use hardening::*;
pub use head::*;
pub use held::*;
pub use kinds::*;
pub use kinds_ops::*;
pub use last_error::*;
pub use lifecycle::*;
pub use literals::*;
pub use middleware::*;
pub use outage::*;
pub use periodic::*;
pub use restart::*;
pub use row_type::*;
pub use settle::*;
pub use signals::*;
pub use signals_process::*;
pub use snooze::*;
pub use stress::*;
pub use timeouts::*;
pub use unique::*;

use broker_core::{Delivery, Queue};

use crate::TestDb;

/// Waits (bounded) until `sub` reports a claimed row that did not decode.
pub(crate) async fn wait_for_a_decode_error(sub: &broker_core::Subscription) {
    crate::wait_until(
        "the decode error shows in health()",
        std::time::Duration::from_secs(30),
        || {
            let h = sub.health();
            async move { h.decode_errors_in_a_row > 0 }
        },
    )
    .await;
}

/// Claims one delivery, waiting (bounded) until one is due.
pub(crate) async fn claim_one<D: TestDb>(queue: &Queue<D::B, D::Job>) -> Delivery<D::B, D::Job> {
    crate::claim_one(queue).await
}
