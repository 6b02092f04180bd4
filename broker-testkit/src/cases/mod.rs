//! The conformance cases. Each is a generic async function over a [`TestDb`](crate::TestDb);
//! cases about a claim mode take it as an argument, and return early (after checking that the
//! mode is refused as such) when the backend does not offer it.

mod attempts;
mod bad_input;
mod concurrency;
mod description;
mod faults;
mod hardening;
mod lifecycle;
mod settle;

pub use attempts::*;
pub use bad_input::*;
pub use concurrency::*;
pub use description::*;
pub use faults::*;
pub use hardening::*;
pub use lifecycle::*;
pub use settle::*;

use broker_core::{Delivery, Queue};

use crate::TestDb;

/// Claims one delivery, waiting (bounded) until one is due.
pub(crate) async fn claim_one<D: TestDb>(queue: &Queue<D::B, D::Job>) -> Delivery<D::B, D::Job> {
    crate::claim_one(queue).await
}
