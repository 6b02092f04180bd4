//! What this process shares per database file: the advisory key table and the turn to write.
//!
//! SQLite has no advisory locks, so keys are held in this process, one table per database file.
//! Two processes on one file do not see each other's keys, so a row can then be delivered twice
//! (see the crate docs).
//!
//! SQLite has one writer per file. Writers of this process take turns in a fair in-process queue
//! instead of meeting in SQLite's busy handler, which sleeps and retries (up to tens of
//! milliseconds a try) while another connection writes. Other processes on the file still meet
//! in the busy handler.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// This process's turn to write to a database file, held as long as the guard lives.
pub(crate) type WriteTurn<'a> = tokio::sync::MutexGuard<'a, ()>;

/// The keys held in one database file, and the turn to write to it.
#[derive(Debug, Default)]
pub(crate) struct KeyTable {
    held: Mutex<HashSet<String>>,
    writes: tokio::sync::Mutex<()>,
}

impl KeyTable {
    /// The key table of a database file: its canonical path, or an in-memory database's name.
    /// Every broker of this process on the same file shares it.
    pub(crate) fn for_file(filename: &Path) -> Arc<KeyTable> {
        static TABLES: OnceLock<Mutex<HashMap<PathBuf, Weak<KeyTable>>>> = OnceLock::new();
        let id = std::fs::canonicalize(filename).unwrap_or_else(|_| filename.to_path_buf());
        let mut tables = TABLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        tables.retain(|_, t| t.strong_count() > 0);
        if let Some(t) = tables.get(&id).and_then(Weak::upgrade) {
            return t;
        }
        let t = Arc::new(KeyTable::default());
        tables.insert(id, Arc::downgrade(&t));
        t
    }

    /// Waits for this process's turn to write to the file; the turn lasts as long as the guard.
    /// Take the connection to write on first (see [`write_conn`](crate::backend::write_conn)).
    pub(crate) async fn write_turn(&self) -> WriteTurn<'_> {
        self.writes.lock().await
    }

    /// Takes `key` without waiting; `None` when it is held.
    pub(crate) fn try_lock(self: &Arc<Self>, key: &str) -> Option<KeyLock> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.insert(key.to_owned()).then(|| KeyLock {
            table: self.clone(),
            key: key.to_owned(),
        })
    }

    /// Whether `key` is held now.
    pub(crate) fn is_held(&self, key: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(key)
    }

    /// The keys held now.
    pub(crate) fn held(&self) -> Vec<String> {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// How many keys are held now.
    pub(crate) fn len(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// A held key; dropping it frees the key.
#[derive(Debug)]
pub struct KeyLock {
    table: Arc<KeyTable>,
    key: String,
}

impl KeyLock {
    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Drop for KeyLock {
    fn drop(&mut self) {
        self.table
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_held_once_per_file_until_dropped() {
        let a = KeyTable::for_file(Path::new(":memory:keys-test"));
        let b = KeyTable::for_file(Path::new(":memory:keys-test"));
        let other = KeyTable::for_file(Path::new(":memory:keys-other"));
        let lock = a.try_lock("k").unwrap();
        assert!(b.try_lock("k").is_none());
        assert!(other.try_lock("k").is_some());
        drop(lock);
        assert!(b.try_lock("k").is_some());
    }
}
