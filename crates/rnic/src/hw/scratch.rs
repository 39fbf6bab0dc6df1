//! Per-thread reusable buffers for the DMA hot path (copy pieces, spans, iovecs): a
//! WR's bookkeeping reuses the thread's buffer instead of allocating per operation.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// A thread's reusable `Vec`, handed out empty by [`Scratch::take`] and given back
/// (capacity kept) when dropped. Nested takes of the same buffer are fine: the inner
/// one just gets a fresh `Vec`, and the larger of the two is kept.
pub(crate) struct Scratch<T: 'static> {
    v: Vec<T>,
    home: &'static LocalKey<Cell<Vec<T>>>,
}

/// Largest buffer kept between operations (elements); a bigger one is freed.
const KEEP_MAX: usize = 1024;

impl<T: 'static> Scratch<T> {
    pub fn take(home: &'static LocalKey<Cell<Vec<T>>>) -> Scratch<T> {
        let mut v = home.try_with(Cell::take).unwrap_or_default();
        v.clear();
        Scratch { v, home }
    }
}

impl<T: 'static> Deref for Scratch<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.v
    }
}

impl<T: 'static> DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.v
    }
}

impl<T: 'static> Drop for Scratch<T> {
    fn drop(&mut self) {
        if self.v.capacity() > KEEP_MAX {
            return;
        }
        let mut v = std::mem::take(&mut self.v);
        v.clear();
        // During thread teardown the slot may be gone already: then the Vec is freed.
        let _ = self.home.try_with(|c| {
            let old = c.take();
            c.set(if old.capacity() > v.capacity() { old } else { v });
        });
    }
}

/// Declare a thread-local scratch slot: `scratch_slot!(NAME: T);`.
macro_rules! scratch_slot {
    ($name:ident: $t:ty) => {
        thread_local! {
            static $name: std::cell::Cell<Vec<$t>> = const { std::cell::Cell::new(Vec::new()) };
        }
    };
}
pub(crate) use scratch_slot;

#[cfg(test)]
mod tests {
    use super::*;

    scratch_slot!(T: u32);

    #[test]
    fn reuses_capacity_and_nests() {
        let p = {
            let mut a = Scratch::take(&T);
            a.extend(0..100);
            a.as_ptr()
        };
        let mut a = Scratch::take(&T);
        assert!(a.is_empty(), "handed out empty");
        assert_eq!(a.as_ptr(), p, "same buffer again");
        a.push(1);
        let b = Scratch::take(&T);
        assert!(b.is_empty() && b.capacity() == 0, "nested take gets a fresh Vec");
        drop(b);
        drop(a);
        assert!(Scratch::take(&T).capacity() >= 100, "the larger buffer is kept");
        let mut big = Scratch::take(&T);
        big.reserve(KEEP_MAX + 1);
        drop(big);
        assert!(Scratch::take(&T).capacity() <= KEEP_MAX, "huge buffers are not kept");
    }
}
