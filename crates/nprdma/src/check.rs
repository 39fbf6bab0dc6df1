//! Optimistic checks: deciding from the data a one-sided operation returned
//! whether it may have hit a page fault (paper § "Signature Page with Magic
//! Number", § "Page Versioning", "Pre-check local page faults").
//!
//! * **Read data** — an absent target page reads as the *signature page*
//!   (the magic `u32` repeated, so the byte at address `a` of a signature
//!   frame is `magic.to_le_bytes()[a % 4]`). The NIC moves data in *DMA
//!   atoms* (max TLP size) and translates each atom separately, so a page
//!   swapped out (or in) during the transfer tears it at an atom boundary:
//!   every atom is either all real data or all signature. Hence checking one
//!   aligned `u32` per atom suffices — per atom of the *target* address space
//!   (atoms are aligned to the remote address, so a transfer that starts
//!   mid-atom has a short first atom) and of the *initiator* address space
//!   (where a local view of an absent page shows the signature too). The data
//!   is split into *pieces* at both grids' boundaries, and each piece gets one
//!   window: its first 4-aligned `u32` (in the target's alignment, and also
//!   in the initiator's when the two differ mod 4), or — for a piece too
//!   short to hold one — all its bytes. A window equal to the magic marks the
//!   transfer suspect (a coincidental match only costs a two-sided retry).
//!   The windows repeat with the atom period, so the middle of a transfer is
//!   checked by a stride loop (one `u32` per atom when both addresses are
//!   congruent mod the atom size, else a per-period template of `u64`
//!   probes); the piece walk covers the ends and locates a hit.
//! * **Small writes** — the read-back of the written range (into a pinned
//!   temporary buffer) must equal the source and must not look like magic.
//! * **Page versions** — for large transfers, the version words read before
//!   and after must be equal and odd (resident) page by page.
//! * **Local pre-check** — before posting, every local page must be resident.
//!
//! All functions are pure and allocation-free.

/// How the DMA engine splits transfers into atoms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AtomGrid {
    /// Atoms are aligned to the address (PCIe-like: a transfer starting
    /// mid-atom has a short first atom). The paper's assumption.
    #[default]
    Aligned,
    /// Check both the address-aligned grid and the grid relative to the
    /// transfer start (for engines that cut atoms from the first byte); about
    /// twice the windows.
    Both,
}

/// Parameters of the checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckConfig {
    /// Minimum atomic DMA size (max TLP), a power of two ≥ 4.
    atom: usize,
    /// The signature page's magic word.
    magic: u32,
    /// Page size, a power of two ≥ `atom`.
    page_size: usize,
    /// Atom splitting of the DMA engine.
    grid: AtomGrid,
}

/// Invalid check parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("atom size {0} must be a power of two >= 4")]
    /// Atom size not a power of two ≥ 4.
    BadAtom(usize),
    #[error("page size {page} must be a power of two >= the atom size {atom}")]
    /// Page size not a power of two ≥ the atom size.
    BadPage {
        /// Page index in the operation.
        page: usize,
        /// The atom size.
        atom: usize,
    },
}

impl Default for CheckConfig {
    fn default() -> Self {
        CheckConfig {
            atom: 256,
            magic: 0xdead_beef,
            page_size: 4096,
            grid: AtomGrid::Aligned,
        }
    }
}

impl CheckConfig {
    /// Validated configuration.
    pub fn new(
        atom: usize,
        magic: u32,
        page_size: usize,
        grid: AtomGrid,
    ) -> Result<Self, CheckError> {
        if atom < 4 || !atom.is_power_of_two() {
            return Err(CheckError::BadAtom(atom));
        }
        if page_size < atom || !page_size.is_power_of_two() {
            return Err(CheckError::BadPage {
                page: page_size,
                atom,
            });
        }
        Ok(CheckConfig {
            atom,
            magic,
            page_size,
            grid,
        })
    }
    /// DMA atom size (the NIC's max TLP) in bytes.
    pub fn atom(&self) -> usize {
        self.atom
    }
    /// The signature word.
    pub fn magic(&self) -> u32 {
        self.magic
    }
    /// Page size.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// How atoms are laid over the data.
    pub fn grid(&self) -> AtomGrid {
        self.grid
    }
    /// Byte a signature frame holds at address `addr`.
    pub fn magic_byte(&self, addr: u64) -> u8 {
        self.magic.to_le_bytes()[(addr % 4) as usize]
    }
}

