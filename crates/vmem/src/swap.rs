//! The swap device: a swap file of page-sized slots, a slot allocator, page
//! reads/writes (O_DIRECT by default, buffered on request or as a labelled
//! fallback), concurrent batches, and the device's own read-latency baseline.

use crate::error::{Error, Result};
use crate::mm::{PageBuf, PAGE};
use crate::swap_io::{IoOp, IoPool};
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Slot index in the swap file.
pub type Slot = u32;

struct SlotAlloc {
    bits: Vec<u64>,
    free: usize,
    cursor: usize,
}

impl SlotAlloc {
    fn new(slots: usize) -> SlotAlloc {
        let mut bits = vec![0u64; slots.div_ceil(64)];
        // Mark the tail beyond `slots` as used so it is never handed out.
        for s in slots..bits.len() * 64 {
            bits[s / 64] |= 1 << (s % 64);
        }
        SlotAlloc {
            bits,
            free: slots,
            cursor: 0,
        }
    }

    /// Next-fit allocation of one slot.
    fn alloc(&mut self) -> Option<Slot> {
        if self.free == 0 {
            return None;
        }
        let words = self.bits.len();
        let (start_w, start_b) = (self.cursor / 64, self.cursor % 64);
        for i in 0..=words {
            let idx = (start_w + i) % words;
            let mut avail = !self.bits[idx];
            if i == 0 {
                avail &= !0u64 << start_b;
            }
            if avail != 0 {
                let bit = avail.trailing_zeros() as usize;
                self.bits[idx] |= 1 << bit;
                self.free -= 1;
                let slot = idx * 64 + bit;
                self.cursor = if slot + 1 >= words * 64 { 0 } else { slot + 1 };
                return Some(slot as Slot);
            }
        }
        None
    }

    fn release(&mut self, slot: Slot) -> bool {
        let s = slot as usize;
        let (w, b) = (s / 64, s % 64);
        if w >= self.bits.len() || self.bits[w] & (1 << b) == 0 {
            return false;
        }
        self.bits[w] &= !(1 << b);
        self.free += 1;
        // Reuse low slots first: a compact file (and with buffered swap the
        // slots are likely still in the page cache: write-out is a copy).
        self.cursor = self.cursor.min(s);
        true
    }
}

/// How the swap file is read and written (reports label major faults with it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SwapIo {
    /// O_DIRECT: swap-ins read the device, swap-outs write it (no page cache),
    /// like Linux swap.
    #[default]
    Direct,
    /// Buffered, as configured (`PagerConfig::o_direct = false`): swap I/O
    /// goes through the page cache, so a swap-in may be a memory copy.
    Buffered,
    /// Buffered because the filesystem refused O_DIRECT (EINVAL), although
    /// O_DIRECT was asked for.
    BufferedFallback,
    /// O_DIRECT was accepted, but the swap file lives on a memory filesystem
    /// (tmpfs, ramfs): there is no device behind it.
    MemoryFs,
}

impl SwapIo {
    /// A short label for reports.
    pub fn label(self) -> &'static str {
        match self {
            SwapIo::Direct => "O_DIRECT",
            SwapIo::Buffered => "buffered (page cache)",
            SwapIo::BufferedFallback => "buffered (O_DIRECT refused by the filesystem)",
            SwapIo::MemoryFs => "memory filesystem (no device)",
        }
    }
    /// Whether the swap file was opened with O_DIRECT.
    pub fn is_direct(self) -> bool {
        matches!(self, SwapIo::Direct | SwapIo::MemoryFs)
    }
}

/// A swap file with page-sized slots.
pub struct SwapDevice {
    file: Arc<File>,
    io: SwapIo,
    pool: IoPool,
    path: PathBuf,
    remove_on_drop: bool,
    slots: usize,
    alloc: Mutex<SlotAlloc>,
    used: AtomicUsize,
    cache: Mutex<SwapCache>,
    /// Entries in `cache` (lets `read`/`free` skip its lock when empty).
    cached: AtomicUsize,
    cache_hits: AtomicU64,
    /// Fault injection (`Pager::inject_swap_write_failures`): fail every write.
    pub fail_writes: std::sync::atomic::AtomicBool,
    /// Forked children still reading slots (see [`SwapDevice::hold_for_child`]).
    held: std::sync::atomic::AtomicBool,
    hold: Mutex<ForkHold>,
}

