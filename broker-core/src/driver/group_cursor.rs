//! Where the claims of a FIFO subscription start their visit of the groups.

use std::sync::Mutex;

/// Where the next claim of a FIFO subscription starts its visit of the groups: just after the
/// group its last claim took, so that the groups take turns.
///
/// A backend's FIFO claim walks the groups in the order of the group index (through the index,
/// one probe per group), from just after the cursor to the last group and then from the first
/// up to the cursor, and takes the heads it finds claimable. Several claims may read the cursor
/// at once; the group guard keeps them from taking one group twice, and the cursor only steers
/// where they start.
#[derive(Debug, Default)]
pub struct GroupCursor(Mutex<Option<String>>);

impl GroupCursor {
    /// The group to start after (`None`: from the first).
    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sets where the next claim starts (`None`: from the first group).
    pub fn set(&self, after: Option<String>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = after;
    }

    /// Moves past the groups taken by a claim that started after `from`: to the last of them in
    /// the claim's visiting order (the groups after `from` come first, then those from the
    /// first group on). Compares as bytes; a server whose collation orders some groups
    /// otherwise gets a cursor a little off, which changes which group goes next, never whether
    /// one is claimed. A claim that took no grouped row leaves the cursor.
    pub fn advance<'a>(&self, from: Option<&str>, took: impl IntoIterator<Item = &'a str>) {
        let (mut after, mut wrapped): (Option<&str>, Option<&str>) = (None, None);
        for g in took {
            let slot = match from {
                Some(f) if g <= f => &mut wrapped,
                _ => &mut after,
            };
            if slot.is_none_or(|s| g > s) {
                *slot = Some(g);
            }
        }
        if let Some(last) = wrapped.or(after) {
            self.set(Some(last.to_owned()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GroupCursor;

    #[test]
    fn the_cursor_moves_to_the_last_group_taken_in_visiting_order() {
        let c = GroupCursor::default();
        assert_eq!(c.get(), None);
        c.advance(None, ["b", "a", "c"]);
        assert_eq!(c.get().as_deref(), Some("c"));
        // From "c": "d" and "e" come first, then "a" and "b" after the wrap.
        c.advance(Some("c"), ["e", "a", "d", "b"]);
        assert_eq!(c.get().as_deref(), Some("b"));
        c.advance(Some("b"), ["d", "c"]);
        assert_eq!(c.get().as_deref(), Some("d"));
        c.advance(Some("d"), []);
        assert_eq!(
            c.get().as_deref(),
            Some("d"),
            "a claim without groups leaves it"
        );
    }
}
