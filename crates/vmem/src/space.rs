//! The managed address space: disjoint page segments with registration
//! reference counts (overlapping registrations share page state), and the
//! table of live registrations.

use crate::state::PageArray;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A run of pages `[start, end)` (page numbers) registered `refs` times, viewing
/// part of a shared [`PageArray`].
#[derive(Clone)]
pub struct Segment {
    pub start: usize,
    pub end: usize,
    pub arr: Arc<PageArray>,
    pub refs: usize,
}

/// Identifier of one registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// What one registration covers.
#[derive(Clone, Copy, Debug)]
pub struct RegInfo {
    pub p0: usize,
    pub p1: usize,
    /// The pager created this mapping (alloc) and unmaps it on unregister.
    pub owned: bool,
}

#[derive(Default)]
pub struct Space {
    segs: BTreeMap<usize, Segment>,
    pub regs: HashMap<RegionId, RegInfo>,
    next_id: u64,
}

impl Space {
    pub fn new_id(&mut self) -> RegionId {
        self.next_id += 1;
        RegionId(self.next_id)
    }

    /// The segment containing page `p`.
    #[inline]
    pub fn lookup(&self, p: usize) -> Option<&Segment> {
        self.segs
            .range(..=p)
            .next_back()
            .map(|(_, s)| s)
            .filter(|s| p < s.end)
    }

    /// Splits the segment containing `p` (if any) so that a segment starts at `p`.
    pub fn split_at(&mut self, p: usize) {
        let Some(s) = self.lookup(p).cloned() else {
            return;
        };
        if s.start == p {
            return;
        }
        let mut left = s.clone();
        left.end = p;
        let mut right = s;
        right.start = p;
        self.segs.insert(left.start, left);
        self.segs.insert(right.start, right);
    }

    /// Segments overlapping `[p0, p1)` in address order.
    pub fn overlapping(&self, p0: usize, p1: usize) -> Vec<Segment> {
        let mut out = Vec::new();
        if let Some(s) = self.lookup(p0) {
            out.push(s.clone());
        }
        for (_, s) in self.segs.range(p0 + 1..p1) {
            out.push(s.clone());
        }
        out
    }

    /// Gaps (unregistered page runs) of `[p0, p1)`.
    pub fn gaps(&self, p0: usize, p1: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut cur = p0;
        for s in self.overlapping(p0, p1) {
            if s.start > cur {
                out.push((cur, s.start));
            }
            cur = cur.max(s.end);
        }
        if cur < p1 {
            out.push((cur, p1));
        }
        out
    }

    pub fn insert(&mut self, s: Segment) {
        self.segs.insert(s.start, s);
    }

    /// Adds `delta` (+1/-1) to the refcount of every segment in `[p0, p1)`
    /// (which must start/end on segment boundaries) and returns the segments
    /// whose count dropped to zero (removed from the map).
    pub fn add_refs(&mut self, p0: usize, p1: usize, delta: isize) -> Vec<Segment> {
        let mut dead = Vec::new();
        let keys: Vec<usize> = self.segs.range(p0..p1).map(|(k, _)| *k).collect();
        for k in keys {
            let s = self.segs.get_mut(&k).expect("key just listed");
            s.refs = (s.refs as isize + delta) as usize;
            if s.refs == 0 {
                dead.push(self.segs.remove(&k).expect("present"));
            }
        }
        dead
    }

    /// All segments (for the eviction scan and shutdown).
    pub fn all(&self) -> impl Iterator<Item = &Segment> {
        self.segs.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(a: usize, b: usize) -> Segment {
        Segment {
            start: a,
            end: b,
            arr: Arc::new(PageArray::new(a, b - a, |_| 0, false)),
            refs: 1,
        }
    }

    #[test]
    fn split_gaps_refs() {
        let mut s = Space::default();
        s.insert(seg(10, 20));
        assert_eq!(s.gaps(5, 25), vec![(5, 10), (20, 25)]);
        s.split_at(15);
        s.split_at(15);
        assert_eq!(s.overlapping(0, 100).len(), 2);
        assert!(s.lookup(14).is_some_and(|x| x.start == 10 && x.end == 15));
        assert!(s.lookup(15).is_some_and(|x| x.start == 15 && x.end == 20));
        assert!(s.lookup(20).is_none());
        assert!(s.add_refs(15, 20, 1).is_empty());
        let dead = s.add_refs(10, 20, -1);
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].start, 10);
        assert!(s.lookup(12).is_none());
        assert!(s.lookup(17).is_some());
    }
}
