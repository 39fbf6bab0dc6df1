//! The DMA engine: MR key validation, MR -> MTT -> IOMMU translation (once per page,
//! the granule every atom of the page shares), frame-residency checks, and the copy itself (memmove in-process,
//! process_vm_readv/writev into another process), inside IOMMU epoch sections.

use crate::fault_guard;
use crate::hw::frames::page_resident;
use crate::hw::iommu::{enter, Frame, ACCESSED};
use crate::hw::scratch::{scratch_slot, Scratch};
use crate::hw::segment::{Segment, PAGE, PAGE_SHIFT};
use crate::sys::{self, VmDir};
use crate::verbs::Access;
use std::sync::atomic::{AtomicU64, Ordering};

/// MR kinds stored in the MR table.
pub const MR_PASSTHROUGH: u32 = 0;
/// `MrView::kind` of an IOVA-range MR (0 = passthrough).
pub const MR_IOVA: u32 = 1;

/// A validated snapshot of an MR table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrView {
    /// 0 = passthrough, `MR_IOVA` = IOVA range.
    pub kind: u32,
    /// Registered virtual address.
    pub va: u64,
    /// Registered length.
    pub len: u64,
    /// First IOVA (IOVA kind).
    pub iova_base: u64,
    /// Slot of the IOVA range's record (kind `MR_IOVA`).
    pub iova_slot: u32,
    /// ON_DEMAND MR (ODP model): a non-present page is a page fault, not a DMA error.
    pub odp: bool,
}

/// Why a key check failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyErr {
    /// No such key.
    Invalid,
    /// PD mismatch.
    Pd,
    /// Missing access right.
    Access,
    /// Outside the MR.
    Bounds,
}

/// MR table index of a key (keys are `(index + 1) << 8 | generation`).
pub fn key_index(key: u32) -> Option<u32> {
    (key >> 8).checked_sub(1)
}

/// Whether `key` names a live MR registered with [`Access::ANY_QP`] (reachable
/// whatever the QP's access flags; its own rights are checked by [`check_key`]).
pub(crate) fn key_any_qp(seg: &Segment, key: u32) -> bool {
    key != 0
        && key_index(key).and_then(|i| seg.mr(i)).is_some_and(|rec| {
            rec.key.load(Ordering::Acquire) == key
                && Access::from_bits_truncate(rec.access.load(Ordering::Relaxed)).contains(Access::ANY_QP)
        })
}

/// Validate `key` for `[addr, addr+len)` with protection domain `pd` and rights `need`;
/// for a remote key also the QP's protection sub-domain (`Some(domain)`, see
/// [`crate::hw::segment::MrRec::domain`]); a host's own keys in its own WRs (`None`)
/// are not checked against it.
pub fn check_key(
    seg: &Segment,
    key: u32,
    pd: u32,
    domain: Option<u32>,
    addr: u64,
    len: u64,
    need: Access,
) -> Result<MrView, KeyErr> {
    let rec = key_index(key).and_then(|i| seg.mr(i)).ok_or(KeyErr::Invalid)?;
    if key == 0 || rec.key.load(Ordering::Acquire) != key {
        return Err(KeyErr::Invalid);
    }
    if rec.pd.load(Ordering::Relaxed) != pd {
        return Err(KeyErr::Pd);
    }
    if let Some(d) = domain {
        let own = rec.domain.load(Ordering::Relaxed);
        if own != 0 && own != d {
            return Err(KeyErr::Pd);
        }
    }
    let acc = Access::from_bits_truncate(rec.access.load(Ordering::Relaxed));
    if !acc.contains(need) {
        return Err(KeyErr::Access);
    }
    let v = MrView {
        kind: rec.kind.load(Ordering::Relaxed),
        va: rec.va.load(Ordering::Relaxed),
        len: rec.len.load(Ordering::Relaxed),
        iova_base: rec.iova_base.load(Ordering::Relaxed),
        iova_slot: rec.iova_slot.load(Ordering::Relaxed),
        odp: acc.contains(Access::ON_DEMAND),
    };
    let end = addr.checked_add(len).ok_or(KeyErr::Bounds)?;
    if addr < v.va || end > v.va + v.len {
        return Err(KeyErr::Bounds);
    }
    Ok(v)
}

/// Where one atom's bytes physically are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// A virtual address in the owning host's process.
    Addr(u64),
    /// A generated pattern: byte k is `word.to_le_bytes()[k % 4]` (signature = magic,
    /// black hole = 0).
    Fill(u32),
    /// Writes are discarded (signature / black-hole frame as a destination).
    Drop,
}

/// Why translating an atom failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// IOMMU entry not mapped.
    Unmapped,
    /// The frame is not resident (counted in `nonresident_dma`).
    NonResident,
    /// ODP model: the page of this frame address (host virtual address) is not present
    /// in the NIC's page table of an ON_DEMAND MR (a page fault; nothing was touched).
    NotPresent(u64),
}

