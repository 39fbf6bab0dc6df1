//! Memory the pager cannot page (a shared file mapping) registered as an
//! NP-RDMA MR: taken as a pinning NIC takes it — always resident — so a peer's
//! READs and WRITEs reach it one-sided, byte-exact, while the target's pager
//! swaps its other memory out; what peers wrote reaches the file.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use common::*;
use nprdma::Access;

const LEN: usize = 64 * 1024;

/// A shared mapping of a fresh (unlinked) file of `len` bytes.
struct FileMap {
    file: std::fs::File,
    addr: usize,
    len: usize,
}

impl FileMap {
    fn new(len: usize) -> FileMap {
        let path = std::env::temp_dir().join(format!("nprdma-foreign-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("temp file");
        std::fs::remove_file(&path).expect("unlink");
        file.set_len(len as u64).expect("size");
        // SAFETY: a fresh shared mapping of our own file; unmapped on drop.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(m, libc::MAP_FAILED);
        FileMap {
            file,
            addr: m as usize,
            len,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: our live mapping of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: our mapping; every MR over it is gone by now.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

#[test]
fn a_file_mapping_is_reached_one_sided_and_the_file_holds_what_peers_wrote() {
    let e = env_with_depth(16);
    let fm = FileMap::new(LEN);
    let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    // SAFETY: the mapping outlives the MR (declared before it, dropped after).
    let mr = unsafe { e.b.pd.reg_mr(fm.addr as u64, LEN as u64, acc) }.expect("reg_mr");
    let la = Buf::with(&e.a, LEN, Some(&pattern(1, LEN)));
    let other = Buf::with(&e.b, LEN, Some(&pattern(2, LEN)));
    let before = e.a.ctx.stats().two_sided;
    for round in 0..20u64 {
        // The target's pager swaps its managed memory out meanwhile; the file
        // mapping is not its to swap.
        other.swap_out();
        let off = (round * 3000) % (LEN as u64 - 8192);
        let len = 1 + (round as u32 * 977) % 8192;
        let w = nprdma::SendWr::new(
            2 * round,
            nprdma::Opcode::Write,
            Some(la.mr.sge(off, len)),
            fm.addr as u64 + off,
            mr.rkey(),
        );
        e.qa.post_send(&[w]).expect("post write");
        let c = wait1(&e.a.cq);
        assert_eq!((c.wr_id, c.status), (2 * round, 0));
        let (o, n) = (off as usize, len as usize);
        assert!(
            fm.bytes()[o..o + n] == la.bytes()[o..o + n],
            "WRITE round {round}"
        );
        let r = nprdma::SendWr::new(
            2 * round + 1,
            nprdma::Opcode::Read,
            Some(la.mr.sge(LEN as u64 / 2, len)),
            fm.addr as u64 + off,
            mr.rkey(),
        );
        e.qa.post_send(&[r]).expect("post read");
        let c = wait1(&e.a.cq);
        assert_eq!((c.wr_id, c.status), (2 * round + 1, 0));
        let h = LEN / 2;
        assert!(
            la.bytes()[h..h + n] == fm.bytes()[o..o + n],
            "READ round {round}"
        );
    }
    assert_eq!(
        e.a.ctx.stats().two_sided,
        before,
        "always resident: nothing went two-sided"
    );
    assert_eq!(e.b.ctx.nic_stats().nonresident_dma, 0);
    let want = fm.bytes().to_vec();
    drop(mr);
    // SAFETY: our mapping.
    let rc = unsafe { libc::msync(fm.addr as *mut libc::c_void, LEN, libc::MS_SYNC) };
    assert_eq!(rc, 0);
    let mut back = vec![0u8; LEN];
    fm.file.read_exact_at(&mut back, 0).expect("read the file");
    assert!(back == want, "the file holds what the peer wrote");
}