/// Why an operation must fall back to the two-sided path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Suspect {
    /// A window at this data offset equals the magic word.
    #[error("magic word at offset {offset}")]
    Magic {
        /// Byte offset in the data.
        offset: usize,
    },
    /// The read-back differs from the source at this offset.
    #[error("read-back differs at offset {offset}")]
    Mismatch {
        /// Byte offset in the data.
        offset: usize,
    },
    /// Read-back and source lengths differ.
    #[error("read-back length {got} != source length {want}")]
    LengthMismatch {
        /// What was found.
        got: usize,
        /// What was expected.
        want: usize,
    },
    /// A page's version changed during the operation.
    #[error("version of page {page} changed ({before} -> {after})")]
    VersionChanged {
        /// Page index in the operation.
        page: usize,
        /// Before.
        before: u32,
        /// After.
        after: u32,
    },
    /// A page was absent (even version) during the operation.
    #[error("page {page} absent (version {version})")]
    VersionAbsent {
        /// Page index in the operation.
        page: usize,
        /// The version word.
        version: u32,
    },
    /// Different numbers of version words before and after.
    #[error("{before} versions before, {after} after")]
    VersionCount {
        /// Before.
        before: usize,
        /// After.
        after: usize,
    },
    /// A local page is not resident (pre-check).
    #[error("local page {page_addr:#x} not resident")]
    NotResident {
        /// The page's address.
        page_addr: u64,
    },
    /// The range wraps the address space.
    #[error("range wraps the address space")]
    BadRange,
}

/// Offset (from `off`, in data coordinates) of the next boundary of an
/// atom grid (`mask` = atom − 1) in an address space where data offset 0
/// sits at address residue `base_mod` (= addr mod atom).
#[inline(always)]
fn next_aligned(off: usize, base_mod: usize, mask: usize) -> usize {
    ((base_mod + off) | mask) + 1 - base_mod
}

/// Whether the piece `data[s..e]`, at address residue `a4` (= address of
/// `data[0]` mod 4), shows the magic word in its window.
#[inline(always)]
fn piece_is_magic(data: &[u8], s: usize, e: usize, a4: usize, magic: u32) -> bool {
    let w = s + ((4 - ((a4 + s) & 3)) & 3);
    if w + 4 <= e {
        match data.get(w..w + 4) {
            Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) == magic,
            None => false,
        }
    } else {
        let m = magic.to_le_bytes();
        data[s..e]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == m[(a4 + s + i) & 3])
    }
}

/// Check the data an RDMA READ returned (`data` was read from
/// `remote_addr` and landed at `local_addr`). `Err` = possible fault: redo
/// through the two-sided path.
///
/// Cost: one `u32` load per atom when the two addresses are congruent mod
/// the atom size (one grid, e.g. page-aligned buffers), one `u64` load per
/// piece (two or three per atom) otherwise; the piece-by-piece walk only
/// runs at the ends of the transfer, for short transfers, and — to name the
/// offset — after a hit. Exactly the walk's windows either way.
pub fn check_read(
    data: &[u8],
    local_addr: u64,
    remote_addr: u64,
    cfg: &CheckConfig,
) -> Result<(), Suspect> {
    check_atoms(data, local_addr, remote_addr, cfg)
}

/// Reference implementation of [`check_read`]: the piece-by-piece walk over
/// the whole buffer, without the stride fast path (the code `check_read` ran
/// before it). Same answer on every input; for tests and same-run baselines
/// in benchmarks.
#[doc(hidden)]
pub fn check_read_walk(
    data: &[u8],
    local_addr: u64,
    remote_addr: u64,
    cfg: &CheckConfig,
) -> Result<(), Suspect> {
    Geom::new(local_addr, remote_addr, cfg).walk(data, 0, data.len())
}