fn sig_word(magic: u32, off: u64) -> u32 {
    magic.rotate_right(8 * (off % 4) as u32)
}

/// Translate the atom at `addr` of MR `mr` of the host owning `seg`.
pub fn translate(seg: &Segment, mr: &MrView, addr: u64, write: bool) -> Result<Loc, Fault> {
    let mut entry = None;
    let frame = if mr.kind == MR_PASSTHROUGH {
        Frame::Ram((addr & !(PAGE as u64 - 1)) as usize)
    } else {
        let page = mr.iova_base + ((addr >> PAGE_SHIFT) - (mr.va >> PAGE_SHIFT));
        match seg.iommu_entry(page) {
            Some(e) => {
                let v = e.load(Ordering::Acquire);
                entry = Some((e, v));
                Frame::decode(v, seg.iova_rec(mr.iova_slot))
            }
            None => Frame::Unmapped,
        }
    };
    let off = addr & (PAGE as u64 - 1);
    match frame {
        Frame::Unmapped => Err(Fault::Unmapped),
        Frame::Ram(f) => {
            if !page_resident(seg, (f >> PAGE_SHIFT) as u64) {
                if mr.odp {
                    return Err(Fault::NotPresent(f as u64));
                }
                seg.stats().nonresident_dma.fetch_add(1, Ordering::Relaxed);
                return Err(Fault::NonResident);
            }
            if let Some((e, v)) = entry {
                // The entry's accessed bit: set only when clear (the line stays
                // shared while the page is hot). Setting it never changes the
                // rest of the entry, even if a remap replaced it meanwhile (the
                // new mapping then only looks young one round longer).
                if v & ACCESSED == 0 {
                    e.fetch_or(ACCESSED, Ordering::Relaxed);
                }
            }
            Ok(Loc::Addr(f as u64 + off))
        }
        Frame::Signature => Ok(if write {
            Loc::Drop
        } else {
            Loc::Fill(sig_word(seg.p.magic, off))
        }),
        Frame::BlackHole => Ok(if write { Loc::Drop } else { Loc::Fill(0) }),
    }
}

/// How the addresses of one side of a transfer are reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Port {
    /// This process: plain memory copies.
    Local,
    /// Another process: process_vm_readv / writev.
    Proc(u32),
    /// A host across the network (RoCEv2): its memory is reached only by the
    /// packets its own NIC serves, never by a copy of ours.
    Wire,
}

/// A contiguous piece of one side: validated MR + address range.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// The MR.
    pub mr: MrView,
    /// Start address within it.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A span of this process's own memory outside any MR (a slot, an inline payload, a
/// result word): identity translation over exactly `[addr, addr + len)`.
pub(crate) fn passthrough(addr: u64, len: u64) -> Span {
    Span {
        mr: MrView {
            kind: MR_PASSTHROUGH,
            va: addr,
            len,
            iova_base: 0,
            iova_slot: 0,
            odp: false,
        },
        addr,
        len,
    }
}

/// One side of a transfer.
pub struct Side<'a> {
    /// The segment whose IOMMU translates.
    pub seg: &'a Segment,
    /// How the bytes are reached.
    pub port: Port,
    /// The spans.
    pub spans: &'a [Span],
}

/// A DMA failure, by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmaErr {
    /// On the source side.
    Src(Fault),
    /// On the destination side.
    Dst(Fault),
    /// The cross-process copy failed (peer gone or memory unmapped there).
    Io,
}

#[derive(Clone, Copy, Debug)]
struct Piece {
    src: Loc,
    dst: Loc,
    len: u64,
}

fn contiguous(a: Loc, alen: u64, b: Loc) -> bool {
    match (a, b) {
        (Loc::Addr(x), Loc::Addr(y)) => x + alen == y,
        (Loc::Fill(x), Loc::Fill(y)) => x.rotate_right(8 * (alen % 4) as u32) == y,
        (Loc::Drop, Loc::Drop) => true,
        _ => false,
    }
}

scratch_slot!(PIECES: Piece);
scratch_slot!(TRIPLES: (u64, u64, u64));
scratch_slot!(REST: (u64, u64, u64));
scratch_slot!(IOVECS: libc::iovec);

fn push(pieces: &mut Vec<Piece>, p: Piece) {
    if let Some(l) = pieces.last_mut() {
        if contiguous(l.src, l.len, p.src) && contiguous(l.dst, l.len, p.dst) {
            l.len += p.len;
            return;
        }
    }
    pieces.push(p);
}

struct Cursor<'a> {
    spans: &'a [Span],
    i: usize,
    off: u64,
}