/// Slots kept from reuse while forked children read them: the read ends of
/// their pipes (readable — at EOF — once a child is done) and the slots freed
/// meanwhile, released when every child is done.
#[derive(Default)]
struct ForkHold {
    children: Vec<std::os::fd::OwnedFd>,
    freed: Vec<Slot>,
}

/// Pages kept by the swap cache.
const CACHE_PAGES: usize = 64;

/// Pages read for [`SwapDevice::read_keep`] (a swapped page's bytes served
/// without bringing it in: `Pager::read_swapped`), kept like Linux's swap
/// cache until the page is read again (its swap-in, which then costs no
/// second device read) or its slot is freed. A slot's content never changes
/// while it is allocated (only freshly allocated slots are written), so an
/// entry is exact for as long as it lives; the oldest entry makes room.
struct SwapCache {
    tags: Vec<Option<Slot>>,
    pages: PageBuf,
    next: usize,
}

impl SwapCache {
    fn new() -> SwapCache {
        SwapCache {
            tags: vec![None; CACHE_PAGES],
            pages: PageBuf::new(CACHE_PAGES),
            next: 0,
        }
    }
    fn page(&mut self, i: usize) -> &mut [u8] {
        &mut self.pages.as_mut_slice()[i * PAGE..(i + 1) * PAGE]
    }
}

static SWAP_SEQ: AtomicUsize = AtomicUsize::new(0);

#[cfg(test)]
thread_local! {
    /// Test hook: make opening with O_DIRECT fail with EINVAL in this thread
    /// (what filesystems without O_DIRECT support answer).
    pub static REFUSE_O_DIRECT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A few bits that differ between processes that share a PID (in other PID
/// namespaces) and a temporary directory: the clock and this process's addresses.
fn name_salt() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let a = &t as *const u64 as u64;
    let x = (t ^ a.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x >> 32) as u32
}

/// How [`open_swap`] opens the file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    /// Create it; it must not exist.
    New,
    /// Create it or empty it.
    Reset,
    /// Open it as it is.
    Again,
}

/// Open the swap file at `path` (see [`Open`]).
fn open_swap(path: &Path, direct: bool, how: Open) -> io::Result<File> {
    #[cfg(test)]
    if direct && REFUSE_O_DIRECT.with(|r| r.get()) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut oo = OpenOptions::new();
    oo.read(true).write(true);
    match how {
        Open::New => {
            oo.create_new(true);
        }
        Open::Reset => {
            oo.create(true).truncate(true);
        }
        Open::Again => {}
    }
    if direct {
        oo.custom_flags(libc::O_DIRECT);
    }
    oo.open(path)
}

/// Whether `file` lives on a memory filesystem (tmpfs, ramfs).
fn on_memory_fs(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    let Ok(st) = rustix::fs::fstatfs(file) else {
        return false;
    };
    let t = st.f_type;
    t == TMPFS_MAGIC || t == RAMFS_MAGIC
}

