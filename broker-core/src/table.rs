//! The table description: which column plays which role, and the claim mode that follows.

use std::time::Duration;

use crate::claim_mode::{ClaimMode, ModeColumns};
use crate::error::{Result, SqlxBrokerError};

/// The SQL type of a column the DDL helper creates.
///
/// Exhaustive on purpose (not `#[non_exhaustive]`): every backend turns each variant into SQL,
/// so a new variant must fail to compile in each backend rather than fall into a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    /// Text (`TEXT`; on MySQL `LONGTEXT`, or `VARCHAR(255)` where an index reads the column).
    Text,
    /// A 64-bit integer.
    BigInt,
    /// A JSON document (`JSONB` on PostgreSQL, `JSON` on MySQL, `TEXT` on SQLite).
    Json,
    /// Bytes (`BYTEA`, `LONGBLOB`, `BLOB`).
    Bytes,
}

/// Where a row goes when it is dead-lettered.
///
/// Exhaustive on purpose (not `#[non_exhaustive]`): every backend turns each variant into SQL,
/// so a new variant must fail to compile in each backend rather than fall into a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetter {
    /// The row moves to this table, which has the same columns in the same order (the DDL helper
    /// creates it).
    Table(String),
    /// The row stays and this timestamp column is set; claims skip rows where it is set.
    Column(String),
}

/// The isolation level a claim transaction opens at.
///
/// Exhaustive on purpose (not `#[non_exhaustive]`): every backend turns each variant into SQL,
/// so a new variant must fail to compile in each backend rather than fall into a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsolationLevel {
    /// READ COMMITTED (the default for claims on MySQL and MariaDB, and PostgreSQL's default).
    ReadCommitted,
    /// REPEATABLE READ.
    RepeatableRead,
    /// SERIALIZABLE.
    Serializable,
}

impl IsolationLevel {
    /// The level as SQL spells it.
    pub fn as_sql(self) -> &'static str {
        match self {
            Self::ReadCommitted => "READ COMMITTED",
            Self::RepeatableRead => "REPEATABLE READ",
            Self::Serializable => "SERIALIZABLE",
        }
    }
}

/// One piece of an advisory key template.
///
/// Exhaustive on purpose (not `#[non_exhaustive]`): every backend turns each variant into SQL,
/// so a new variant must fail to compile in each backend rather than fall into a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// Text copied into the key as it is.
    Literal(String),
    /// A column whose value (as text; NULL as the empty string) goes into the key.
    Column(String),
}

/// A parsed `advisory_lock` template such as `"accounts-{account}"`.
///
/// `{column}` interpolates a column's value; `{{` and `}}` stand for literal braces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTemplate {
    source: String,
    parts: Vec<KeyPart>,
}