impl<'a> Cursor<'a> {
    fn cur(&mut self) -> Option<(&'a Span, u64, u64)> {
        while self.i < self.spans.len() && self.off >= self.spans[self.i].len {
            self.i += 1;
            self.off = 0;
        }
        let s = self.spans.get(self.i)?;
        Some((s, s.addr + self.off, s.len - self.off))
    }
}

/// Translation unit of a span: one page (the IOMMU and MTT granule) for both MR kinds.
/// All atoms of a page share its frame, so the page is translated (and its frame's
/// residency checked) once per epoch section; a remap can then tear a transfer only at
/// a page boundary, which is an atom boundary (max TLP <= page), a legal subset of
/// per-atom translation. Passthrough MRs have an identity MTT and no IOMMU entry.
const UNIT: u64 = PAGE as u64;

/// Copy `total` bytes from `src` to `dst`, translating every page of each side once
/// per epoch section and coalescing pages whose frames are contiguous into one copy.
/// Returns the number of DMA atoms (max-TLP units of the smaller TLP) moved.
pub fn copy(src: &Side, dst: &Side, total: u64, section: usize) -> Result<u64, DmaErr> {
    copy_with_help(src, dst, total, section, None)
}

/// A peer's NIC thread that copies part of a large cross-process transfer in parallel.
/// A job in a free request-ring slot of the target QP lists already validated and
/// translated copy units; both sides claim units from a shared counter (work sharing:
/// a busy or sleeping helper never delays the initiator beyond the unit it is copying).
pub struct Help<'a> {
    /// The target's segment.
    pub seg: &'a Segment,
    /// Target QP table index.
    pub qp: u32,
    /// Next ring slot to use; advanced for every job the helper took.
    pub next_slot: std::cell::Cell<u64>,
    /// Nonce of the requesting host.
    pub src_nonce: u64,
    /// Requesting QP number.
    pub src_qpn: u32,
    /// How long to wait for the answer.
    pub timeout_ns: u64,
    /// Set (to a time in ns) when the helper kept us waiting: sharing is then paused
    /// until that time (a preempted helper on a loaded machine costs more than it saves).
    pub backoff_until: &'a AtomicU64,
}

/// Waiting longer than this for the helper's last unit pauses sharing for
/// `HELP_BACKOFF_NS`.
const HELP_SLOW_NS: u64 = 100_000;
const HELP_BACKOFF_NS: u64 = 50_000_000;

/// Copy unit of a shared job.
pub const HELP_CHUNK: u64 = 128 * 1024;
/// Smallest cross-process section worth sharing with the peer's NIC thread.
pub const HELP_MIN: usize = 2 * HELP_CHUNK as usize;

/// [`copy`], letting `help` move part of each large cross-process section.
pub fn copy_with_help(src: &Side, dst: &Side, total: u64, section: usize, help: Option<&Help>) -> Result<u64, DmaErr> {
    let stlp = src.seg.p.max_tlp as u64;
    let dtlp = dst.seg.p.max_tlp as u64;
    let mut sc = Cursor {
        spans: src.spans,
        i: 0,
        off: 0,
    };
    let mut dc = Cursor {
        spans: dst.spans,
        i: 0,
        off: 0,
    };
    let mut done = 0u64;
    let mut pieces = Scratch::take(&PIECES);
    let same = std::ptr::eq(src.seg, dst.seg);
    while done < total {
        let n = (total - done).min(section as u64);
        // Translation and copy of a section inside both hosts' epoch sections: a
        // `flush()` after a remap waits until the copy that used the old frame is done.
        let _gs = enter(src.seg);
        let _gd = (!same).then(|| enter(dst.seg));
        translate_section(src, dst, &mut sc, &mut dc, n, &mut pieces)?;
        let (local, remote) = if matches!(src.port, Port::Proc(_)) {
            (dst.seg, src.seg)
        } else {
            (src.seg, dst.seg)
        };
        execute(src.port, dst.port, (local, remote), &pieces, help)?;
        done += n;
    }
    Ok(total.div_ceil(stlp.min(dtlp)))
}

/// Translate the next `len` bytes of the transfer (cursors `sc` / `dc`) into `pieces`:
/// every page of each side once (a new section re-translates everything), pieces of
/// consecutive pages merged where both sides' locations are contiguous.
fn translate_section(
    src: &Side,
    dst: &Side,
    sc: &mut Cursor,
    dc: &mut Cursor,
    len: u64,
    pieces: &mut Vec<Piece>,
) -> Result<(), DmaErr> {
    let mut scache: Option<(usize, u64, Loc)> = None;
    let mut dcache: Option<(usize, u64, Loc)> = None;
    pieces.clear();
    let mut done = 0;
    while done < len {
        let (Some((ss, sa, sl)), Some((ds, da, dl))) = (sc.cur(), dc.cur()) else {
            return Err(DmaErr::Io);
        };
        let n = (len - done)
            .min(sl)
            .min(dl)
            .min(UNIT - (sa & (UNIT - 1)))
            .min(UNIT - (da & (UNIT - 1)));
        // Each side translates each of its pages exactly once per section, even
        // when the other side's page boundaries split it into two pieces.
        let s = unit_loc(&mut scache, src.seg, ss, sa, false).map_err(DmaErr::Src)?;
        let d = unit_loc(&mut dcache, dst.seg, ds, da, true).map_err(DmaErr::Dst)?;
        push(pieces, Piece { src: s, dst: d, len: n });
        sc.off += n;
        dc.off += n;
        done += n;
    }
    Ok(())
}