fn is_einval(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

impl SwapDevice {
    /// Creates (truncates) the swap file. Unless `keep`, the file is unlinked
    /// right away so that nothing is left behind, even after a crash. With
    /// `o_direct`, a filesystem that refuses O_DIRECT (EINVAL, at open or at
    /// the first read) gets a buffered file, with a warning, and
    /// [`SwapDevice::io`] says so. No I/O threads (see [`Self::create_with`]).
    #[cfg(test)]
    pub fn create(
        path: Option<&Path>,
        size: u64,
        o_direct: bool,
        keep: bool,
    ) -> Result<SwapDevice> {
        Self::create_with(path, size, o_direct, keep, 0)
    }

    /// [`Self::create`] with `io_threads` I/O threads for concurrent batches.
    pub fn create_with(
        path: Option<&Path>,
        size: u64,
        o_direct: bool,
        keep: bool,
        io_threads: usize,
    ) -> Result<SwapDevice> {
        let slots = (size / PAGE as u64) as usize;
        if slots == 0 || slots > u32::MAX as usize - 1 {
            return Err(Error::Config(format!(
                "swap_size {size} must be 1 page .. 16 TiB"
            )));
        }
        let mut io = if o_direct {
            SwapIo::Direct
        } else {
            SwapIo::Buffered
        };
        let mut open = |path: &Path, how: Open| match open_swap(
            path,
            o_direct && io == SwapIo::Direct,
            how,
        ) {
            Err(e) if o_direct && io == SwapIo::Direct && is_einval(&e) => {
                tracing::warn!(?path, %e, "filesystem refuses O_DIRECT; swap file is buffered (page cache)");
                io = SwapIo::BufferedFallback;
                open_swap(path, false, how)
            }
            r => r,
        };
        let (path, file) = match path {
            Some(p) => (
                p.to_path_buf(),
                open(p, Open::Reset).map_err(Error::SwapIo)?,
            ),
            None => {
                // A name of our own, created exclusively: processes in other PID
                // namespaces (containers) may share this directory and our PID.
                let mut tries = 0;
                loop {
                    let salt = name_salt();
                    let p = std::env::temp_dir().join(format!(
                        "vmem-swap-{}-{}-{salt:08x}",
                        std::process::id(),
                        SWAP_SEQ.fetch_add(1, Ordering::Relaxed)
                    ));
                    match open(&p, Open::New) {
                        Ok(f) => break (p, f),
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 16 => {
                            tries += 1
                        }
                        Err(e) => return Err(Error::SwapIo(e)),
                    }
                }
            }
        };
        file.set_len(slots as u64 * PAGE as u64)
            .map_err(Error::SwapIo)?;
        // Reserve the blocks up front: cheaper writes, and no ENOSPC at
        // eviction time. Filesystems without fallocate keep a sparse file.
        if let Err(e) = rustix::fs::fallocate(
            &file,
            rustix::fs::FallocateFlags::empty(),
            0,
            (slots * PAGE) as u64,
        ) {
            tracing::debug!(err = %e, "fallocate of swap file failed; sparse file");
        }
        let mut file = file;
        if io == SwapIo::Direct {
            // Some filesystems accept the flag but refuse the I/O.
            let mut probe = PageBuf::new(1);
            if let Err(e) = file.read_exact_at(probe.as_mut_slice(), 0) {
                if !is_einval(&e) {
                    return Err(Error::SwapIo(e));
                }
                tracing::warn!(?path, %e, "filesystem refuses O_DIRECT reads; swap file is buffered (page cache)");
                io = SwapIo::BufferedFallback;
                file = open_swap(&path, false, Open::Again).map_err(Error::SwapIo)?;
            } else if on_memory_fs(&file) {
                tracing::warn!(
                    ?path,
                    "swap file is on a memory filesystem: major faults read no device"
                );
                io = SwapIo::MemoryFs;
            }
        }
        let mut remove_on_drop = false;
        if !keep {
            // Unlink now; the open descriptor keeps the blocks alive.
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(?path, %e, "could not unlink swap file; will retry on drop");
                remove_on_drop = true;
            }
        }
        tracing::debug!(?path, slots, ?io, keep, "swap device created");
        let file = Arc::new(file);
        Ok(SwapDevice {
            pool: IoPool::new(file.clone(), io_threads),
            file,
            io,
            path,
            remove_on_drop,
            slots,
            alloc: Mutex::new(SlotAlloc::new(slots)),
            used: AtomicUsize::new(0),
            cache: Mutex::new(SwapCache::new()),
            cached: AtomicUsize::new(0),
            cache_hits: AtomicU64::new(0),
            fail_writes: std::sync::atomic::AtomicBool::new(false),
            held: std::sync::atomic::AtomicBool::new(false),
            hold: Mutex::new(ForkHold::default()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn slots(&self) -> usize {
        self.slots
    }
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
    /// How the file is read and written.
    pub fn io(&self) -> SwapIo {
        self.io
    }
    /// I/O threads started so far (batches of concurrent reads/writes).
    #[cfg(test)]
    pub fn io_threads(&self) -> usize {
        self.pool.threads()
    }

    /// Allocates `n` slots (next-fit, so mostly consecutive), all or nothing.
    pub fn alloc(&self, n: usize, out: &mut Vec<Slot>) -> Result<()> {
        if self.held.load(Ordering::Acquire) {
            self.settle_hold(&mut self.hold.lock());
        }
        let mut a = self.alloc.lock();
        if a.free < n {
            return Err(Error::SwapFull(self.slots));
        }
        for _ in 0..n {
            out.push(a.alloc().expect("free count checked"));
        }
        self.used.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    pub fn free(&self, slot: Slot) {
        if self.held.load(Ordering::Acquire) {
            let mut h = self.hold.lock();
            if self.settle_hold(&mut h) {
                // A forked child may still read it: not reused until it is done.
                h.freed.push(slot);
                return;
            }
        }
        self.release_slot(slot);
    }

    /// Keep every slot allocated now from reuse until `child` (the read end
    /// of a pipe the forked child closes once it read what it needs) is at
    /// EOF: slots freed meanwhile are released then.
    pub fn hold_for_child(&self, child: std::os::fd::OwnedFd) {
        self.hold.lock().children.push(child);
        self.held.store(true, Ordering::Release);
    }

    /// Forgets the children that are done (their pipe at EOF or broken) and,
    /// with none left, releases the slots kept for them (`h` is the hold,
    /// locked; releasing takes only the allocator's and the cache's locks).
    /// Whether any child is left.
    fn settle_hold(&self, h: &mut ForkHold) -> bool {
        let mut b = [0u8; 1];
        h.children
            .retain(|fd| matches!(rustix::io::read(fd, &mut b), Err(rustix::io::Errno::AGAIN)));
        if !h.children.is_empty() {
            return true;
        }
        self.held.store(false, Ordering::Release);
        for s in std::mem::take(&mut h.freed) {
            self.release_slot(s);
        }
        false
    }

    fn release_slot(&self, slot: Slot) {
        // Drop a cached copy before the slot can be handed out again.
        if self.cached.load(Ordering::Acquire) > 0 {
            let mut c = self.cache.lock();
            if let Some(i) = c.tags.iter().position(|&t| t == Some(slot)) {
                c.tags[i] = None;
                self.cached.fetch_sub(1, Ordering::Release);
            }
        }
        if self.alloc.lock().release(slot) {
            self.used.fetch_sub(1, Ordering::Relaxed);
        } else {
            tracing::error!(slot, "double free of swap slot");
        }
    }

    /// Byte offset of `slot` in the file.
    pub fn off(slot: Slot) -> u64 {
        slot as u64 * PAGE as u64
    }

    /// O_DIRECT needs page-aligned buffers of whole pages (offsets are whole
    /// slots): a clear error instead of the kernel's EINVAL.
    fn check(&self, ptr: *const u8, len: usize) -> io::Result<()> {
        if len % PAGE != 0 || (self.io.is_direct() && ptr as usize % PAGE != 0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("swap I/O of {len} B at {ptr:p}: needs whole, page-aligned pages"),
            ));
        }
        Ok(())
    }

    /// Writes `data` (whole pages) to consecutive slots starting at `slot`
    /// (eviction writes through [`Self::run_batch`]).
    #[cfg(test)]
    pub fn write(&self, slot: Slot, data: &[u8]) -> io::Result<()> {
        self.check(data.as_ptr(), data.len())?;
        if self.fail_writes.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected write failure"));
        }
        self.file.write_all_at(data, Self::off(slot))
    }

    /// Reads consecutive slots starting at `slot` into `buf` (whole pages).
    /// A single page the swap cache holds comes from there (and leaves it).
    pub fn read(&self, slot: Slot, buf: &mut [u8]) -> io::Result<()> {
        self.check(buf.as_ptr(), buf.len())?;
        if buf.len() == PAGE && self.cached.load(Ordering::Acquire) > 0 {
            let mut c = self.cache.lock();
            if let Some(i) = c.tags.iter().position(|&t| t == Some(slot)) {
                buf.copy_from_slice(c.page(i));
                c.tags[i] = None;
                self.cached.fetch_sub(1, Ordering::Release);
                self.cache_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
        crate::uring::read_at(&self.file, buf, Self::off(slot))
    }

    /// One slot's read with a plain `pread` (no swap cache, no io_uring, no
    /// I/O thread): for a forked child, which has none of them.
    pub fn read_plain(&self, slot: Slot, buf: &mut [u8]) -> io::Result<()> {
        self.check(buf.as_ptr(), buf.len())?;
        self.file.read_exact_at(buf, Self::off(slot))
    }

    /// [`Self::read`] of one page that also keeps it in the swap cache: the
    /// caller reads a swapped page without bringing it in, and its swap-in
    /// usually follows. The slot must stay allocated during the call.
    pub fn read_keep(&self, slot: Slot, buf: &mut [u8]) -> io::Result<()> {
        self.read(slot, buf)?;
        if buf.len() == PAGE {
            let mut c = self.cache.lock();
            if !c.tags.contains(&Some(slot)) {
                let i = c.next;
                c.next = (i + 1) % CACHE_PAGES;
                if c.tags[i].replace(slot).is_none() {
                    self.cached.fetch_add(1, Ordering::Release);
                }
                c.page(i).copy_from_slice(buf);
            }
        }
        Ok(())
    }

    /// Single-page reads served by the swap cache so far.
    pub fn cache_hits(&self) -> u64 {
        self.cache_hits.load(Ordering::Relaxed)
    }

    /// Runs a batch of reads (or writes) concurrently on the I/O threads,
    /// one of them in the calling thread; each op's outcome is in its `res`.
    pub fn run_batch(&self, ops: &mut [IoOp], write: bool) {
        let mut go = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter_mut().enumerate() {
            op.res = self.check(op.ptr, op.len);
            if write && op.res.is_ok() && self.fail_writes.load(Ordering::Relaxed) {
                op.res = Err(io::Error::other("injected write failure"));
            }
            if op.res.is_ok() {
                go.push(i);
            }
        }
        if go.len() == ops.len() {
            self.pool.run(ops, write);
        } else {
            // Rare (a bug or injected failure): keep the failed ops' errors.
            let mut sub: Vec<IoOp> = go
                .iter()
                .map(|&i| IoOp {
                    ptr: ops[i].ptr,
                    len: ops[i].len,
                    off: ops[i].off,
                    res: Ok(()),
                })
                .collect();
            self.pool.run(&mut sub, write);
            for (&i, s) in go.iter().zip(sub) {
                ops[i].res = s.res;
            }
        }
    }

    /// A second descriptor of the swap file opened with O_DIRECT (the file
    /// may be unlinked: it is reopened through /proc/self/fd).
    fn reopen_direct(&self) -> io::Result<File> {
        let p = PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(p)
    }

    /// The device's own 4 KiB random-read latency on this swap file (see
    /// [`device_read_latency`]): allocates up to `n` free slots (at most
    /// 4096), writes them with O_DIRECT and fdatasync, so that the reads
    /// hit the device and not the page cache, measures, frees the slots.
    pub fn device_read_latency(&self, depth: usize, n: usize) -> Result<DeviceLatency> {
        check_params(depth, n).map_err(Error::SwapIo)?;
        let file = self.reopen_direct().map_err(|e| {
            Error::SwapIo(io::Error::new(
                e.kind(),
                format!("cannot open the swap file with O_DIRECT for the device baseline: {e}"),
            ))
        })?;
        let k = n.min(4096).min(self.slots - self.used()).max(1);
        let mut slots = Vec::with_capacity(k);
        self.alloc(k, &mut slots)?;
        let r = (|| -> io::Result<DeviceLatency> {
            let mut buf = PageBuf::new(64);
            for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
                *b = (i % 251) as u8 ^ 0x5a;
            }
            let mut i = 0;
            while i < k {
                let mut j = i + 1;
                while j < k && j - i < 64 && slots[j] == slots[j - 1] + 1 {
                    j += 1;
                }
                file.write_all_at(&buf.as_mut_slice()[..(j - i) * PAGE], Self::off(slots[i]))?;
                i = j;
            }
            file.sync_data()?;
            let offs: Vec<u64> = slots.iter().map(|&s| Self::off(s)).collect();
            measure(&file, &offs, depth, n)
        })();
        for s in slots {
            self.free(s);
        }
        r.map_err(Error::SwapIo)
    }
}

/// The device's 4 KiB random-read latency, measured with O_DIRECT reads of
/// one file: `n` reads one at a time (depth 1), then `n` reads kept `depth`
/// at a time (one thread per outstanding read).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceLatency {
    /// Reads per depth.
    pub reads: usize,
    /// Depth 1: median, min, max, 99th percentile and mean latency (µs) and
    /// reads per second.
    pub median_us: f64,
    /// Depth 1: fastest read (µs).
    pub min_us: f64,
    /// Depth 1: slowest read (µs).
    pub max_us: f64,
    /// Depth 1: 99th percentile (µs).
    pub p99_us: f64,
    /// Depth 1: mean (µs).
    pub mean_us: f64,
    /// Depth 1: reads per second.
    pub iops: f64,
    /// Depth 1, each read waited for by polling an io_uring instead of
    /// sleeping in `pread` (as NP-RDMA's polling thread waits for its swap
    /// reads, see [`crate::poll_swap_reads`]): median latency (µs). `None`
    /// where io_uring is unavailable.
    pub median_polled_us: Option<f64>,
    /// The concurrent run: its depth, median latency (µs) and reads per second.
    pub depth: usize,
    /// The concurrent run: median latency (µs).
    pub median_us_at_depth: f64,
    /// The concurrent run: reads per second.
    pub iops_at_depth: f64,
}

fn check_params(depth: usize, n: usize) -> io::Result<()> {
    if depth == 0 || depth > 256 || n == 0 || n > 1_000_000 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("device baseline: depth {depth} must be 1..=256 and reads {n} 1..=1000000"),
        ));
    }
    Ok(())
}