#[inline(always)]
fn check_atoms(
    data: &[u8],
    local_addr: u64,
    remote_addr: u64,
    cfg: &CheckConfig,
) -> Result<(), Suspect> {
    let g = Geom::new(local_addr, remote_addr, cfg);
    // (The first test alone keeps short transfers off the fast path's
    // setup; `atom << 3` may wrap to 0 for absurd atoms, the second test is
    // exact.)
    if data.len() >= cfg.atom << 3 && g.fast_worth_it(data.len()) && g.fast_clean(data) {
        Ok(())
    } else {
        // A hit (or data too short for the fast path): the walk decides and
        // names the offset.
        g.walk_inline(data, 0, data.len())
    }
}

/// The atom grids of one check, in data coordinates: the data is cut into
/// pieces at every boundary of the target grid, of the initiator grid and
/// (with [`AtomGrid::Both`]) of the transfer-relative grid; each piece gets
/// one window per address alignment (see the module doc).
#[derive(Debug, Clone, Copy)]
struct Geom {
    atom: usize,
    mask: usize,
    /// Remote (target) address mod atom.
    rm: usize,
    /// Local (initiator) address mod atom.
    lm: usize,
    r4: usize,
    l4: usize,
    /// The transfer-relative grid adds boundaries of its own.
    rel: bool,
    magic: u32,
}

/// Max pieces per atom period: one per grid.
const MAX_PIECES: usize = 3;

/// The windows of one piece of the periodic pattern. Both windows of a piece
/// (one per address alignment) lie within 7 bytes of its start, so one
/// little-endian `u64` load at `off` (from the period start) covers them:
/// `x & m0 == w0 || x & m1 == w1` ⇒ suspect. A `u32` window masks its 4
/// bytes; a piece too short for one masks all its bytes (≤ 6). With a single
/// alignment the second check repeats the first.
#[derive(Debug, Clone, Copy, Default)]
struct PieceProbe {
    off: usize,
    m0: u64,
    w0: u64,
    m1: u64,
    w1: u64,
}

/// The windows of one atom period of a multi-grid check.
#[derive(Debug, Clone, Copy)]
struct Template {
    pieces: [PieceProbe; MAX_PIECES],
    n: usize,
}

impl Geom {
    fn new(local_addr: u64, remote_addr: u64, cfg: &CheckConfig) -> Self {
        let mask = cfg.atom - 1;
        let (rm, lm) = (remote_addr as usize & mask, local_addr as usize & mask);
        Geom {
            atom: cfg.atom,
            mask,
            rm,
            lm,
            r4: rm & 3,
            l4: lm & 3,
            rel: cfg.grid == AtomGrid::Both && rm != 0 && lm != 0,
            magic: cfg.magic,
        }
    }

    /// Piece by piece over `data[lo..hi]`; `lo` and `hi` must be piece
    /// boundaries (0, a target-grid boundary, or `data.len()`).
    #[inline(never)]
    fn walk(self, data: &[u8], lo: usize, hi: usize) -> Result<(), Suspect> {
        self.walk_inline(data, lo, hi)
    }

    /// [`Geom::walk`], inlined into the short-transfer path.
    #[inline(always)]
    fn walk_inline(self, data: &[u8], lo: usize, hi: usize) -> Result<(), Suspect> {
        let hi = hi.min(data.len());
        let mut s = lo;
        while s < hi {
            let mut e = next_aligned(s, self.rm, self.mask);
            if self.lm != self.rm {
                e = e.min(next_aligned(s, self.lm, self.mask));
            }
            if self.rel {
                e = e.min(next_aligned(s, 0, self.mask));
            }
            let e = e.min(hi);
            if piece_is_magic(data, s, e, self.r4, self.magic)
                || (self.l4 != self.r4 && piece_is_magic(data, s, e, self.l4, self.magic))
            {
                return Err(Suspect::Magic { offset: s });
            }
            s = e;
        }
        Ok(())
    }