fn shift(loc: Loc, delta: u64) -> Loc {
    match loc {
        Loc::Addr(a) => Loc::Addr(a + delta),
        Loc::Fill(w) => Loc::Fill(w.rotate_right(8 * (delta % 4) as u32)),
        Loc::Drop => Loc::Drop,
    }
}

/// Location of `addr`, translating its unit (page) once (cached in `cache`).
fn unit_loc(
    cache: &mut Option<(usize, u64, Loc)>,
    seg: &Segment,
    span: &Span,
    addr: u64,
    write: bool,
) -> Result<Loc, Fault> {
    let base = addr & !(UNIT - 1);
    let id = span as *const Span as usize;
    if let Some((i, b, l)) = *cache {
        if i == id && b == base {
            return Ok(shift(l, addr - base));
        }
    }
    // Translate at the unit's first byte inside this span (the span may start mid-page).
    let first = base.max(span.addr);
    let l = translate(seg, &span.mr, first, write)?;
    let at_base = match l {
        Loc::Addr(a) => Loc::Addr(a - (first - base)),
        Loc::Fill(w) => Loc::Fill(w.rotate_left(8 * ((first - base) % 4) as u32)),
        Loc::Drop => Loc::Drop,
    };
    *cache = Some((id, base, at_base));
    Ok(shift(at_base, addr - base))
}

fn fill(dst: *mut u8, len: usize, word: u32) -> Result<(), DmaErr> {
    let b = word.to_le_bytes();
    if word == 0 {
        // SAFETY: dst..dst+len is a validated, translated destination (see execute);
        // if the application unmaps it meanwhile, the guard ends the write.
        return unsafe { fault_guard::set(dst, 0, len) }.map_err(|_| DmaErr::Io);
    }
    // The pattern in blocks of words (a block length is a multiple of 4, so every
    // block starts at phase 0): a signature page is read at memcpy speed, not byte by
    // byte, and a short read (the 2 B READ of a faulting page) builds only the words
    // it copies.
    const BLOCK: usize = 1024;
    let mut block = [0u32; BLOCK / 4];
    block[..len.min(BLOCK).div_ceil(4)].fill(u32::from_ne_bytes(b));
    let mut k = 0;
    while k < len {
        let n = (len - k).min(BLOCK);
        // SAFETY: dst+k..dst+k+n lies inside the validated destination (k + n <= len);
        // `block` is a local array of BLOCK bytes (n <= BLOCK, and its first n bytes
        // are filled), so the two cannot overlap.
        unsafe { fault_guard::copy(dst.add(k), block.as_ptr().cast::<u8>(), n) }.map_err(|_| DmaErr::Io)?;
        k += n;
    }
    Ok(())
}

fn pattern(len: usize, word: u32) -> Vec<u8> {
    let b = word.to_le_bytes();
    (0..len).map(|k| b[k % 4]).collect()
}

const IOV_MAX: usize = 1024;

/// Whether the target host is alive, checked once per section that copies through
/// its DMA pool mapping (our mapping outlives the target: without the check a SEND
/// to a dead peer would "succeed" into orphaned memory).
fn pool_ready(checked: &mut bool, remote: &Segment) -> Result<(), DmaErr> {
    if !*checked {
        if !remote.alive() {
            return Err(DmaErr::Io);
        }
        *checked = true;
    }
    Ok(())
}

