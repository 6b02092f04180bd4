//! Rows to publish.

use std::time::SystemTime;

use crate::driver::clock;
use crate::error::{Result, SqlxBrokerError};
use crate::table::{MAX_UNIQUE_KEY_CHARS, TableDescription};

/// What publishing one job did: the row's id, and whether the job was a duplicate of an
/// unfinished row with its [unique key](NewJob::unique_key), whose id this is (nothing was
/// inserted). Returned by [`Queue::publish_unique`](crate::Queue::publish_unique) and its
/// batch and transaction forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Published {
    /// The new row's id, or the existing row's for a duplicate.
    pub id: i64,
    /// Whether an unfinished row had the job's unique key, so nothing was inserted.
    pub duplicate: bool,
}

/// A value for a declared column (see [`TableBuilder::column`](crate::TableBuilder::column)).
///
/// Exhaustive on purpose (not `#[non_exhaustive]`): every backend turns each variant into SQL,
/// so a new variant must fail to compile in each backend rather than fall into a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// SQL NULL.
    Null,
    /// Text.
    Text(String),
    /// A 64-bit integer.
    BigInt(i64),
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Self::Text(v.to_owned())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Self::BigInt(v)
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Self::Null, Into::into)
    }
}

/// One row to publish: the payload and the optional columns the description names.
///
/// ```
/// use broker_core::NewJob;
/// let job = NewJob::new("send welcome mail")
///     .group("user-7")
///     .priority(5)
///     .column("account", 7);
/// assert_eq!(job.payload(), &"send welcome mail");
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct NewJob<P> {
    payload: P,
    group: Option<String>,
    priority: Option<i64>,
    due_ms: Option<i64>,
    unique_key: Option<String>,
    timeout_ms: Option<i64>,
    columns: Vec<(String, Value)>,
}

impl<P> NewJob<P> {
    /// A row with this payload, due now.
    pub fn new(payload: P) -> Self {
        Self {
            payload,
            group: None,
            priority: None,
            due_ms: None,
            unique_key: None,
            timeout_ms: None,
            columns: Vec::new(),
        }
    }
    /// The job's own timeout (the table needs a [job timeout
    /// column](crate::TableBuilder::job_timeout)): its deliveries run under it in place of
    /// their kind's or the subscription's [`timeout`](crate::SubscribeOptions::timeout), to the
    /// millisecond (at least 1 ms).
    pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout_ms = Some(
            i64::try_from(timeout.as_millis())
                .unwrap_or(i64::MAX)
                .max(1),
        );
        self
    }
    /// The job's own timeout in milliseconds, if set.
    pub fn timeout_ms(&self) -> Option<i64> {
        self.timeout_ms
    }
    /// The unique key (the table needs a [unique key column](crate::TableBuilder::unique_key)):
    /// while an unfinished row has this key, publishing the job again inserts nothing and
    /// returns that row's id, marked as a [duplicate](Published::duplicate). At most
    /// [`MAX_UNIQUE_KEY_CHARS`](crate::MAX_UNIQUE_KEY_CHARS) characters, not empty.
    pub fn unique_key(mut self, key: impl Into<String>) -> Self {
        self.unique_key = Some(key.into());
        self
    }
    /// The unique key, if set.
    pub fn unique_key_value(&self) -> Option<&str> {
        self.unique_key.as_deref()
    }
    /// The group (the table needs a group column).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }
    /// The priority (the table needs a priority column); higher runs first.
    pub fn priority(mut self, priority: i64) -> Self {
        self.priority = Some(priority);
        self
    }
    /// Not claimable before `at` (the table needs a due-time column).
    pub fn run_at(mut self, at: SystemTime) -> Self {
        self.due_ms = Some(clock::to_ms(at).min(clock::MAX_DUE_MS));
        self
    }
    /// Not claimable for `delay` from now (the table needs a due-time column).
    pub fn run_after(mut self, delay: std::time::Duration) -> Self {
        self.due_ms = Some(clock::after_ms(delay));
        self
    }
    /// A value for a declared column.
    pub fn column(mut self, column: impl Into<String>, value: impl Into<Value>) -> Self {
        self.columns.push((column.into(), value.into()));
        self
    }

    /// The payload.
    pub fn payload(&self) -> &P {
        &self.payload
    }
    /// The group, if set.
    pub fn group_value(&self) -> Option<&str> {
        self.group.as_deref()
    }
    /// The priority, if set.
    pub fn priority_value(&self) -> Option<i64> {
        self.priority
    }
    /// The due time (unix milliseconds), if set.
    pub fn due_ms(&self) -> Option<i64> {
        self.due_ms
    }
    /// The declared columns' values.
    pub fn columns(&self) -> &[(String, Value)] {
        &self.columns
    }
}

