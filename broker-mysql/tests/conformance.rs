//! The whole conformance suite against MariaDB (or MySQL): each test gets a database of its own
//! (see `common`), so the cases' advisory keys never meet another test's.

mod common;

use common::MySql;

broker_testkit::conformance_suite!(MySql);
