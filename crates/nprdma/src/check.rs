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
    BadAtom(usize),
    #[error("page size {page} must be a power of two >= the atom size {atom}")]
    BadPage { page: usize, atom: usize },
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
    pub fn atom(&self) -> usize {
        self.atom
    }
    pub fn magic(&self) -> u32 {
        self.magic
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
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
    Magic { offset: usize },
    /// The read-back differs from the source at this offset.
    #[error("read-back differs at offset {offset}")]
    Mismatch { offset: usize },
    /// Read-back and source lengths differ.
    #[error("read-back length {got} != source length {want}")]
    LengthMismatch { got: usize, want: usize },
    /// A page's version changed during the operation.
    #[error("version of page {page} changed ({before} -> {after})")]
    VersionChanged {
        page: usize,
        before: u32,
        after: u32,
    },
    /// A page was absent (even version) during the operation.
    #[error("page {page} absent (version {version})")]
    VersionAbsent { page: usize, version: u32 },
    /// Different numbers of version words before and after.
    #[error("{before} versions before, {after} after")]
    VersionCount { before: usize, after: usize },
    /// A local page is not resident (pre-check).
    #[error("local page {page_addr:#x} not resident")]
    NotResident { page_addr: u64 },
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
pub fn check_read(
    data: &[u8],
    local_addr: u64,
    remote_addr: u64,
    cfg: &CheckConfig,
) -> Result<(), Suspect> {
    check_atoms(data, local_addr, remote_addr, cfg)
}

fn check_atoms(
    data: &[u8],
    local_addr: u64,
    remote_addr: u64,
    cfg: &CheckConfig,
) -> Result<(), Suspect> {
    let mask = cfg.atom - 1;
    let (rm, lm) = (remote_addr as usize & mask, local_addr as usize & mask);
    let (r4, l4) = (rm & 3, lm & 3);
    let magic = cfg.magic;
    let len = data.len();
    let both = cfg.grid == AtomGrid::Both;
    let mut s = 0;
    while s < len {
        let mut e = next_aligned(s, rm, mask);
        if lm != rm {
            e = e.min(next_aligned(s, lm, mask));
        }
        if both && rm != 0 && lm != 0 {
            e = e.min(next_aligned(s, 0, mask));
        }
        let e = e.min(len);
        if piece_is_magic(data, s, e, r4, magic)
            || (l4 != r4 && piece_is_magic(data, s, e, l4, magic))
        {
            return Err(Suspect::Magic { offset: s });
        }
        s = e;
    }
    Ok(())
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
