//! Inline-first copies of small slices (a send WR's gather list and inline payload):
//! up to `N` elements live in the value itself, so posting a WR does not allocate.

use std::ops::Deref;

/// A copy of a slice; at most `N` elements are stored inline, longer ones on the heap.
#[derive(Clone, Debug)]
pub(crate) enum Small<T: Copy + Default, const N: usize> {
    Inline(u8, [T; N]),
    Heap(Vec<T>),
}

impl<T: Copy + Default, const N: usize> Small<T, N> {
    pub fn new() -> Self {
        Small::Inline(0, [T::default(); N])
    }
    pub fn from_slice(s: &[T]) -> Self {
        if s.len() <= N && N <= u8::MAX as usize {
            let mut a = [T::default(); N];
            a[..s.len()].copy_from_slice(s);
            Small::Inline(s.len() as u8, a)
        } else {
            Small::Heap(s.to_vec())
        }
    }
}

impl<T: Copy + Default, const N: usize> Deref for Small<T, N> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Small::Inline(n, a) => &a[..*n as usize],
            Small::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_up_to_n_heap_beyond() {
        let s: Small<u32, 4> = Small::from_slice(&[1, 2, 3]);
        assert!(matches!(s, Small::Inline(3, _)));
        assert_eq!(&*s, &[1, 2, 3]);
        let s: Small<u32, 4> = Small::from_slice(&[1, 2, 3, 4, 5]);
        assert!(matches!(s, Small::Heap(_)));
        assert_eq!(&*s, &[1, 2, 3, 4, 5]);
        let e: Small<u32, 4> = Small::new();
        assert!(e.is_empty());
        assert_eq!(&*Small::<u8, 4>::from_slice(&[]), &[] as &[u8]);
    }
}