impl KeyTemplate {
    /// Parses a template; `table` only names the table in errors.
    pub fn parse(table: &str, template: &str) -> Result<Self> {
        let err = |what: String| {
            SqlxBrokerError::description(
                table,
                format!("advisory_lock template \"{template}\" {what}"),
            )
        };
        if template.is_empty() {
            return Err(err(
                "is empty; name at least one column, e.g. \"account-{account}\"".into(),
            ));
        }
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = template.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let mut column = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some('{') => {
                                return Err(err(
                                    "opens a brace inside a brace; write {{ for a literal brace"
                                        .into(),
                                ));
                            }
                            Some(c) => column.push(c),
                            None => {
                                return Err(err(
                                    "has an unbalanced brace: a '{' is never closed; close it or write {{ for a literal brace".into(),
                                ));
                            }
                        }
                    }
                    let column = column.trim().to_owned();
                    if column.is_empty() {
                        return Err(err(
                            "has an empty {}; put a column name inside the braces".into()
                        ));
                    }
                    if !literal.is_empty() {
                        parts.push(KeyPart::Literal(std::mem::take(&mut literal)));
                    }
                    parts.push(KeyPart::Column(column));
                }
                '}' => {
                    return Err(err(
                        "has an unbalanced brace: a '}' closes nothing; remove it or write }} for a literal brace".into(),
                    ));
                }
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(KeyPart::Literal(literal));
        }
        if !parts.iter().any(|p| matches!(p, KeyPart::Column(_))) {
            return Err(err(
                "names no column, so every row would share one key; add a {column}".into(),
            ));
        }
        Ok(Self {
            source: template.to_owned(),
            parts,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The parsed pieces, in order.
    pub fn parts(&self) -> &[KeyPart] {
        &self.parts
    }

    /// The columns the template reads, in order of first use, without repeats.
    pub fn columns(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for part in &self.parts {
            if let KeyPart::Column(c) = part
                && !out.contains(&c.as_str())
            {
                out.push(c);
            }
        }
        out
    }

    /// Renders the key from the template columns' values, given in the order of
    /// [`columns`](Self::columns); `None` renders as the empty string.
    pub fn render(&self, values: &[Option<String>]) -> String {
        let columns = self.columns();
        let mut key = String::new();
        for part in &self.parts {
            match part {
                KeyPart::Literal(text) => key.push_str(text),
                KeyPart::Column(c) => {
                    let i = columns.iter().position(|x| x == c).unwrap_or(usize::MAX);
                    if let Some(Some(v)) = values.get(i) {
                        key.push_str(v);
                    }
                }
            }
        }
        key
    }
}

/// A queue table: its name, which column plays which role, and the claim mode that follows.
///
/// Build one with [`TableDescription::builder`]; every invalid combination is refused by
/// [`TableBuilder::build`] with an error that names the table and what to change.
#[derive(Debug, Clone)]
pub struct TableDescription {
    name: String,
    id: String,
    payload: Option<(String, ColumnType)>,
    attempt: String,
    locked_until: Option<String>,
    advisory_lock: Option<KeyTemplate>,
    group: Option<String>,
    fifo: bool,
    priority: Option<String>,
    due_at: Option<String>,
    processed_at: Option<String>,
    last_error: Option<String>,
    snoozes: Option<String>,
    unique_key: Option<String>,
    lease_seconds: u32,
    isolation: Option<IsolationLevel>,
    max_attempts: Option<u32>,
    dead_letter: Option<DeadLetter>,
    columns: Vec<(String, ColumnType)>,
    kind: Option<String>,
    job_timeout: Option<String>,
    serving: Option<Vec<String>>,
}

/// The longest unique key a job may carry, in characters: what every database's unique index
/// holds (MySQL's key column is `VARCHAR(255)`).
pub const MAX_UNIQUE_KEY_CHARS: usize = 255;

/// The lease length when the description sets none.
pub const DEFAULT_LEASE_SECONDS: u32 = 30;

impl TableDescription {
    /// Starts a description of the table `name`. The id column defaults to `id` and the attempt
    /// column to `attempt`.
    pub fn builder(name: impl Into<String>) -> TableBuilder {
        TableBuilder {
            name: name.into(),
            id: "id".into(),
            payload: None,
            attempt: "attempt".into(),
            locked_until: None,
            advisory_lock: None,
            group: None,
            fifo: false,
            priority: None,
            due_at: None,
            processed_at: None,
            last_error: None,
            snoozes: None,
            unique_key: None,
            lease_seconds: None,
            isolation: None,
            max_attempts: None,
            dead_letter: None,
            columns: Vec::new(),
            kind: None,
            job_timeout: None,
        }
    }

    /// The table's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The id column (a 64-bit integer key).
    pub fn id(&self) -> &str {
        &self.id
    }
    /// The payload column and its type, if the table has one.
    pub fn payload(&self) -> Option<(&str, ColumnType)> {
        self.payload.as_ref().map(|(c, t)| (c.as_str(), *t))
    }
    /// The attempt column (an integer that starts at 1).
    pub fn attempt(&self) -> &str {
        &self.attempt
    }
    /// The lease expiry column (lease mode).
    pub fn locked_until(&self) -> Option<&str> {
        self.locked_until.as_deref()
    }
    /// The columns of the key index the DDL helper creates before the id on an advisory table:
    /// the key template's, in order of first use. `None` when the table gets none: not
    /// advisory, a FIFO table (its walk reads the group index), or a template that reads only
    /// the id (every row is its own key, so nothing can wait behind a held one).
    pub fn key_index_columns(&self) -> Option<Vec<&str>> {
        let cols = self.advisory_lock.as_ref()?.columns();
        (!self.fifo && cols != [self.id()]).then_some(cols)
    }

    /// The columns an advisory claim's walk visits when a window in claim order held only keys
    /// in work: on a FIFO table the group column (through the group index, taking each group's
    /// head), otherwise the [key index's](Self::key_index_columns). `None`: no walk.
    pub fn key_walk_columns(&self) -> Option<Vec<&str>> {
        self.advisory_lock.as_ref()?;
        match self.group().filter(|_| self.fifo) {
            Some(g) => Some(vec![g]),
            None => self.key_index_columns(),
        }
    }

    /// The advisory key template (advisory mode).
    pub fn advisory_lock(&self) -> Option<&KeyTemplate> {
        self.advisory_lock.as_ref()
    }
    /// The group column.
    pub fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }
    /// Whether each group is processed in order, one row at a time.
    pub fn fifo(&self) -> bool {
        self.fifo
    }
    /// The priority column (higher runs first).
    pub fn priority(&self) -> Option<&str> {
        self.priority.as_deref()
    }
    /// The due-time column (delayed retries and scheduled rows).
    pub fn due_at(&self) -> Option<&str> {
        self.due_at.as_deref()
    }
    /// The column an ack sets instead of deleting the row.
    pub fn processed_at(&self) -> Option<&str> {
        self.processed_at.as_deref()
    }
    /// The column a handler's last error is written into, if the table has one.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }
    /// The integer column that counts a row's snoozes, if the table has one (see
    /// [`TableBuilder::snoozes`]).
    pub fn snoozes(&self) -> Option<&str> {
        self.snoozes.as_deref()
    }
    /// The unique key column: a text column that, while a row is unfinished, no other
    /// unfinished row shares (see [`TableBuilder::unique_key`]).
    pub fn unique_key(&self) -> Option<&str> {
        self.unique_key.as_deref()
    }
    /// The columns that stay NULL while a row is unfinished: `processed_at` and a dead-letter
    /// mark column, those the table has. A row is unfinished (claimable in time, a FIFO head
    /// candidate) while all of them are NULL; empty when an ack deletes and a dead letter moves.
    pub fn unfinished_columns(&self) -> Vec<&str> {
        let mut out = Vec::new();
        out.extend(self.processed_at());
        if let Some(DeadLetter::Column(c)) = self.dead_letter() {
            out.push(c.as_str());
        }
        out
    }
    /// The lease length in whole seconds.
    pub fn lease_seconds(&self) -> u32 {
        self.lease_seconds
    }
    /// The lease length.
    pub fn lease(&self) -> Duration {
        Duration::from_secs(u64::from(self.lease_seconds))
    }
    /// The isolation level claim transactions open at, if the description sets one.
    pub fn isolation(&self) -> Option<IsolationLevel> {
        self.isolation
    }
    /// The number of deliveries after which a failing row is dead-lettered.
    pub fn max_attempts(&self) -> Option<u32> {
        self.max_attempts
    }
    /// Where dead-lettered rows go.
    pub fn dead_letter(&self) -> Option<&DeadLetter> {
        self.dead_letter.as_ref()
    }
    /// Further columns the description declares (read by the key template, created by the DDL
    /// helper).
    pub fn columns(&self) -> &[(String, ColumnType)] {
        &self.columns
    }
    /// The kind column of a table of many job kinds (see [`TableBuilder::kind`]).
    pub fn kind(&self) -> Option<&str> {
        self.kind.as_deref()
    }
    /// The column of each job's own timeout (see [`TableBuilder::job_timeout`]).
    pub fn job_timeout(&self) -> Option<&str> {
        self.job_timeout.as_deref()
    }
    /// The kinds this description's claims take, when it was made for a subscription of some
    /// kinds ([`serving_kinds`](Self::serving_kinds)); `None`: every row.
    pub fn served_kinds(&self) -> Option<&[String]> {
        self.serving.as_deref()
    }
    /// A copy of this description whose claims take only rows of these kinds: what a
    /// subscription of registered kinds prepares, so rows of a kind no worker of the process
    /// knows are never claimed and stay for a process that knows them.
    ///
    /// # Errors
    /// [`SqlxBrokerError::Description`] for a table without a [kind column](TableBuilder::kind),
    /// an empty list, or a kind name [`check_kind_name`] refuses.
    pub fn serving_kinds(&self, kinds: &[&str]) -> Result<Self> {
        let bad = |message: String| Err(SqlxBrokerError::description(&self.name, message));
        if self.kind.is_none() {
            return bad(
                "has no kind column, so its claims cannot pick kinds; add .kind(\"kind\") (and a JSON payload column for the arguments)".into(),
            );
        }
        if kinds.is_empty() {
            return bad("is served for no kind; register at least one worker".into());
        }
        let mut served = Vec::with_capacity(kinds.len());
        for kind in kinds {
            check_kind_name(kind).map_err(|why| SqlxBrokerError::description(&self.name, why))?;
            if !served.iter().any(|k: &String| k == kind) {
                served.push((*kind).to_owned());
            }
        }
        let mut out = self.clone();
        out.serving = Some(served);
        Ok(out)
    }
    /// The claim condition on the kind column for a description made with
    /// [`serving_kinds`](Self::serving_kinds): `{column} IN ('a', 'b')`, where `column` is the
    /// kind column as the backend's statement names it. `None` for every other description.
    /// Kind names are checked by [`check_kind_name`], so they are literals without quotes or
    /// backslashes in every SQL dialect.
    pub fn kind_condition(&self, column: &str) -> Option<String> {
        let kinds = self.serving.as_ref()?;
        let list: Vec<String> = kinds.iter().map(|k| format!("'{k}'")).collect();
        Some(format!("{column} IN ({})", list.join(", ")))
    }
    /// The claim mode the description selects.
    pub fn mode(&self) -> ClaimMode {
        self.mode_columns().mode()
    }
    /// The claim mode with the column that holds a row in it: what a backend matches on to
    /// build one mode's SQL.
    pub fn mode_columns(&self) -> ModeColumns<'_> {
        // The builder refuses a description that sets both, so the first arm is lease alone.
        match (&self.locked_until, &self.advisory_lock) {
            (Some(locked_until), _) => ModeColumns::Lease { locked_until },
            (None, Some(key)) => ModeColumns::Advisory { key },
            (None, None) => ModeColumns::RowLock,
        }
    }

    /// Every column the description names, with the role it plays, for startup checks.
    pub fn named_columns(&self) -> Vec<(&str, &'static str)> {
        let mut out = vec![(self.id.as_str(), "id"), (self.attempt.as_str(), "attempt")];
        let optional = [
            (self.payload.as_ref().map(|p| p.0.as_str()), "payload"),
            (self.locked_until.as_deref(), "locked_until"),
            (self.group.as_deref(), "group"),
            (self.priority.as_deref(), "priority"),
            (self.due_at.as_deref(), "due_at"),
            (self.processed_at.as_deref(), "processed_at"),
            (self.last_error.as_deref(), "last_error"),
            (self.snoozes.as_deref(), "snoozes"),
            (self.unique_key.as_deref(), "unique_key"),
            (
                match &self.dead_letter {
                    Some(DeadLetter::Column(c)) => Some(c.as_str()),
                    _ => None,
                },
                "dead_letter",
            ),
        ];
        out.extend(optional.into_iter().filter_map(|(c, r)| c.map(|c| (c, r))));
        let keys = self
            .advisory_lock
            .as_ref()
            .map(KeyTemplate::columns)
            .unwrap_or_default();
        out.extend(self.columns.iter().map(|(c, _)| {
            let role = if keys.contains(&c.as_str()) {
                "advisory key"
            } else if self.kind.as_deref() == Some(c.as_str()) {
                "kind"
            } else if self.job_timeout.as_deref() == Some(c.as_str()) {
                "job_timeout"
            } else {
                "declared"
            };
            (c.as_str(), role)
        }));
        out
    }

    /// Refuses a table, dead-letter table or column name longer than a database keeps.
    /// `limit` counts what `len` measures (bytes on PostgreSQL, characters on MySQL). A name cut
    /// short silently could become another name (with long names the dead-letter table was
    /// the queue table itself), so it is refused before any statement uses it.
    pub fn check_name_lengths(
        &self,
        database: &str,
        limit: usize,
        unit: &str,
        len: impl Fn(&str) -> usize,
    ) -> Result<()> {
        let mut names = vec![("the table name".to_owned(), self.name.as_str())];
        if let Some(DeadLetter::Table(d)) = &self.dead_letter {
            names.push(("the dead-letter table name".to_owned(), d.as_str()));
        }
        for (c, role) in self.named_columns() {
            names.push((format!("the {role} column name"), c));
        }
        for (what, name) in names {
            let n = len(name);
            if n > limit {
                return Err(SqlxBrokerError::description(
                    &self.name,
                    format!(
                        "{what} \"{name}\" is {n} {unit} long; {database} keeps at most {limit} (a longer name would be cut short and could become another one); use a shorter name"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Builds a [`TableDescription`]; see [`TableDescription::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct TableBuilder {
    name: String,
    id: String,
    payload: Option<(String, ColumnType)>,
    attempt: String,
    locked_until: Option<String>,
    advisory_lock: Option<String>,
    group: Option<String>,
    fifo: bool,
    priority: Option<String>,
    due_at: Option<String>,
    processed_at: Option<String>,
    last_error: Option<String>,
    snoozes: Option<String>,
    unique_key: Option<String>,
    lease_seconds: Option<u32>,
    isolation: Option<IsolationLevel>,
    max_attempts: Option<u32>,
    dead_letter: Option<DeadLetter>,
    columns: Vec<(String, ColumnType)>,
    kind: Option<String>,
    job_timeout: Option<String>,
}

impl TableBuilder {
    /// The id column (default `id`): a 64-bit integer primary key.
    pub fn id(mut self, column: impl Into<String>) -> Self {
        self.id = column.into();
        self
    }
    /// A payload column of the given type. Without one, handlers read whole rows through
    /// `sqlx::FromRow`.
    pub fn payload(mut self, column: impl Into<String>, ty: ColumnType) -> Self {
        self.payload = Some((column.into(), ty));
        self
    }
    /// The attempt column (default `attempt`): an integer that starts at 1.
    pub fn attempt(mut self, column: impl Into<String>) -> Self {
        self.attempt = column.into();
        self
    }
    /// A lease expiry column: selects lease mode.
    pub fn locked_until(mut self, column: impl Into<String>) -> Self {
        self.locked_until = Some(column.into());
        self
    }
    /// An advisory key template such as `"accounts-{account}"`: selects advisory mode.
    pub fn advisory_lock(mut self, template: impl Into<String>) -> Self {
        self.advisory_lock = Some(template.into());
        self
    }
    /// A group column (text).
    pub fn group(mut self, column: impl Into<String>) -> Self {
        self.group = Some(column.into());
        self
    }
    /// Process each group in order, one row at a time (needs a group column). Claims visit
    /// the groups in turn, each taking its group's first unfinished row when that row is due
    /// and free: within a group the order is by id; across groups it is turn by turn, not by
    /// priority or due time (rows without a group still come first, in the claim order).
    pub fn fifo(mut self, fifo: bool) -> Self {
        self.fifo = fifo;
        self
    }
    /// A priority column (integer, higher runs first).
    pub fn priority(mut self, column: impl Into<String>) -> Self {
        self.priority = Some(column.into());
        self
    }
    /// A due-time column: rows with a future due time are scheduled, and delayed retries set it.
    pub fn due_at(mut self, column: impl Into<String>) -> Self {
        self.due_at = Some(column.into());
        self
    }
    /// A timestamp column that an ack sets instead of deleting the row.
    pub fn processed_at(mut self, column: impl Into<String>) -> Self {
        self.processed_at = Some(column.into());
        self
    }
    /// A text column that keeps the handler's last error (its message, cut to
    /// [`LAST_ERROR_BYTES`](crate::admin::LAST_ERROR_BYTES)) when a delivery fails, for
    /// [`Queue::jobs`](crate::Queue::jobs) and the dead letters to show. Written after the
    /// settlement, in a statement of its own, only when a handler fails.
    pub fn last_error(mut self, column: impl Into<String>) -> Self {
        self.last_error = Some(column.into());
        self
    }
    /// An integer column that counts each row's snoozes ([`Outcome::Snooze`](crate::Outcome::Snooze)):
    /// every snooze adds one (NULL counts as 0), so a subscription's
    /// [`max_snoozes`](crate::SubscribeOptions::max_snoozes) can dead-letter a row snoozed too
    /// often. The DDL helper creates it as an integer that starts at 0.
    pub fn snoozes(mut self, column: impl Into<String>) -> Self {
        self.snoozes = Some(column.into());
        self
    }
    /// A text column holding each row's unique key ([`NewJob::unique_key`](crate::NewJob::unique_key)):
    /// while a row is unfinished (not acked, not dead-lettered), no other unfinished row has
    /// its key, and publishing one returns the existing row's id as a duplicate. The database
    /// enforces it with a unique index over unfinished rows that the DDL helper creates and
    /// the doctor checks; rows without a key (NULL) are never duplicates. Keys are at most
    /// [`MAX_UNIQUE_KEY_CHARS`] characters.
    pub fn unique_key(mut self, column: impl Into<String>) -> Self {
        self.unique_key = Some(column.into());
        self
    }
    /// The lease length in whole seconds (lease mode only; default 30).
    pub fn lease_seconds(mut self, seconds: u32) -> Self {
        self.lease_seconds = Some(seconds);
        self
    }
    /// The isolation level claim transactions open at.
    pub fn isolation(mut self, level: IsolationLevel) -> Self {
        self.isolation = Some(level);
        self
    }
    /// Dead-letter a row when a delivery fails and it has had this many (needs a dead-letter
    /// target).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }
    /// Where dead-lettered rows go.
    pub fn dead_letter(mut self, target: DeadLetter) -> Self {
        self.dead_letter = Some(target);
        self
    }
    /// The kind column of a table of many job kinds: text naming each row's kind, which
    /// [`JobKind`](crate::JobKind) workers dispatch on (see docs/job-kinds.md). It is a
    /// declared [`column`](Self::column) of type text as well, so the DDL helper creates it and
    /// publishing writes it; pair it with a [`ColumnType::Json`] payload for the arguments.
    pub fn kind(mut self, column: impl Into<String>) -> Self {
        let column = column.into();
        self.columns.push((column.clone(), ColumnType::Text));
        self.kind = Some(column);
        self
    }
    /// The column of each job's own timeout, in milliseconds (a 64-bit integer, NULL for
    /// none): what [`NewJob::timeout`](crate::NewJob::timeout) writes, and what a delivery of
    /// the row runs under in place of its kind's or the subscription's
    /// [`timeout`](crate::SubscribeOptions::timeout). A declared [`column`](Self::column) as
    /// well, so the DDL helper creates it.
    pub fn job_timeout(mut self, column: impl Into<String>) -> Self {
        let column = column.into();
        self.columns.push((column.clone(), ColumnType::BigInt));
        self.job_timeout = Some(column);
        self
    }
    /// Declares a further column (read by the key template, created by the DDL helper).
    pub fn column(mut self, column: impl Into<String>, ty: ColumnType) -> Self {
        self.columns.push((column.into(), ty));
        self
    }

    /// Checks the description and chooses its claim mode (SPEC section 2).
    pub fn build(self) -> Result<TableDescription> {
        let table = self.name.clone();
        let bad = |message: String| Err(SqlxBrokerError::description(&table, message));
        if self.name.is_empty() {
            return bad("the table name is empty; name the table".into());
        }
        let mut named: Vec<(&str, &str)> = vec![(&self.id, "id"), (&self.attempt, "attempt")];
        for (column, role) in [
            (self.payload.as_ref().map(|p| &p.0), "payload"),
            (self.locked_until.as_ref(), "locked_until"),
            (self.group.as_ref(), "group"),
            (self.priority.as_ref(), "priority"),
            (self.due_at.as_ref(), "due_at"),
            (self.processed_at.as_ref(), "processed_at"),
            (self.last_error.as_ref(), "last_error"),
            (self.snoozes.as_ref(), "snoozes"),
            (self.unique_key.as_ref(), "unique_key"),
            (
                match &self.dead_letter {
                    Some(DeadLetter::Column(c)) => Some(c),
                    _ => None,
                },
                "dead_letter column",
            ),
        ] {
            if let Some(c) = column {
                named.push((c, role));
            }
        }
        for (c, _) in &self.columns {
            named.push((c, "column"));
        }
        for (i, (column, role)) in named.iter().enumerate() {
            if column.is_empty() {
                return bad(format!("the {role} column name is empty; name the column"));
            }
            if column.contains('\0') {
                return bad(format!(
                    "the {role} column name contains a NUL character; rename the column"
                ));
            }
            if let Some((_, other)) = named[..i].iter().find(|(c, _)| c == column) {
                return bad(format!(
                    "column \"{column}\" is named for two roles ({other} and {role}); give each role its own column"
                ));
            }
        }
        if self.name.contains('\0') {
            return bad("the table name contains a NUL character; rename the table".into());
        }
        let advisory_lock = match &self.advisory_lock {
            Some(t) => Some(KeyTemplate::parse(&table, t)?),
            None => None,
        };
        let mode = match (&self.locked_until, &advisory_lock) {
            (Some(lu), Some(t)) => {
                return bad(format!(
                    "sets both locked_until (\"{lu}\", lease mode) and advisory_lock (\"{}\", advisory mode); keep one of them",
                    t.as_str()
                ));
            }
            (Some(_), None) => ClaimMode::Lease,
            (None, Some(_)) => ClaimMode::Advisory,
            (None, None) => ClaimMode::RowLock,
        };
        if let Some(t) = &advisory_lock {
            for column in t.columns() {
                if !named.iter().any(|(c, _)| *c == column) {
                    return bad(format!(
                        "advisory_lock names column \"{column}\", which the table does not have; declare it with .column(\"{column}\", ..) or fix the template"
                    ));
                }
            }
        }
        let lease_seconds = match (self.lease_seconds, mode) {
            (Some(0), _) => {
                return bad(
                    "lease_seconds is 0; a lease needs at least 1 second (the default is 30)"
                        .into(),
                );
            }
            (Some(s), ClaimMode::Lease) => s,
            (Some(_), _) => {
                return bad(
                    "sets lease_seconds, but only lease mode has a lease; add locked_until or drop lease_seconds".into(),
                );
            }
            (None, _) => DEFAULT_LEASE_SECONDS,
        };
        if let Some(kind) = &self.kind {
            match &self.payload {
                Some((_, ColumnType::Json)) => {}
                Some((p, ty)) => {
                    return bad(format!(
                        "has a kind column (\"{kind}\") and a payload column \"{p}\" of type {ty:?}; a kinds table keeps each job's arguments as JSON: make it .payload(\"{p}\", ColumnType::Json)"
                    ));
                }
                None => {
                    return bad(format!(
                        "has a kind column (\"{kind}\") but no payload column for the jobs' arguments; add .payload(\"args\", ColumnType::Json)"
                    ));
                }
            }
        }
        if self.fifo && self.group.is_none() {
            return bad("sets fifo but no group column; add .group(\"..\") or drop fifo".into());
        }
        match (self.max_attempts, &self.dead_letter) {
            (Some(0), _) => {
                return bad(
                    "max_attempts is 0; a row needs at least one attempt (set 1 or more)".into(),
                );
            }
            (Some(n), None) => {
                return bad(format!(
                    "sets max_attempts ({n}) but no dead-letter target, so an exhausted row would have nowhere to go; add .dead_letter(..)"
                ));
            }
            _ => {}
        }
        if let Some(DeadLetter::Table(dead)) = &self.dead_letter {
            if dead.is_empty() || dead.contains('\0') {
                return bad("the dead-letter table name is empty or holds a NUL; name it".into());
            }
            if *dead == self.name {
                return bad(
                    "the dead-letter table is the queue table itself; name another table".into(),
                );
            }
        }
        Ok(TableDescription {
            name: self.name,
            id: self.id,
            payload: self.payload,
            attempt: self.attempt,
            locked_until: self.locked_until,
            advisory_lock,
            group: self.group,
            fifo: self.fifo,
            priority: self.priority,
            due_at: self.due_at,
            processed_at: self.processed_at,
            last_error: self.last_error,
            snoozes: self.snoozes,
            unique_key: self.unique_key,
            lease_seconds,
            isolation: self.isolation,
            max_attempts: self.max_attempts,
            dead_letter: self.dead_letter,
            columns: self.columns,
            kind: self.kind,
            job_timeout: self.job_timeout,
            serving: None,
        })
    }
}

/// The longest kind name, in characters.
pub const MAX_KIND_CHARS: usize = 100;

/// Checks a job kind's name: 1 to [`MAX_KIND_CHARS`] characters of ASCII letters, digits and
/// `_ - . : /`. The name is stored in every row of the kind and written into claim statements
/// as a literal, so it is kept to characters every database reads the same; returns what to
/// change otherwise.
pub fn check_kind_name(kind: &str) -> std::result::Result<(), String> {
    if kind.is_empty() || kind.len() > MAX_KIND_CHARS {
        return Err(format!(
            "kind name \"{kind}\" has {} characters; give it 1 to {MAX_KIND_CHARS}",
            kind.chars().count()
        ));
    }
    if let Some(c) = kind
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_-.:/".contains(*c)))
    {
        return Err(format!(
            "kind name \"{kind}\" holds {c:?}; use ASCII letters, digits and _ - . : / only"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_carries_the_column_that_holds_a_row() {
        let lease = TableDescription::builder("t")
            .locked_until("lu")
            .build()
            .unwrap();
        assert_eq!(
            lease.mode_columns(),
            ModeColumns::Lease { locked_until: "lu" }
        );
        assert_eq!(lease.mode(), ClaimMode::Lease);
        let advisory = TableDescription::builder("t")
            .column("k", ColumnType::Text)
            .advisory_lock("a-{k}")
            .build()
            .unwrap();
        match advisory.mode_columns() {
            ModeColumns::Advisory { key } => assert_eq!(key.as_str(), "a-{k}"),
            other => panic!("advisory table gave {other:?}"),
        }
        assert_eq!(advisory.mode(), ClaimMode::Advisory);
        let row_lock = TableDescription::builder("t").build().unwrap();
        assert_eq!(row_lock.mode_columns(), ModeColumns::RowLock);
        assert_eq!(row_lock.mode(), ClaimMode::RowLock);
    }

    #[test]
    fn a_template_parses_literals_columns_and_escaped_braces() {
        let t = KeyTemplate::parse("t", "acc-{account}/{{x}}-{region}-{account}").unwrap();
        assert_eq!(t.columns(), vec!["account", "region"]);
        assert_eq!(
            t.render(&[Some("7".into()), None]),
            "acc-7/{x}--7".to_owned()
        );
    }

    #[test]
    fn bad_templates_say_what_to_change() {
        for (template, needle) in [
            ("", "is empty"),
            ("a-{b", "never closed"),
            ("a-}b", "closes nothing"),
            ("a-{}", "empty {}"),
            ("a-{{b}}", "names no column"),
            ("a-{b{c}}", "inside a brace"),
        ] {
            let e = KeyTemplate::parse("jobs", template)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{template:?}: {e}");
            assert!(e.starts_with("table \"jobs\""), "{e}");
        }
    }
}
