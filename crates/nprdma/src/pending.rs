//! Table of outstanding two-sided requests of one QP, indexed by the
//! control-channel request id. Ids carry a generation, so a late or forged
//! response for a slot that was completed, flushed or reused is rejected
//! instead of completing the wrong operation. Entries own whatever the
//! request holds (pins as [`crate::nic::Pinned`] guards, the application
//! WR id, the ordering ticket): taking or draining an entry releases them
//! exactly once.

/// Bits of a request id that index the slot; the rest is the generation.
const INDEX_BITS: u32 = 16;
const INDEX_MASK: u32 = (1 << INDEX_BITS) - 1;

/// Errors of the request table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PendingError {
    /// All slots are in use (bounded by the QP depth).
    #[error("all {0} request slots are in use")]
    Full(usize),
    /// Capacity above the id space.
    #[error("capacity {0} exceeds {max}", max = 1u32 << INDEX_BITS)]
    TooLarge(usize),
}

/// Bounded table of outstanding requests.
#[derive(Debug)]
pub struct Pending<T> {
    slots: Vec<(u32, Option<T>)>,
    free: Vec<u32>,
    live: usize,
}

impl<T> Pending<T> {
    /// A table of `capacity` slots (≤ 65536).
    pub fn new(capacity: usize) -> Result<Self, PendingError> {
        if capacity > 1 << INDEX_BITS {
            return Err(PendingError::TooLarge(capacity));
        }
        Ok(Pending {
            slots: (0..capacity).map(|_| (0, None)).collect(),
            free: (0..capacity as u32).rev().collect(),
            live: 0,
        })
    }

    /// Outstanding requests.
    pub fn len(&self) -> usize {
        self.live
    }

    /// None outstanding.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Store `v`; returns its request id.
    pub fn insert(&mut self, v: T) -> Result<u32, PendingError> {
        let i = self
            .free
            .pop()
            .ok_or(PendingError::Full(self.slots.len()))?;
        let slot = &mut self.slots[i as usize];
        slot.0 = slot.0.wrapping_add(1) & (u32::MAX >> INDEX_BITS);
        slot.1 = Some(v);
        self.live += 1;
        Ok(slot.0 << INDEX_BITS | i)
    }

    fn slot_of(&self, id: u32) -> Option<usize> {
        let i = (id & INDEX_MASK) as usize;
        let (gen, v) = self.slots.get(i)?;
        (v.is_some() && *gen == id >> INDEX_BITS).then_some(i)
    }

    /// The request with this id, if outstanding.
    pub fn get(&self, id: u32) -> Option<&T> {
        self.slot_of(id).and_then(|i| self.slots[i].1.as_ref())
    }

    /// Mutable access to the request with this id.
    pub fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        let i = self.slot_of(id)?;
        self.slots[i].1.as_mut()
    }

    /// Remove and return the request (on its completion); `None` for an
    /// unknown, stale or already-completed id.
    pub fn take(&mut self, id: u32) -> Option<T> {
        let i = self.slot_of(id)?;
        let v = self.slots[i].1.take();
        self.free.push(i as u32);
        self.live -= 1;
        v
    }

    /// Drop the request with this id in place (what it holds is released
    /// as by [`Pending::take`], without moving it out). Whether it was
    /// outstanding.
    pub fn remove(&mut self, id: u32) -> bool {
        let Some(i) = self.slot_of(id) else {
            return false;
        };
        self.slots[i].1 = None;
        self.free.push(i as u32);
        self.live -= 1;
        true
    }

    /// Live entries with their ids.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, (gen, v))| v.as_ref().map(|v| (*gen << INDEX_BITS | i as u32, v)))
    }

    /// Live entries with their ids, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> + '_ {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, (gen, v))| v.as_mut().map(|v| (*gen << INDEX_BITS | i as u32, v)))
    }

    /// Remove every outstanding request (QP error / teardown), oldest slot
    /// order not guaranteed; the caller completes each with a flush status.
    pub fn drain(&mut self) -> Vec<(u32, T)> {
        let mut out = Vec::with_capacity(self.live);
        for (i, (gen, v)) in self.slots.iter_mut().enumerate() {
            if let Some(v) = v.take() {
                out.push((*gen << INDEX_BITS | i as u32, v));
                self.free.push(i as u32);
            }
        }
        self.live = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn ids_are_checked_and_slots_reused_with_new_generation() {
        let mut p = Pending::new(2).unwrap();
        let a = p.insert("a").unwrap();
        let b = p.insert("b").unwrap();
        assert_eq!(p.insert("c"), Err(PendingError::Full(2)));
        assert_eq!(p.get(a), Some(&"a"));
        assert_eq!(p.take(a), Some("a"));
        assert_eq!(p.take(a), None, "double completion");
        let c = p.insert("c").unwrap();
        assert_eq!(c & INDEX_MASK, a & INDEX_MASK, "slot reused");
        assert_ne!(c, a);
        assert_eq!(
            p.take(a),
            None,
            "stale id must not complete the new request"
        );
        assert_eq!(p.get(0xffff_ffff), None);
        *p.get_mut(b).unwrap() = "B";
        let mut d = p.drain();
        d.sort();
        assert_eq!(d.iter().map(|x| x.1).collect::<Vec<_>>(), vec!["B", "c"]);
        assert!(p.is_empty());
        assert_eq!(p.take(b), None);
        assert!(Pending::<()>::new(1 << 17).is_err());
    }

    #[test]
    fn entries_are_dropped_exactly_once() {
        use std::rc::Rc;
        let token = Rc::new(());
        let mut p = Pending::new(4).unwrap();
        let ids: Vec<_> = (0..4).map(|_| p.insert(token.clone()).unwrap()).collect();
        assert_eq!(Rc::strong_count(&token), 5);
        drop(p.take(ids[1]));
        drop(p.drain());
        assert_eq!(Rc::strong_count(&token), 1);
    }

    proptest! {
        #[test]
        fn behaves_like_a_map(ops in prop::collection::vec((any::<bool>(), any::<u32>()), 1..300)) {
            let mut p = Pending::new(8).unwrap();
            let mut model: HashMap<u32, u32> = HashMap::new();
            let mut issued: Vec<u32> = Vec::new();
            for (ins, x) in ops {
                if ins {
                    match p.insert(x) {
                        Ok(id) => {
                            prop_assert!(model.insert(id, x).is_none(), "id reused while live");
                            issued.push(id);
                        }
                        Err(_) => prop_assert_eq!(model.len(), 8),
                    }
                } else {
                    // Complete a previously issued (maybe stale) or random id.
                    let id = if issued.is_empty() || x % 4 == 0 { x } else { issued[x as usize % issued.len()] };
                    prop_assert_eq!(p.take(id), model.remove(&id));
                }
                prop_assert_eq!(p.len(), model.len());
            }
        }
    }
}
