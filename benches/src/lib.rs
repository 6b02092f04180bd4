//! Benchmarks arrive with their own issue.