/// The columns a batch of [`NewJob`]s writes, worked out once per batch, so every backend's
/// INSERT names the same columns in the same order. The payload comes first (bound by the
/// backend with its own type), then [`values`](Self::values) in [`columns`](Self::columns) order.
#[derive(Debug, Clone)]
pub struct PublishPlan {
    columns: Vec<String>,
    group: bool,
    priority: bool,
    due: bool,
    extra: Vec<String>,
    unique: bool,
    /// Whether the jobs' own timeouts are written (some job sets one).
    timeout: bool,
    /// The host's clock when the plan was made: the due time of jobs that set none.
    now_ms: i64,
}

impl PublishPlan {
    /// Checks the jobs against the description: each value they set needs its column.
    pub fn new<P>(table: &TableDescription, jobs: &[NewJob<P>]) -> Result<Self> {
        let unsupported = |message: String| SqlxBrokerError::Unsupported {
            table: table.name().to_owned(),
            message,
        };
        let Some((payload, _)) = table.payload() else {
            return Err(unsupported(
                "the description names no payload column, so the broker cannot publish to it; add .payload(..) or insert rows with your own INSERT".into(),
            ));
        };
        let mut columns = vec![payload.to_owned()];
        let mut extra: Vec<String> = Vec::new();
        for job in jobs {
            if job.group.is_some() && table.group().is_none() {
                return Err(unsupported(
                    "a job sets a group, but the table has no group column; add .group(..)".into(),
                ));
            }
            if job.priority.is_some() && table.priority().is_none() {
                return Err(unsupported("a job sets a priority, but the table has no priority column; add .priority(..)".into()));
            }
            if job.due_ms.is_some() && table.due_at().is_none() {
                return Err(unsupported(
                    "a job sets a due time, but the table has no due-time column; add .due_at(..)"
                        .into(),
                ));
            }
            if job.timeout_ms.is_some() && table.job_timeout().is_none() {
                return Err(unsupported(
                    "a job sets its own timeout, but the table has no job timeout column; add .job_timeout(\"timeout_ms\")".into(),
                ));
            }
            if let Some(key) = &job.unique_key {
                if table.unique_key().is_none() {
                    return Err(unsupported(
                        "a job sets a unique key, but the table has no unique key column; add .unique_key(..)".into(),
                    ));
                }
                let chars = key.chars().count();
                if key.is_empty() || chars > MAX_UNIQUE_KEY_CHARS {
                    return Err(SqlxBrokerError::Refused {
                        table: table.name().to_owned(),
                        what: "publishing a job",
                        why: format!(
                            "its unique key is {chars} characters long; a key holds 1 to {MAX_UNIQUE_KEY_CHARS} characters (the unique index keeps no more): hash a longer key (e.g. SHA-256 as hex), or leave it unset for no key"
                        ),
                    });
                }
            }
            for (c, _) in &job.columns {
                if !table.columns().iter().any(|(d, _)| d == c) {
                    return Err(unsupported(format!(
                        "a job sets column \"{c}\", which the description does not declare; add .column(\"{c}\", ..)"
                    )));
                }
                if !extra.contains(c) {
                    extra.push(c.clone());
                }
            }
        }
        let group = table.group().map(|g| columns.push(g.to_owned())).is_some();
        let priority = table
            .priority()
            .map(|p| columns.push(p.to_owned()))
            .is_some();
        let due = table.due_at().map(|d| columns.push(d.to_owned())).is_some();
        columns.extend(extra.iter().cloned());
        let unique = table
            .unique_key()
            .map(|u| columns.push(u.to_owned()))
            .is_some();
        // Written only when a job sets one and no job sets the column by hand.
        let timeout = match table.job_timeout() {
            Some(t)
                if jobs.iter().any(|j| j.timeout_ms.is_some()) && !extra.iter().any(|c| c == t) =>
            {
                columns.push(t.to_owned());
                true
            }
            _ => false,
        };
        Ok(Self {
            columns,
            group,
            priority,
            due,
            extra,
            unique,
            timeout,
            now_ms: clock::now_ms(),
        })
    }

    /// The columns, payload first.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// How many values one row binds (the payload included).
    pub fn width(&self) -> usize {
        self.columns.len()
    }

    /// The values of one job after its payload, in column order (an unset priority is 0, an
    /// unset due time the host's clock at the publish: when the row became due, from which the
    /// queue's lag and the time to its handler's start are measured).
    pub fn values<P>(&self, job: &NewJob<P>) -> Vec<Value> {
        let mut out = Vec::with_capacity(self.columns.len());
        if self.group {
            out.push(job.group.clone().into());
        }
        if self.priority {
            out.push(Value::BigInt(job.priority.unwrap_or(0)));
        }
        if self.due {
            out.push(Value::BigInt(job.due_ms.unwrap_or(self.now_ms)));
        }
        for c in &self.extra {
            let v = job
                .columns
                .iter()
                .find(|(n, _)| n == c)
                .map(|(_, v)| v.clone());
            out.push(v.unwrap_or(Value::Null));
        }
        if self.unique {
            out.push(job.unique_key.clone().into());
        }
        if self.timeout {
            out.push(job.timeout_ms.into());
        }
        out
    }
}