    /// `true` = no window of `data` shows the magic (exactly the walk's
    /// windows). `false` = a hit, or too short to bother: ask the walk.
    ///
    /// The middle of the buffer is a run of whole atom periods starting at
    /// the first target-grid boundary; every period has the same windows at
    /// the same offsets, so they are checked by a stride loop. The partial
    /// periods at both ends go through the walk.
    #[inline(never)]
    fn fast_clean(self, data: &[u8]) -> bool {
        let len = data.len();
        let b0 = self.first_boundary();
        let single = self.single();
        if !self.fast_worth_it(len) {
            return false;
        }
        let mid_end = b0 + ((len - b0) & !self.mask);
        let Some(mid) = data.get(b0..mid_end) else {
            return false;
        };
        if b0 > 0 && self.walk(data, 0, b0).is_err() {
            return false;
        }
        let clean = if single {
            // Every window is the first u32 of a target atom.
            stride_clean(mid, self.atom, self.magic)
        } else {
            self.multi_clean(mid)
        };
        clean && (mid_end == len || self.walk(data, mid_end, len).is_ok())
    }

    /// One grid only: the initiator's boundaries are the target's.
    #[inline(always)]
    fn single(self) -> bool {
        self.lm == self.rm && !self.rel
    }

    /// Data offset of the first target-grid boundary.
    #[inline(always)]
    fn first_boundary(self) -> usize {
        (self.atom - self.rm) & self.mask
    }

    /// Whether `len` bytes are enough for the fast path to repay its setup
    /// (≈ 12 ns against ≈ 2.3 ns per atom for the walk, measured with
    /// check_bench): eight whole atoms. Multi-grid templates also need
    /// atoms of at least 8 bytes (their `u64` windows).
    #[inline(always)]
    fn fast_worth_it(self, len: usize) -> bool {
        let periods = len.saturating_sub(self.first_boundary()) >> self.atom.trailing_zeros();
        periods >= 8 && (self.single() || self.atom >= 8)
    }

    /// The whole periods of a multi-grid check (kept out of line: its
    /// template setup would bloat the one-grid path's frame).
    #[inline(never)]
    fn multi_clean(self, mid: &[u8]) -> bool {
        self.template().clean(mid, self.atom)
    }

    /// The windows of one whole period (from a target-grid boundary to the
    /// next), relative to its start.
    fn template(self) -> Template {
        // Piece cuts inside the period: the target boundary (0), the
        // initiator boundary, the transfer-relative boundary. All distinct
        // when present (see `rel` and the `lm != rm` test).
        let mut cuts = [0usize; MAX_PIECES + 1];
        let mut nc = 1;
        if self.lm != self.rm {
            cuts[nc] = self.rm.wrapping_sub(self.lm) & self.mask;
            nc += 1;
        }
        if self.rel {
            cuts[nc] = self.rm;
            nc += 1;
        }
        cuts[..nc].sort_unstable();
        cuts[nc] = self.atom;
        let mut t = Template {
            pieces: [PieceProbe::default(); MAX_PIECES],
            n: nc,
        };
        for (i, p) in t.pieces[..nc].iter_mut().enumerate() {
            let (s, e) = (cuts[i], cuts[i + 1]);
            // Load the u64 inside the period (atom ≥ 8): both windows and
            // any short piece lie in [s, min(s + 7, e)) ⊂ [off, off + 8).
            let off = s.min(self.atom - 8);
            let (m0, w0) = self.window(s, e, self.r4, s - off);
            let (m1, w1) = self.window(s, e, self.l4, s - off);
            *p = PieceProbe {
                off,
                m0,
                w0,
                m1,
                w1,
            };
        }
        t
    }

