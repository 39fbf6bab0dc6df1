//! NP-RDMA's own state per registered page stays within the paper's 12 B (two
//! IOMMU entries and a version): a whole `Pd::reg_mr` is measured as the live
//! heap bytes it adds on the registering thread (a counting allocator: exact,
//! not RSS; other threads' allocations are not counted) plus the IOMMU
//! entries of the IOVA pages it takes, per page, as the slope between two MR
//! sizes (so per-MR constants cancel). The pager's own per-page state is
//! allocated when its region is made, before the measured window; the NIC
//! model's 1-bit residency map (the OS's role) is in the device segment, not
//! counted here.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use nprdma::{Access, Config, Context, Pd};

/// Counts, per thread, the bytes it allocated minus the bytes it freed.
struct Counting;

thread_local! {
    // Const-initialised, no destructor: using it never allocates.
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    let _ = LIVE.try_with(|c| c.set(c.get() + delta));
}

/// This thread's count.
fn live() -> isize {
    LIVE.with(|c| c.get())
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counter is only bookkeeping.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(p, l) };
        count(-(l.size() as isize));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            count(new as isize - l.size() as isize);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const PS: usize = vmem::PAGE_SIZE;

fn access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE
}

/// First free IOVA page of `host` (the allocator is first-fit).
fn iova_next(host: &rnic::Host) -> u64 {
    let r = host.iommu().alloc_range(1).expect("probe range");
    let base = r.base;
    host.iommu().free_range(r).expect("free probe");
    base
}

/// NP-RDMA's own bytes for one registration of `pages` pages (never touched,
/// or every page resident first): heap added by `reg_mr` + IOMMU entries.
fn reg_bytes(
    host: &rnic::Host,
    pager: &vmem::Pager,
    pd: &Pd,
    pages: usize,
    touched: bool,
) -> isize {
    let mut region = pager.alloc(pages * PS).expect("region");
    if touched {
        for p in region.as_mut_slice().chunks_mut(PS) {
            p[0] = 1;
        }
    }
    let iova0 = iova_next(host);
    let heap0 = live();
    // SAFETY: the region is private anonymous memory that outlives the MR
    // (dropped first, below).
    #[allow(unsafe_code)]
    let mr =
        unsafe { pd.reg_mr(region.addr() as u64, (pages * PS) as u64, access()) }.expect("reg_mr");
    let heap = live() - heap0;
    let iova = (iova_next(host) - iova0) as isize;
    drop(mr);
    drop(region);
    heap + iova * rnic::Iommu::ENTRY_BYTES as isize
}

/// Bytes per page: the slope between `n` and `2n` pages, the median of three
/// tries.
fn per_page(host: &rnic::Host, pager: &vmem::Pager, pd: &Pd, n: usize, touched: bool) -> f64 {
    let mut v: Vec<f64> = (0..3)
        .map(|_| {
            let small = reg_bytes(host, pager, pd, n, touched);
            let big = reg_bytes(host, pager, pd, 2 * n, touched);
            (big - small) as f64 / n as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[1]
}

#[test]
fn nprdma_state_per_registered_page_is_at_most_12_bytes() {
    let host = rnic::Host::new(rnic::HostConfig::default()).expect("host");
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 64 << 20,
        ..vmem::PagerConfig::default()
    })
    .expect("pager");
    let ctx = Context::new(&host, &pager, Config::default()).expect("context");
    let pd = ctx.alloc_pd();
    // First registration: per-context set-up, not per page.
    let _ = reg_bytes(&host, &pager, &pd, 1, false);
    let n = 16384;
    let untouched = per_page(&host, &pager, &pd, n, false);
    let resident = per_page(&host, &pager, &pd, n, true);
    let model = nprdma::shadow::STATE_BYTES_PER_PAGE as f64;
    eprintln!("NP-RDMA state per page: never-touched {untouched:.3} B, resident {resident:.3} B, by construction {model} B");
    // A per-page byte anywhere (a bool table) would add 1 B, a bitmap 0.125 B.
    let slack = 0.05;
    for (what, b) in [("never-touched", untouched), ("resident", resident)] {
        assert!(
            b <= 12.0 + slack,
            "{what} pages: NP-RDMA keeps {b:.3} B per registered page, the paper's budget is 12 B"
        );
        assert!(
            (b - model).abs() <= slack,
            "{what} pages: measured {b:.3} B per page, the tables' element sizes say {model} B"
        );
    }
}
