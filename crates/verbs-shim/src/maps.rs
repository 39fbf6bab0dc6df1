//! The process's own memory map (`/proc/self/maps`): whether a range is all
//! mapped writable — what a NIC's registration checks before it takes memory
//! for writing (`ib_umem_get` pins with FOLL_WRITE and fails with EFAULT).

/// Whether every byte of `[addr, addr + len)` lies in mappings with write
/// permission; `None` if the map cannot be read (the caller then does not check).
pub(crate) fn all_writable(addr: usize, len: usize) -> Option<bool> {
    let text = std::fs::read_to_string("/proc/self/maps").ok()?;
    Some(writable_in(&text, addr, addr.checked_add(len)?))
}

/// [`all_writable`] over the text of a maps file (lines in address order).
fn writable_in(maps: &str, start: usize, end: usize) -> bool {
    let mut at = start;
    for line in maps.lines() {
        if at >= end {
            break;
        }
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        if b <= at {
            continue;
        }
        if a > at || !perms.starts_with("rw") {
            // A hole before the next mapping, or a mapping without write access.
            return false;
        }
        at = b;
    }
    at >= end
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 r--p 00000000 00:00 0
4000-6000 rw-s 00000000 00:05 7 /dev/zero (deleted)
7000-8000 rw-p 00000000 00:00 0  [stack]
";

    #[test]
    fn ranges_are_judged_by_every_mapping_they_touch() {
        assert!(writable_in(MAPS, 0x1000, 0x3000));
        assert!(writable_in(MAPS, 0x1800, 0x1801));
        assert!(
            !writable_in(MAPS, 0x2fff, 0x3001),
            "spans a read-only mapping"
        );
        assert!(!writable_in(MAPS, 0x3000, 0x3001), "read-only");
        assert!(writable_in(MAPS, 0x4000, 0x6000), "shared writable");
        assert!(!writable_in(MAPS, 0x5000, 0x7001), "spans a hole");
        assert!(!writable_in(MAPS, 0x8000, 0x8001), "past every mapping");
        assert!(!writable_in(MAPS, 0x100, 0x200), "before every mapping");
    }

    #[test]
    fn the_process_own_heap_is_writable_and_its_code_is_not() {
        let v = vec![0u8; 10000];
        assert_eq!(all_writable(v.as_ptr() as usize, v.len()), Some(true));
        let code = ranges_are_judged_by_every_mapping_they_touch as *const () as usize;
        assert_eq!(all_writable(code, 16), Some(false));
    }
}