    /// (mask, wanted value) on the `u64` loaded at `s - lead` for the
    /// window of the piece `[s, e)` of a period in the view with address
    /// alignment `a4`.
    fn window(self, s: usize, e: usize, a4: usize, lead: usize) -> (u64, u64) {
        // A period starts at a target-grid boundary, whose address is ≡ 0
        // mod 4 in the target's view; in the view with alignment `a4` its
        // residue mod 4 is:
        let ph = (a4 + 4 - self.r4) & 3;
        let d = (4 - ((ph + s) & 3)) & 3;
        if s + d + 4 <= e {
            let sh = 8 * (lead + d);
            (0xffff_ffff << sh, u64::from(self.magic) << sh)
        } else {
            // Short piece (≤ 6 bytes): all its bytes must show the
            // signature pattern.
            let m = self.magic.to_le_bytes();
            let l = e - s;
            let want = (0..l).fold(0u64, |w, j| w | u64::from(m[(ph + s + j) & 3]) << (8 * j));
            (((1u64 << (8 * l)) - 1) << (8 * lead), want << (8 * lead))
        }
    }
}

impl Template {
    /// `true` = no window shows the magic in `mid`, a whole number of
    /// periods (atom ≥ 8).
    fn clean(&self, mid: &[u8], atom: usize) -> bool {
        // A multi-grid period has two or three pieces (`Geom::template`).
        match self.n {
            2 => self.clean_a::<2>(mid, atom),
            _ => self.clean_a::<3>(mid, atom),
        }
    }

    fn clean_a<const N: usize>(&self, mid: &[u8], atom: usize) -> bool {
        let mut ps = [PieceProbe::default(); N];
        ps.copy_from_slice(&self.pieces[..N]);
        match atom {
            8 => clean_n::<8, N>(mid, &ps),
            16 => clean_n::<16, N>(mid, &ps),
            32 => clean_n::<32, N>(mid, &ps),
            64 => clean_n::<64, N>(mid, &ps),
            128 => clean_n::<128, N>(mid, &ps),
            256 => clean_n::<256, N>(mid, &ps),
            512 => clean_n::<512, N>(mid, &ps),
            1024 => clean_n::<1024, N>(mid, &ps),
            2048 => clean_n::<2048, N>(mid, &ps),
            4096 => clean_n::<4096, N>(mid, &ps),
            _ => mid.chunks_exact(atom).all(|c| {
                !ps.iter().fold(false, |h, p| {
                    h | match c.get(p.off..p.off + 8) {
                        Some(b) => p.hit(u64_at(b, 0)),
                        None => true,
                    }
                })
            }),
        }
    }
}

impl PieceProbe {
    #[inline(always)]
    fn hit(&self, x: u64) -> bool {
        (x & self.m0 == self.w0) | (x & self.m1 == self.w1)
    }
}

#[inline(always)]
fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes([
        b[i],
        b[i + 1],
        b[i + 2],
        b[i + 3],
        b[i + 4],
        b[i + 5],
        b[i + 6],
        b[i + 7],
    ])
}

/// [`Template::clean`] for atom size `A` (≥ 8) and `N` pieces per period:
/// four periods per loop iteration, no bounds checks in the loop.
fn clean_n<const A: usize, const N: usize>(mid: &[u8], ps: &[PieceProbe; N]) -> bool {
    // Offsets are ≤ A − 8 by construction; the clamp lets the compiler see it.
    let offs = ps.map(|p| p.off.min(A - 8));
    #[inline(always)]
    fn period<const N: usize>(
        ps: &[PieceProbe; N],
        offs: &[usize; N],
        c: &[u8],
        base: usize,
    ) -> bool {
        let mut h = false;
        for i in 0..N {
            h |= ps[i].hit(u64_at(c, base + offs[i]));
        }
        h
    }
    let period = |c: &[u8], base: usize| period(ps, &offs, c, base);
    let mut groups = mid.chunks_exact(4 * A);
    for g in &mut groups {
        if period(g, 0) | period(g, A) | period(g, 2 * A) | period(g, 3 * A) {
            return false;
        }
    }
    groups.remainder().chunks_exact(A).all(|c| !period(c, 0))
}

