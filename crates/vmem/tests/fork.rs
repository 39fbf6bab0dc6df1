//! fork() with managed memory: the child of a process whose pager swapped
//! pages out reads the parent's contents (swapped-out pages from swap, resident
//! ones as the kernel copies them, never-touched ones as zeroes), while the
//! parent goes on at once — swapping pages in and out, reusing no slot the
//! child may still read — with its memory unchanged.

mod common;
use common::*;
use vmem::{Pager, PAGE_SIZE as PG};

#[test]
fn a_forked_child_reads_what_the_parent_wrote_swapped_out_pages_included() {
    with_timeout(60, || {
        let p = Pager::new(small_cfg()).unwrap();
        const N: usize = 2048;
        let mut r = p.alloc(N * PG).unwrap();
        let written = 1536 * PG;
        for (i, b) in r.as_mut_slice()[..written].iter_mut().enumerate() {
            *b = pat(7, i);
        }
        // Pages 0..1024 swapped out, 1024..1536 resident, the rest never touched.
        assert_eq!(p.swap_out(r.addr(), 1024 * PG).unwrap(), 1024);
        assert!(!p.is_resident(r.addr()) && p.is_resident(r.addr() + 1200 * PG));
        // SAFETY: the child only reads memory and calls _exit.
        #[allow(unsafe_code)]
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            let s = r.as_slice();
            let bad = (0..N * PG)
                .filter(|&i| s[i] != if i < written { pat(7, i) } else { 0 })
                .count();
            // SAFETY: leaving the child without running the parent's destructors.
            #[allow(unsafe_code)]
            unsafe {
                libc::_exit(if bad == 0 { 0 } else { 1 })
            };
        }
        // The parent goes on meanwhile: the swapped-out pages come back (their
        // slots freed) and the resident ones go out (slots allocated low-first,
        // where the freed ones are): none may land in a slot the child reads.
        assert_eq!(p.prefetch(r.addr(), 1024 * PG).unwrap(), 1024);
        assert_eq!(p.swap_out(r.addr() + 1024 * PG, 512 * PG).unwrap(), 512);
        let mut st = 0;
        // SAFETY: waiting for our own child.
        #[allow(unsafe_code)]
        let w = unsafe { libc::waitpid(pid, &mut st, 0) };
        assert_eq!(w, pid);
        assert!(
            libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
            "the child read other bytes than the parent wrote (status {st:#x})"
        );
        // After the fork the parent's pages are shared (copy-on-write) with the
        // child: its evictor still moves them out.
        assert!(p.swap_out(r.addr(), 256 * PG).unwrap() > 0);
        let s = r.as_slice();
        assert!((0..written).all(|i| s[i] == pat(7, i)));
        assert!(s[written..].iter().all(|&b| b == 0));
    });
}