/// O_DIRECT 4 KiB random reads of the file at `path` (the whole file's pages
/// are candidates), at depth 1 and at `depth`. The caller makes sure the
/// file's blocks were written (a never-written, preallocated block reads
/// as zeroes without any device I/O). [`crate::Pager::device_read_latency`]
/// does this on the pager's own swap file.
pub fn device_read_latency(path: &Path, depth: usize, n: usize) -> io::Result<DeviceLatency> {
    check_params(depth, n)?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let pages = file.metadata()?.len() / PAGE as u64;
    if pages == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: smaller than one page", path.display()),
        ));
    }
    let offs: Vec<u64> = (0..pages.min(1 << 20)).map(|p| p * PAGE as u64).collect();
    measure(&file, &offs, depth, n)
}

/// A xorshift sequence seeded from the clock (distinct offsets per run).
fn rng() -> impl FnMut() -> u64 {
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0x9E37_79B9, |d| d.as_nanos() as u64)
        | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// `n` reads of random offsets out of `offs`, at depth 1 then at `depth`.
fn measure(file: &File, offs: &[u64], depth: usize, n: usize) -> io::Result<DeviceLatency> {
    let mut next = rng();
    let pick: Vec<u64> = (0..3 * n)
        .map(|_| offs[(next() % offs.len() as u64) as usize])
        .collect();
    let mut buf = PageBuf::new(1);
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for &off in &pick[..n] {
        let t = Instant::now();
        file.read_exact_at(buf.as_mut_slice(), off)?;
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let secs1 = t0.elapsed().as_secs_f64();
    let (min, max) = (
        *lat.iter().min().unwrap_or(&0),
        *lat.iter().max().unwrap_or(&0),
    );
    let med = median(&mut lat);
    let p99 = lat[(lat.len() * 99 / 100).min(lat.len() - 1)];
    let mean = lat.iter().sum::<u64>() as f64 / lat.len() as f64;
    // As many other reads, each polled for.
    let mut polled = Vec::with_capacity(n);
    for &off in &pick[2 * n..] {
        let t = Instant::now();
        match crate::uring::read_polled(file, buf.as_mut_slice(), off) {
            Some(r) => r?,
            None => break,
        }
        polled.push(t.elapsed().as_nanos() as u64);
    }
    let median_polled_us = (polled.len() == n).then(|| median(&mut polled) as f64 / 1e3);
    // Depth `depth`: that many threads, each one read at a time.
    let cursor = AtomicUsize::new(0);
    let deep = &pick[n..2 * n];
    let t0 = Instant::now();
    let per: Vec<io::Result<Vec<u64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..depth)
            .map(|_| {
                s.spawn(|| {
                    let mut b = PageBuf::new(1);
                    let mut l = Vec::new();
                    loop {
                        let i = cursor.fetch_add(1, Ordering::Relaxed);
                        if i >= deep.len() {
                            return Ok(l);
                        }
                        let t = Instant::now();
                        file.read_exact_at(b.as_mut_slice(), deep[i])?;
                        l.push(t.elapsed().as_nanos() as u64);
                    }
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("reader panicked")))
            })
            .collect()
    });
    let secs_d = t0.elapsed().as_secs_f64();
    let mut all = Vec::with_capacity(n);
    for r in per {
        all.extend(r?);
    }
    let us = |ns: u64| ns as f64 / 1000.0;
    Ok(DeviceLatency {
        reads: n,
        median_us: us(med),
        min_us: us(min),
        max_us: us(max),
        p99_us: us(p99),
        mean_us: mean / 1000.0,
        iops: n as f64 / secs1.max(1e-9),
        median_polled_us,
        depth,
        median_us_at_depth: us(median(&mut all)),
        iops_at_depth: n as f64 / secs_d.max(1e-9),
    })
}