/// `true` = no atom of `mid` (a whole number of atoms) starts with the
/// magic word. Atom sizes up to 4 KiB get a loop specialised on the size
/// (no bounds checks; compares OR-reduced over eight atoms in the source,
/// which LLVM turns into one fused compare-and-branch per atom — never
/// taken on clean data, so as cheap).
fn stride_clean(mid: &[u8], atom: usize, magic: u32) -> bool {
    match atom {
        4 => stride_clean_n::<4>(mid, magic),
        8 => stride_clean_n::<8>(mid, magic),
        16 => stride_clean_n::<16>(mid, magic),
        32 => stride_clean_n::<32>(mid, magic),
        64 => stride_clean_n::<64>(mid, magic),
        128 => stride_clean_n::<128>(mid, magic),
        256 => stride_clean_n::<256>(mid, magic),
        512 => stride_clean_n::<512>(mid, magic),
        1024 => stride_clean_n::<1024>(mid, magic),
        2048 => stride_clean_n::<2048>(mid, magic),
        4096 => stride_clean_n::<4096>(mid, magic),
        _ => mid
            .chunks_exact(atom)
            .all(|c| matches!(c.first_chunk::<4>(), Some(w) if u32::from_le_bytes(*w) != magic)),
    }
}

#[inline(always)]
fn word_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// [`stride_clean`] for atom size `A` (≥ 4).
fn stride_clean_n<const A: usize>(mid: &[u8], magic: u32) -> bool {
    let mut groups = mid.chunks_exact(8 * A);
    for g in &mut groups {
        // OR-reduce eight compares, one branch.
        let mut hit = false;
        for j in 0..8 {
            hit |= word_at(g, j * A) == magic;
        }
        if hit {
            return false;
        }
    }
    groups
        .remainder()
        .chunks_exact(A)
        .all(|c| word_at(c, 0) != magic)
}

/// Check the read-back of a small WRITE: it must equal `src` and show no
/// magic word in the target's atoms (the read-back buffer itself is pinned,
/// so only the target grid matters).
pub fn check_readback(
    src: &[u8],
    readback: &[u8],
    remote_addr: u64,
    cfg: &CheckConfig,
) -> Result<(), Suspect> {
    if src.len() != readback.len() {
        return Err(Suspect::LengthMismatch {
            got: readback.len(),
            want: src.len(),
        });
    }
    if src != readback {
        let offset = src
            .iter()
            .zip(readback)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        return Err(Suspect::Mismatch { offset });
    }
    check_atoms(readback, remote_addr, remote_addr, cfg)
}

/// Compare page versions read before and after an operation: each page's
/// two versions must be equal and odd (resident throughout).
pub fn check_versions(before: &[u32], after: &[u32]) -> Result<(), Suspect> {
    if before.len() != after.len() {
        return Err(Suspect::VersionCount {
            before: before.len(),
            after: after.len(),
        });
    }
    for (page, (&b, &a)) in before.iter().zip(after).enumerate() {
        if b != a {
            return Err(Suspect::VersionChanged {
                page,
                before: b,
                after: a,
            });
        }
        if b % 2 == 0 {
            return Err(Suspect::VersionAbsent { page, version: b });
        }
    }
    Ok(())
}

/// Pages touched by `[addr, addr + len)`: (address of the first page,
/// number of pages). `None` if the range wraps; `(page, 0)` if `len == 0`.
pub fn page_span(addr: u64, len: u64, page_size: usize) -> Option<(u64, u64)> {
    let ps = page_size as u64;
    let first = addr & !(ps - 1);
    if len == 0 {
        return Some((first, 0));
    }
    let last = addr.checked_add(len - 1)? & !(ps - 1);
    Some((first, (last - first) / ps + 1))
}

/// Local pre-check: every page of `[addr, addr + len)` must be resident
/// according to `is_resident(page_addr)` (e.g. the pager's state array).
pub fn precheck_local(
    addr: u64,
    len: u64,
    page_size: usize,
    mut is_resident: impl FnMut(u64) -> bool,
) -> Result<(), Suspect> {
    let (first, n) = page_span(addr, len, page_size).ok_or(Suspect::BadRange)?;
    for i in 0..n {
        let p = first + i * page_size as u64;
        if !is_resident(p) {
            return Err(Suspect::NotResident { page_addr: p });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