/// Execute translated pieces. `remote` is the segment of the other process's host
/// (cross-process copies): addresses inside its DMA pool are copied through our
/// mapping of the pool memfd, everything else with process_vm_readv/writev.
fn execute(
    sp: Port,
    dp: Port,
    (local, remote): (&Segment, &Segment),
    pieces: &[Piece],
    help: Option<&Help>,
) -> Result<(), DmaErr> {
    match (sp, dp) {
        (Port::Local, Port::Local) => {
            for p in pieces {
                match (p.src, p.dst) {
                    (_, Loc::Drop) => {}
                    (Loc::Addr(s), Loc::Addr(d)) => {
                        // SAFETY: both addresses were produced by `translate` from MRs
                        // that passed `check_key` (so they lie in registered memory whose
                        // validity `reg_mr`'s contract guarantees) or from IOMMU frames
                        // whose validity `Iommu::map`'s contract guarantees, inside epoch
                        // sections of both hosts so deregistration/unmapping waits for us.
                        // Regions may overlap (loopback), hence a memmove. Memory the
                        // application unmaps under the copy anyway ends it with an error
                        // (the fault guard).
                        unsafe { fault_guard::copy(d as *mut u8, s as *const u8, p.len as usize) }
                            .map_err(|_| DmaErr::Io)?
                    }
                    (Loc::Fill(w), Loc::Addr(d)) => fill(d as *mut u8, p.len as usize, w)?,
                    // Fill is never a destination; Drop is never a source.
                    (Loc::Drop, Loc::Addr(_)) | (_, Loc::Fill(_)) => {}
                }
            }
            Ok(())
        }
        (Port::Proc(pid), Port::Local) | (Port::Local, Port::Proc(pid)) => {
            let read = matches!(sp, Port::Proc(_));
            // (local address, remote address, len) of every real copy.
            let mut triples = Scratch::take(&TRIPLES);
            let mut keep: Vec<Vec<u8>> = Vec::new();
            let mut alive = false;
            for p in pieces {
                match (p.src, p.dst) {
                    (Loc::Addr(s), Loc::Addr(d)) => {
                        let (l, r) = if read { (d, s) } else { (s, d) };
                        if let Some(m) = remote.pool_local(r, p.len) {
                            pool_ready(&mut alive, remote)?;
                            let (from, to) = if read {
                                (m as *const u8, l as *mut u8)
                            } else {
                                (l as *const u8, m)
                            };
                            // SAFETY: `l` is translated local memory (see the Local arm's
                            // invariant); `m` is our mapping of the target's pool memfd at
                            // the offset of the translated remote address, inside the
                            // mapping (`pool_local` checked the bounds) and valid for the
                            // mapping's life (the memfd is sealed against shrinking). The
                            // two are different mappings; `copy` tolerates aliasing anyway.
                            unsafe { std::ptr::copy(from, to, p.len as usize) };
                        } else {
                            triples.push((l, r, p.len));
                        }
                    }
                    (Loc::Fill(w), Loc::Addr(d)) if read => fill(d as *mut u8, p.len as usize, w)?,
                    (Loc::Fill(w), Loc::Addr(d)) if remote.pool_local(d, p.len).is_some() => {
                        pool_ready(&mut alive, remote)?;
                        fill(remote.pool_local(d, p.len).expect("checked"), p.len as usize, w)?;
                    }
                    (Loc::Fill(w), Loc::Addr(d)) => {
                        keep.push(pattern(p.len as usize, w));
                        triples.push((keep.last().expect("pushed").as_ptr() as u64, d, p.len));
                    }
                    _ => {}
                }
            }
            if alive {
                local.stats().pool_copies.fetch_add(1, Ordering::Relaxed);
            }
            let total: u64 = triples.iter().map(|t| t.2).sum();
            let dir = if read { VmDir::Read } else { VmDir::Write };
            if let Some(h) = help.filter(|_| total as usize >= HELP_MIN && keep.is_empty()) {
                let units = split_units(&triples, HELP_CHUNK);
                if let Some(job) = post_help(h, read, &units) {
                    return run_shared(h, job, pid, dir, &units);
                }
            }
            for chunk in triples.chunks(IOV_MAX) {
                vm_copy(pid, dir, chunk)?;
            }
            Ok(())
        }
        // Two remote sides, or a peer across the wire (reached only by packets).
        _ => Err(DmaErr::Io),
    }
}

/// Transient process_vm failures (EINTR, EAGAIN, ENOMEM) retried before the WR fails.
const VM_RETRIES: u32 = 3;

/// Copy `chunk` with process_vm_readv/writev. A partial transfer (the kernel stops at
/// an iovec it could not complete) resumes from where it stopped, and a transient
/// failure is retried, so only a persistent fault fails the WR (before, any short
/// count failed it: a READ then completed with REM_ACCESS_ERR).
fn vm_copy(pid: u32, dir: VmDir, chunk: &[(u64, u64, u64)]) -> Result<(), DmaErr> {
    let mut rest = Scratch::take(&REST);
    rest.extend(chunk.iter().copied().filter(|t| t.2 > 0));
    let mut retries = 0;
    let mut iov = Scratch::take(&IOVECS);
    while !rest.is_empty() {
        iov.clear();
        let io = |a: u64, n: u64| libc::iovec {
            iov_base: a as *mut libc::c_void,
            iov_len: n as usize,
        };
        iov.extend(rest.iter().map(|t| io(t.0, t.2)));
        iov.extend(rest.iter().map(|t| io(t.1, t.2)));
        let (l, r) = iov.split_at(rest.len());
        // SAFETY: local iovecs point into translated local memory (see `execute`'s
        // invariant), valid and writable for reads into it; pattern buffers outlive
        // the call.
        match unsafe { sys::process_vm(pid, dir, l, r) } {
            Ok(n) if n > 0 => {
                let want: u64 = rest.iter().map(|t| t.2).sum();
                if n as u64 >= want {
                    return Ok(());
                }
                tracing::debug!(got = n, want, "partial process_vm transfer, resuming");
                let mut skip = n as u64;
                while let Some(t) = rest.first_mut() {
                    if skip < t.2 {
                        *t = (t.0 + skip, t.1 + skip, t.2 - skip);
                        break;
                    }
                    skip -= t.2;
                    rest.remove(0);
                }
            }
            Err(e)
                if retries < VM_RETRIES
                    && matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::ENOMEM)) =>
            {
                retries += 1;
                tracing::debug!(error = %e, "transient process_vm failure, retrying");
            }
            res => {
                tracing::debug!(?res, "process_vm failed");
                return Err(DmaErr::Io);
            }
        }
    }
    Ok(())
}