impl Drop for SwapDevice {
    fn drop(&mut self) {
        if self.remove_on_drop {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_full() {
        let d = SwapDevice::create(None, 3 * PAGE as u64, false, false).unwrap();
        assert!(!d.path().exists(), "unlinked at creation");
        let mut v = Vec::new();
        d.alloc(3, &mut v).unwrap();
        assert_eq!(v, vec![0, 1, 2]);
        assert!(matches!(
            d.alloc(1, &mut Vec::new()),
            Err(Error::SwapFull(3))
        ));
        d.free(1);
        let mut w = Vec::new();
        d.alloc(1, &mut w).unwrap();
        assert_eq!(w, vec![1]);
        assert_eq!(d.used(), 3);
    }

    #[test]
    fn roundtrip_and_keep() {
        let p = std::env::temp_dir().join(format!("vmem-test-keep-{}", std::process::id()));
        {
            let d = SwapDevice::create(Some(&p), 4 * PAGE as u64, false, true).unwrap();
            let data: Vec<u8> = (0..2 * PAGE).map(|i| (i % 251) as u8).collect();
            d.write(2, &data).unwrap();
            let mut back = vec![0u8; 2 * PAGE];
            d.read(2, &mut back).unwrap();
            assert_eq!(back, data);
        }
        assert!(p.exists(), "kept on request");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn o_direct_roundtrip() {
        let d = SwapDevice::create(None, 4 * PAGE as u64, true, false).unwrap();
        let mut b = crate::mm::PageBuf::new(1);
        b.as_mut_slice().fill(0x5a);
        d.write(3, b.as_slice()).unwrap();
        let mut c = crate::mm::PageBuf::new(1);
        d.read(3, c.as_mut_slice()).unwrap();
        assert!(c.as_slice().iter().all(|&x| x == 0x5a));
    }

    #[test]
    fn refused_o_direct_falls_back_to_buffered_and_says_so() {
        REFUSE_O_DIRECT.with(|r| r.set(true));
        let d = SwapDevice::create(None, 4 * PAGE as u64, true, false);
        REFUSE_O_DIRECT.with(|r| r.set(false));
        let d = d.unwrap();
        assert_eq!(d.io(), SwapIo::BufferedFallback);
        assert!(!d.io().is_direct());
        // Buffered: any buffer works.
        let data: Vec<u8> = (0..PAGE).map(|i| (i % 249) as u8).collect();
        d.write(1, &data).unwrap();
        let mut back = vec![0u8; PAGE];
        d.read(1, &mut back).unwrap();
        assert_eq!(back, data);
        let b = SwapDevice::create(None, 4 * PAGE as u64, false, false).unwrap();
        assert_eq!(b.io(), SwapIo::Buffered);
    }

    #[test]
    fn o_direct_refuses_unaligned_buffers_with_a_clear_error() {
        let d = SwapDevice::create(None, 4 * PAGE as u64, true, false).unwrap();
        assert!(d.io().is_direct(), "{:?}", d.io());
        let mut b = PageBuf::new(2);
        let unaligned = &mut b.as_mut_slice()[8..8 + PAGE];
        let e = d.read(0, unaligned).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let e = d.write(0, &b.as_slice()[..100]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn batches_run_concurrently_and_byte_exact() {
        let d = SwapDevice::create_with(None, 64 * PAGE as u64, true, false, 4).unwrap();
        let mut src = PageBuf::new(64);
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i / PAGE * 7 + i % 251) as u8;
        }
        // 16 writes of 4 pages each, then 64 single-page reads in reverse order.
        let mut w: Vec<IoOp> = src
            .as_slice()
            .chunks(4 * PAGE)
            .enumerate()
            .map(|(k, c)| IoOp::write(c, SwapDevice::off(4 * k as Slot)))
            .collect();
        d.run_batch(&mut w, true);
        assert!(w.iter().all(|o| o.res.is_ok()));
        assert!(d.io_threads() > 0, "several ops use the I/O threads");
        let mut dst = PageBuf::new(64);
        let mut r: Vec<IoOp> = dst
            .as_mut_slice()
            .chunks_mut(PAGE)
            .enumerate()
            .map(|(k, c)| IoOp::read(c, SwapDevice::off(63 - k as Slot)))
            .collect();
        d.run_batch(&mut r, false);
        assert!(r.iter().all(|o| o.res.is_ok()));
        for k in 0..64 {
            assert_eq!(
                &dst.as_slice()[k * PAGE..(k + 1) * PAGE],
                &src.as_slice()[(63 - k) * PAGE..(64 - k) * PAGE],
                "page {k}"
            );
        }
        // A failed op reports its own error; the others still complete.
        let mut bad = PageBuf::new(2);
        let (a, b2) = bad.as_mut_slice().split_at_mut(PAGE);
        let mut r = vec![
            IoOp::read(a, SwapDevice::off(5)),
            IoOp::read(&mut b2[..PAGE], SwapDevice::off(64)), // past the end
        ];
        d.run_batch(&mut r, false);
        assert!(r[0].res.is_ok());
        assert!(r[1].res.is_err());
        assert_eq!(&bad.as_slice()[..PAGE], &src.as_slice()[5 * PAGE..6 * PAGE]);
    }

    #[test]
    fn concurrent_batches_from_several_threads_stay_byte_exact() {
        let d = SwapDevice::create_with(None, 64 * PAGE as u64, true, false, 3).unwrap();
        let mut src = PageBuf::new(64);
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i / PAGE * 13 + i % 241) as u8;
        }
        let mut w = vec![IoOp::write(src.as_slice(), 0)];
        d.run_batch(&mut w, true);
        assert!(w[0].res.is_ok());
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let (d, src) = (&d, &src);
                s.spawn(move || {
                    let mut dst = PageBuf::new(8);
                    for round in 0..50u32 {
                        let slot = |k: u32| (t * 7 + round * 3 + k * 5) % 64;
                        let mut ops: Vec<IoOp> = dst
                            .as_mut_slice()
                            .chunks_mut(PAGE)
                            .enumerate()
                            .map(|(k, c)| IoOp::read(c, SwapDevice::off(slot(k as u32))))
                            .collect();
                        d.run_batch(&mut ops, false);
                        assert!(ops.iter().all(|o| o.res.is_ok()));
                        for k in 0..8 {
                            let s0 = slot(k as u32) as usize * PAGE;
                            assert_eq!(
                                &dst.as_slice()[k * PAGE..(k + 1) * PAGE],
                                &src.as_slice()[s0..s0 + PAGE]
                            );
                        }
                    }
                });
            }
        });
        assert!(d.io_threads() <= 3);
    }

    #[test]
    fn device_baseline_rejects_bad_input() {
        let p = Path::new("/nonexistent/vmem-device-baseline");
        assert!(device_read_latency(p, 1, 10).is_err());
        let d = SwapDevice::create(None, 4 * PAGE as u64, true, false).unwrap();
        assert!(d.device_read_latency(0, 10).is_err());
        assert!(d.device_read_latency(1, 0).is_err());
        assert!(d.device_read_latency(1000, 10).is_err());
        assert_eq!(d.used(), 0);
    }

    proptest::proptest! {
        #[test]
        fn allocator_never_double_allocates(ops in proptest::collection::vec(0u8..3, 1..200)) {
            let mut a = SlotAlloc::new(37);
            let mut live = std::collections::BTreeSet::new();
            for op in ops {
                if op < 2 {
                    match a.alloc() {
                        Some(s) => proptest::prop_assert!(live.insert(s) && (s as usize) < 37),
                        None => proptest::prop_assert_eq!(live.len(), 37),
                    }
                } else if let Some(&s) = live.iter().next() {
                    live.remove(&s);
                    proptest::prop_assert!(a.release(s));
                }
                proptest::prop_assert_eq!(a.free, 37 - live.len());
            }
        }
    }
}
