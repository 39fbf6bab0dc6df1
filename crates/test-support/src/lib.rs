//! Dev-only helpers shared by the integration tests of the NP-RDMA engine
//! over any backend: `nprdma`'s own tests (the software RNIC) and
//! `ibverbs-nic`'s (a libibverbs device). A crate of its own, used only as a
//! dev-dependency, so that neither crate's tests reach into the other's
//! source tree and neither library carries test code.
//!
//! A tower of six files: [`skip`] (the one rule for a test whose
//! prerequisite is missing: it fails under `NPRDMA_REQUIRE_ALL=1`, as in CI,
//! and otherwise skips, saying so), [`cdylib`] (building the project's
//! libnprdma.so for tests that load it), [`child`] (the child-process peer
//! harness), this file (buffers and data patterns, generic over the
//! backend), [`chaos`] (the randomized chaos test over any backend, built on
//! the buffers), then [`xchaos`] (the same across processes, built on all
//! three).

pub mod cdylib;
pub mod chaos;
pub mod child;
pub mod skip;
pub mod xchaos;

use std::time::Duration;

use nprdma::engine::Backend;
use nprdma::{Access, Completion, Cq, Mr, Pd};

/// Where a test's buffers come from: a pager and a PD of one engine context.
pub trait Mem<N: Backend> {
    /// The context's pager.
    fn pager(&self) -> &vmem::Pager;
    /// The PD the buffers are registered in.
    fn pd(&self) -> &Pd<N>;
}

/// Pager-managed memory registered as an NP-RDMA MR with local write and all
/// remote rights. The MR is dropped before the region (field order).
pub struct Buf<N: Backend> {
    /// The registration.
    pub mr: Mr<N>,
    /// The memory.
    pub region: vmem::Region,
}

impl<N: Backend> Buf<N> {
    /// An untouched (never faulted) buffer of `len` bytes.
    pub fn new(s: &impl Mem<N>, len: usize) -> Self {
        Self::with(s, len, None)
    }

    /// A buffer holding `data` before registration (resident pages start
    /// mapped), or untouched if `None`.
    pub fn with(s: &impl Mem<N>, len: usize, data: Option<&[u8]>) -> Self {
        let mut region = s.pager().alloc(len).expect("alloc");
        if let Some(d) = data {
            region.as_mut_slice()[..d.len()].copy_from_slice(d);
        }
        let acc = Access::LOCAL_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_WRITE
            | Access::REMOTE_ATOMIC;
        // SAFETY: the region is private anonymous pager memory; `Buf` drops
        // the MR before the region (field order).
        #[allow(unsafe_code)]
        let mr = unsafe { s.pd().reg_mr(region.addr() as u64, len as u64, acc) }.expect("reg_mr");
        Buf { mr, region }
    }

    /// The buffer's address.
    pub fn addr(&self) -> u64 {
        self.region.addr() as u64
    }

    /// The registered bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.region.as_slice()[..self.mr.len() as usize]
    }

    /// The registered bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.mr.len() as usize;
        &mut self.region.as_mut_slice()[..n]
    }

    /// Have the pager swap the whole buffer out.
    pub fn swap_out(&self) {
        self.region.swap_out().expect("swap out");
    }
}

/// Swap out every page of `ranges` (`(addr, len)`) and return how many stay
/// resident — pinned. Pins an engine takes for a bounded time (user-space
/// mode's leases, `Config::lease_ms`) are waited out for up to a second.
pub fn resident_after_swap_out(pager: &vmem::Pager, ranges: &[(usize, usize)]) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    loop {
        let mut left = 0;
        for &(addr, len) in ranges {
            pager.swap_out(addr, len).expect("swap out");
            left += pager.resident_count(addr, len).expect("resident count");
        }
        if left == 0 || std::time::Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Wait for exactly one completion on `cq` (panics after 10 s).
pub fn wait1<N: Backend>(cq: &Cq<N>) -> Completion {
    let v = cq.poll_wait(1, Duration::from_secs(10));
    assert_eq!(v.len(), 1, "no completion within 10 s");
    v[0]
}

/// `len` pseudo-random bytes of seed `seed` (xorshift: the same bytes for
/// the same seed in every process).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A child's answer to one line `w` (split into words) of the cross-process
/// tests' inspection protocol about its `region`: `check <off> <len> <seed>`
/// (`ok` if the bytes at `off` are [`pattern`]`(seed, len)`, else `bad`),
/// `u64 <off>` (the little-endian word there), `swap` (the pager swaps the
/// region out: `swapped`); `None` for any other line.
pub fn inspect(region: &vmem::Region, w: &[&str]) -> Option<String> {
    let num = |i: usize| -> usize { w[i].parse().unwrap() };
    Some(match w {
        ["check", _, _, _] => {
            let (off, len) = (num(1), num(2));
            let ok = region.as_slice()[off..off + len] == pattern(num(3) as u64, len)[..];
            (if ok { "ok" } else { "bad" }).to_string()
        }
        ["u64", _] => {
            let off = num(1);
            u64::from_le_bytes(region.as_slice()[off..off + 8].try_into().unwrap()).to_string()
        }
        ["swap"] => {
            region.swap_out().expect("swap out");
            "swapped".to_string()
        }
        _ => return None,
    })
}

/// The child side of the inspection protocol: [`inspect`] each line of
/// `lines` and [`child::say`] the answer, until a line it does not know or
/// the end.
pub fn serve_checks(lines: impl Iterator<Item = std::io::Result<String>>, region: &vmem::Region) {
    let mut out = std::io::stdout();
    for l in lines {
        let l = l.unwrap();
        let w: Vec<&str> = l.split_whitespace().collect();
        match inspect(region, &w) {
            Some(a) => child::say(&mut out, &a),
            None => break,
        }
    }
}
