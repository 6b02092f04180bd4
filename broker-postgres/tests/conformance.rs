//! The whole conformance suite against PostgreSQL: each test gets a database of its own (see
//! `common`), so the cases' advisory keys never meet another test's.

mod common;

use common::Pg;

broker_testkit::conformance_suite!(Pg);