type Triples = Vec<(u64, u64, u64)>;

/// Cut copy triples into units of at most `unit` bytes.
fn split_units(t: &[(u64, u64, u64)], unit: u64) -> Triples {
    let mut v = Vec::new();
    for &(l, r, n) in t {
        let mut o = 0;
        while o < n {
            let k = unit.min(n - o);
            v.push((l + o, r + o, k));
            o += k;
        }
    }
    v
}

fn post_help<'a>(h: &Help<'a>, read: bool, t: &[(u64, u64, u64)]) -> Option<&'a crate::hw::segment::SlotHdr> {
    let (hdr, data) = h.seg.slot(h.qp, h.next_slot.get());
    let cap = h.seg.p.ring_max as usize / 24;
    if t.len() < 2 || t.len() > cap || hdr.state.load(Ordering::Acquire) != crate::hw::segment::SLOT_FREE {
        return None;
    }
    for (i, &(l, r, n)) in t.iter().enumerate() {
        for (k, v) in [l, r, n].into_iter().enumerate() {
            // SAFETY: 24 * t.len() <= ring_max bytes of the slot's data area, which we
            // own while the slot is FREE (SPSC ring, producer side).
            unsafe { (data.add(24 * i + 8 * k) as *mut u64).write_unaligned(v) };
        }
    }
    let op = if read {
        crate::hw::segment::RING_HELP_READ
    } else {
        crate::hw::segment::RING_HELP_WRITE
    };
    hdr.op.store(op, Ordering::Relaxed);
    hdr.len.store(t.len() as u32, Ordering::Relaxed);
    hdr.cmp.store(std::process::id() as u64, Ordering::Relaxed);
    hdr.src_nonce.store(h.src_nonce, Ordering::Relaxed);
    hdr.src_qpn.store(h.src_qpn, Ordering::Relaxed);
    hdr.status.store(0, Ordering::Relaxed);
    hdr.result.store(0, Ordering::Relaxed);
    // The helper declines the job if it runs on our CPU (sharing one core only adds
    // switches); `swp` carries our CPU number.
    hdr.swp.store(rustix::thread::sched_getcpu() as u64, Ordering::Relaxed);
    hdr.state.store(crate::hw::segment::SLOT_REQ, Ordering::Release);
    h.seg.ring_doorbell(h.qp);
    Some(hdr)
}

