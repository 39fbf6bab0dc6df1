//! Pager configuration.

use std::path::PathBuf;
use std::time::Duration;

/// Pages of one chunk of the zero reserve (2 MiB: a transparent huge page).
pub(crate) const RESERVE_CHUNK: usize = 512;

/// How a [`crate::Pager`] is set up. `Default` gives a 1 GiB unlinked temp swap
/// file read and written with O_DIRECT (like Linux swap: a major fault reads
/// the device, not the page cache), 15 swap I/O threads for concurrent
/// batches, no budget, a 50 µs spin window and a background evictor.
#[derive(Clone, Debug)]
pub struct PagerConfig {
    /// Swap file path; `None` = a file in the temp dir.
    pub swap_path: Option<PathBuf>,
    /// Swap file size in bytes (whole pages; sparse).
    pub swap_size: u64,
    /// Resident-page budget (the cgroup-limit role); `None` = unlimited.
    pub budget_pages: Option<usize>,
    /// Open the swap file with O_DIRECT (default). `false` = buffered swap
    /// through the page cache, labelled [`crate::SwapIo::Buffered`] in the
    /// stats. A filesystem refusing O_DIRECT gets a buffered file with a
    /// warning, labelled [`crate::SwapIo::BufferedFallback`].
    pub o_direct: bool,
    /// I/O threads for concurrent swap batches (a `pin`/`prefetch` bringing
    /// in several runs of swapped pages, the write-out of an eviction batch
    /// spanning several slot runs): up to `swap_io_threads + 1` transfers in
    /// flight, one of them in the calling thread. Started on first need,
    /// blocked while idle; 0 = batches run one transfer at a time. A single
    /// read (e.g. a fault) always happens in the calling thread.
    pub swap_io_threads: usize,
    /// Leave the swap file on disk (otherwise it is unlinked at creation).
    pub keep_swap_file: bool,
    /// Call `SwapListener::after_swap_in` whenever the pager brings a page in
    /// (fault, pin, prefetch; beyond Linux/the paper, which only notify
    /// swap-outs). A page is not evicted before its notification returned.
    pub eager_swap_in_notify: bool,
    /// Fault-around: a first-touch fault on a never-touched page zero-fills
    /// it and the never-touched pages after it in its region, up to this
    /// many pages (at most 32) in one ioctl, so a thread writing fresh
    /// memory in order takes one userfault per run instead of one per page
    /// (for anonymous memory Linux fills a whole 2 MiB transparent huge
    /// page on first touch; for files it maps up to `fault_around_bytes`,
    /// 64 KiB). The extra pages count as zero fills and against the budget.
    /// 0 or 1: off (the default).
    pub fault_around: usize,
    /// Sequential fault-around: while first-touch faults come in order (each
    /// at the page just after the previous run of one of the last few
    /// streams), the run doubles from `fault_around` up to this many pages
    /// (at most 512, 2 MiB — what Linux fills at once for anonymous memory
    /// with transparent huge pages), as Linux's readahead window grows; a
    /// fault elsewhere starts over at `fault_around`. Growth stops at an
    /// eighth of `budget_pages`. 0 (the default): no growth. A write
    /// stream at this longest run is also filled two runs ahead of its
    /// writer while the fault thread has nothing else to do.
    pub fault_around_max: usize,
    /// Zero reserve, in pages (rounded up to 2 MiB chunks; 0 = none, the
    /// default): pages the kernel allocated and zeroed ahead of need, on a
    /// background thread that blocks while the reserve is full. A run of at
    /// least 32 never-touched pages written for the first time (sequential
    /// fault-around, a pin of a range for writing) is moved into place from
    /// it with one `UFFDIO_MOVE` instead of being allocated and zeroed on the
    /// faulting thread. The reserve's pages are this process's memory (RSS)
    /// but not the budget's until they are moved into a region.
    pub zero_reserve: usize,
    /// How long the fault thread keeps polling without blocking after a fault.
    pub spin: Duration,
    /// Pages per eviction batch (also the staging-area size).
    pub evict_batch: usize,
    /// How far above `budget_pages` resident memory may go before a thread
    /// bringing pages in waits for the evictor (bounded: see
    /// `core/admit.rs`): the evictor's hysteresis, concurrent page-ins and
    /// fault-around runs use it. `None` (the default): an eighth of the
    /// budget, at least 16 and at most 4096 pages.
    pub budget_slack: Option<usize>,
    /// Run a background evictor thread that enforces the budget.
    pub background_evictor: bool,
}

impl PagerConfig {
    /// A zero reserve of `mib` MiB in pages (`zero_reserve`), at most a
    /// sixteenth of `budget_pages`: a pager that keeps little resident
    /// should not hold much of it zeroed in reserve. Under a budget the
    /// reserve is whole 2 MiB chunks (its unit, which a smaller reserve is
    /// rounded up to), so a budget under 32 MiB gets none: the reserve's
    /// memory never exceeds the sixteenth.
    pub fn zero_reserve_pages(mib: usize, budget_pages: Option<usize>) -> usize {
        let pages = mib.saturating_mul((1 << 20) / crate::PAGE_SIZE);
        budget_pages.map_or(pages, |b| pages.min(b / 16) / RESERVE_CHUNK * RESERVE_CHUNK)
    }
}

impl Default for PagerConfig {
    fn default() -> Self {
        PagerConfig {
            swap_path: None,
            swap_size: 1 << 30,
            budget_pages: None,
            o_direct: true,
            swap_io_threads: 15,
            keep_swap_file: false,
            eager_swap_in_notify: false,
            fault_around: 1,
            fault_around_max: 0,
            zero_reserve: 0,
            spin: Duration::from_micros(50),
            evict_batch: 64,
            budget_slack: None,
            background_evictor: true,
        }
    }
}
