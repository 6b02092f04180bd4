//! Placeholder: this backend arrives with its own issue.