/// Copy units claimed from the shared counter; then cancel the job if the helper never
/// took it, or wait until it finished the units it claimed.
fn run_shared(
    h: &Help,
    job: &crate::hw::segment::SlotHdr,
    pid: u32,
    dir: VmDir,
    units: &[(u64, u64, u64)],
) -> Result<(), DmaErr> {
    let mut res = Ok(());
    loop {
        let i = job.result.fetch_add(1, Ordering::AcqRel) as usize;
        if i >= units.len() {
            break;
        }
        if res.is_ok() {
            res = vm_copy(pid, dir, &units[i..i + 1]);
        }
    }
    use crate::hw::segment::{SLOT_DONE, SLOT_FREE, SLOT_REQ};
    if job
        .state
        .compare_exchange(SLOT_REQ, SLOT_FREE, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // Never taken: the slot is ours again and the target's ring did not advance.
        return res;
    }
    // Always wait for a helper that took the job: it may be writing into our memory.
    let start = sys::now_ns();
    let mut spins = 0u32;
    while job.state.load(Ordering::Acquire) != SLOT_DONE {
        spins += 1;
        if spins % 1024 == 0 {
            if sys::now_ns() - start > h.timeout_ns {
                // Leave the slot in flight: the caller fails the WR and the QP.
                h.next_slot.set(h.next_slot.get() + 1);
                return Err(DmaErr::Io);
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    if job.status.load(Ordering::Relaxed) != 0 {
        res = Err(DmaErr::Io);
    }
    job.state.store(SLOT_FREE, Ordering::Release);
    h.next_slot.set(h.next_slot.get() + 1);
    let now = sys::now_ns();
    if now - start > HELP_SLOW_NS {
        h.backoff_until.store(now + HELP_BACKOFF_NS, Ordering::Relaxed);
    }
    res
}

/// A remote atomic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicOp {
    /// Compare-and-swap.
    CmpSwap {
        /// The value expected at the remote address.
        compare: u64,
        /// The value stored there if it matched.
        swap: u64,
    },
    /// Fetch-and-add.
    FetchAdd {
        /// The addend.
        add: u64,
    },
}

/// Execute an 8-byte atomic on a translated, 8-aligned location of *this* process.
/// Returns the original value. Signature/black-hole frames return their pattern and
/// drop the write.
pub fn atomic_local(loc: Loc, op: AtomicOp) -> Result<u64, DmaErr> {
    match loc {
        Loc::Addr(a) => {
            debug_assert!(a % 8 == 0);
            let p = a as *mut u64;
            // SAFETY: `a` is an 8-aligned address translated from a validated MR of a
            // host in this process inside an epoch section (see `execute`), so it is
            // valid for 8 bytes — unless the application unmapped it, which the
            // fault guard turns into an error.
            let r = unsafe {
                match op {
                    AtomicOp::CmpSwap { compare, swap } => fault_guard::compare_swap(p, compare, swap),
                    AtomicOp::FetchAdd { add } => fault_guard::fetch_add(p, add),
                }
            };
            r.map_err(|_| DmaErr::Io)
        }
        Loc::Fill(w) => Ok((w as u64) | ((w as u64) << 32)),
        Loc::Drop => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_copy_many_iovecs_and_persistent_fault() {
        let pid = std::process::id();
        let src: Vec<u8> = (0..3 * PAGE).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; 3 * PAGE];
        let (s, d) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
        let p = PAGE as u64;
        // Out of order, uneven pieces, one empty.
        let t = [
            (d + 2 * p, s + 2 * p, p),
            (d, s, 100),
            (d + 100, s + 100, 0),
            (d + 100, s + 100, 2 * p - 100),
        ];
        vm_copy(pid, VmDir::Read, &t).unwrap();
        assert_eq!(dst, src);
        // A remote iovec that can never be read: the kernel copies the first piece
        // (partial transfer), the resumed call faults, the copy fails.
        dst.fill(0);
        let t = [(d, s, p), (d + p, 8, p)];
        assert_eq!(vm_copy(pid, VmDir::Read, &t), Err(DmaErr::Io));
        assert_eq!(dst[..PAGE], src[..PAGE]);
    }

    #[test]
    fn sig_pattern_is_phase_correct() {
        let m = 0xdeadbeefu32;
        let full = pattern(12, m);
        for off in 0..8u64 {
            let p = pattern(4, sig_word(m, off));
            assert_eq!(&p[..], &full[off as usize..off as usize + 4]);
        }
    }

    #[test]
    fn fill_writes_the_word_pattern_at_any_length() {
        for w in [0u32, 0xdead_beef, 0x0102_0304] {
            for len in [0usize, 1, 3, 4, 5, 1023, 1024, 1025, 4096, 5000] {
                let mut v = vec![0xaau8; len + 8];
                fill(v[4..].as_mut_ptr(), len, w).unwrap();
                assert_eq!(&v[4..4 + len], &pattern(len, w)[..], "word {w:#x} len {len}");
                assert_eq!(&v[..4], &[0xaa; 4], "no write before");
                assert_eq!(&v[4 + len..], &[0xaa; 4], "no write after");
            }
        }
    }

    /// Page-aligned, zeroed heap memory (freed on drop).
    struct Pages(*mut u8, usize);
    impl Pages {
        fn new(n: usize) -> Pages {
            let l = std::alloc::Layout::from_size_align(n * PAGE, PAGE).unwrap();
            // SAFETY: non-zero size layout.
            let p = unsafe { std::alloc::alloc_zeroed(l) };
            assert!(!p.is_null());
            Pages(p, n)
        }
        fn page(&self, i: usize) -> usize {
            self.0 as usize + i * PAGE
        }
    }
    impl Drop for Pages {
        fn drop(&mut self) {
            let l = std::alloc::Layout::from_size_align(self.1 * PAGE, PAGE).unwrap();
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.0, l) }
        }
    }

    #[test]
    fn iova_pages_translate_per_page_and_coalesce_contiguous_frames() {
        let h = crate::Host::new(crate::HostConfig::default()).unwrap();
        let seg = &h.inner().seg;
        let mem = Pages::new(8);
        for i in 0..8 * PAGE {
            // SAFETY: i < 8 pages of `mem`.
            unsafe { *mem.0.add(i) = (i % 251) as u8 };
        }
        let io = h.iommu();
        let r = io.alloc_range(8).unwrap();
        let frames = [
            // IOVA pages 0..4 -> frames 0..4 (one run), 4..6 -> frames 6..8 (a second
            // run), then two signature pages (one fill run).
            Frame::Ram(mem.page(0)),
            Frame::Ram(mem.page(1)),
            Frame::Ram(mem.page(2)),
            Frame::Ram(mem.page(3)),
            Frame::Ram(mem.page(6)),
            Frame::Ram(mem.page(7)),
            Frame::Signature,
            Frame::Signature,
        ];
        // SAFETY: `mem` outlives every DMA through these entries: `free_range` at the
        // end unmaps and flushes them before `mem` drops.
        unsafe { io.map_range(&r, 0, &frames).unwrap() };
        let va = 0x10_0000_0000u64;
        let mr = MrView {
            kind: MR_IOVA,
            va,
            len: 8 * PAGE as u64,
            iova_base: r.base,
            iova_slot: r.slot,
            odp: false,
        };
        let len = 8 * PAGE as u64 - 100;
        let sspan = [Span {
            mr,
            addr: va + 100,
            len,
        }];
        let mut out = vec![0u8; len as usize];
        // The DMA writes through this address (derived from a unique borrow).
        let o = out.as_mut_ptr() as u64;
        let dspan = [Span {
            mr: MrView {
                kind: MR_PASSTHROUGH,
                va: o,
                len,
                iova_base: 0,
                iova_slot: 0,
                odp: false,
            },
            addr: o,
            len,
        }];
        let src = Side {
            seg,
            port: Port::Local,
            spans: &sspan,
        };
        let dst = Side {
            seg,
            port: Port::Local,
            spans: &dspan,
        };
        let mut sc = Cursor {
            spans: &sspan,
            i: 0,
            off: 0,
        };
        let mut dc = Cursor {
            spans: &dspan,
            i: 0,
            off: 0,
        };
        let mut pieces = Vec::new();
        translate_section(&src, &dst, &mut sc, &mut dc, len, &mut pieces).unwrap();
        let p = PAGE as u64;
        let got: Vec<(Loc, Loc, u64)> = pieces.iter().map(|x| (x.src, x.dst, x.len)).collect();
        assert_eq!(
            got,
            [
                (Loc::Addr(mem.page(0) as u64 + 100), Loc::Addr(o), 4 * p - 100),
                (Loc::Addr(mem.page(6) as u64), Loc::Addr(o + 4 * p - 100), 2 * p),
                (Loc::Fill(h.inner().seg.p.magic), Loc::Addr(o + 6 * p - 100), 2 * p),
            ]
        );
        // The copy itself moves the same bytes.
        copy(&src, &dst, len, 1 << 20).unwrap();
        // SAFETY: `mem` is 8 pages long.
        let m = unsafe { std::slice::from_raw_parts(mem.0, 8 * PAGE) };
        assert_eq!(out[..4 * PAGE - 100], m[100..4 * PAGE]);
        assert_eq!(out[4 * PAGE - 100..6 * PAGE - 100], m[6 * PAGE..]);
        assert_eq!(out[6 * PAGE - 100..], pattern(2 * PAGE, h.inner().seg.p.magic)[..]);
        // A section ending mid-page splits the run there (and re-translates).
        let (mut sc, mut dc) = (
            Cursor {
                spans: &sspan,
                i: 0,
                off: 0,
            },
            Cursor {
                spans: &dspan,
                i: 0,
                off: 0,
            },
        );
        translate_section(&src, &dst, &mut sc, &mut dc, 2 * p, &mut pieces).unwrap();
        assert_eq!(pieces.len(), 1);
        translate_section(&src, &dst, &mut sc, &mut dc, 2 * p, &mut pieces).unwrap();
        assert_eq!(
            (pieces.len(), pieces[0].src, pieces[0].len),
            (2, Loc::Addr(mem.page(2) as u64 + 100), 2 * p - 100)
        );
        drop(out);
        io.free_range(r).unwrap();
    }

    #[test]
    fn merge_contiguous_pieces() {
        let mut v = Vec::new();
        push(
            &mut v,
            Piece {
                src: Loc::Addr(100),
                dst: Loc::Addr(1000),
                len: 10,
            },
        );
        push(
            &mut v,
            Piece {
                src: Loc::Addr(110),
                dst: Loc::Addr(1010),
                len: 10,
            },
        );
        push(
            &mut v,
            Piece {
                src: Loc::Addr(121),
                dst: Loc::Addr(1020),
                len: 10,
            },
        );
        push(
            &mut v,
            Piece {
                src: Loc::Fill(0xdeadbeef),
                dst: Loc::Addr(1030),
                len: 3,
            },
        );
        push(
            &mut v,
            Piece {
                src: Loc::Fill(sig_word(0xdeadbeef, 3)),
                dst: Loc::Addr(1033),
                len: 5,
            },
        );
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].len, 20);
        assert_eq!(v[2].len, 8);
    }
}
