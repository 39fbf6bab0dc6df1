//! Unit and property tests of the optimistic checks.

use proptest::prelude::*;

use super::*;

fn cfg() -> CheckConfig {
    CheckConfig::default()
}

/// Overwrite `data[s..e]` (which sits at address `base`) with signature
/// bytes as a signature frame would deliver them.
fn tear(data: &mut [u8], base: u64, s: usize, e: usize, cfg: &CheckConfig) {
    for (i, b) in data[s..e].iter_mut().enumerate() {
        *b = cfg.magic_byte(base + (s + i) as u64);
    }
}

/// Real data that can never contain a magic byte (0xdeadbeef's bytes are
/// all >= 0xad).
fn clean_bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u8).wrapping_mul(31) ^ seed) & 0x7f)
        .collect()
}

#[test]
fn config_is_validated() {
    assert!(CheckConfig::new(256, 1, 4096, AtomGrid::Aligned).is_ok());
    assert_eq!(
        CheckConfig::new(3, 1, 4096, AtomGrid::Aligned),
        Err(CheckError::BadAtom(3))
    );
    assert_eq!(
        CheckConfig::new(96, 1, 4096, AtomGrid::Aligned),
        Err(CheckError::BadAtom(96))
    );
    assert!(matches!(
        CheckConfig::new(8192, 1, 4096, AtomGrid::Aligned),
        Err(CheckError::BadPage { .. })
    ));
}

#[test]
fn clean_read_passes_and_full_signature_fails() {
    let c = cfg();
    let d = clean_bytes(5000, 3);
    assert_eq!(check_read(&d, 0x10_0003, 0x20_0101, &c), Ok(()));
    let mut sig = vec![0u8; 4096];
    tear(&mut sig, 0x30_0000, 0, 4096, &c);
    assert_eq!(
        check_read(&sig, 0x10_0000, 0x30_0000, &c),
        Err(Suspect::Magic { offset: 0 })
    );
}

#[test]
fn torn_last_atom_is_found_with_misaligned_remote() {
    let c = cfg();
    // Remote starts 100 bytes into an atom: first piece is 156 bytes.
    let remote = 0x40_0000 + 100;
    let mut d = clean_bytes(1000, 9);
    // Tear the atom that starts at remote offset 156 + 2*256 = 668.
    tear(&mut d, remote, 668, 924, &c);
    assert_eq!(
        check_read(&d, 0x9000, remote, &c),
        Err(Suspect::Magic { offset: 668 })
    );
}

#[test]
fn tiny_pieces_are_compared_bytewise() {
    let c = cfg();
    // 2 bytes at the very end of an atom, no aligned u32 inside.
    let remote = 0x1000 + 254;
    let mut d = vec![0x11, 0x22, 0x33, 0x44, 0x55];
    assert_eq!(check_read(&d, 0x2000, remote, &c), Ok(()));
    tear(&mut d, remote, 0, 2, &c);
    assert_eq!(
        check_read(&d, 0x2000, remote, &c),
        Err(Suspect::Magic { offset: 0 })
    );
    // A single byte that happens to match the magic byte is suspect too
    // (a cheap retry, never a missed fault).
    let one = [c.magic_byte(7)];
    assert!(check_read(&one, 7, 7, &c).is_err());
    assert_eq!(check_read(&[], 7, 7, &c), Ok(()));
}

#[test]
fn readback_rules() {
    let c = cfg();
    let src = clean_bytes(300, 1);
    assert_eq!(check_readback(&src, &src, 0x5000, &c), Ok(()));
    let mut rb = src.clone();
    rb[123] ^= 1;
    assert_eq!(
        check_readback(&src, &rb, 0x5000, &c),
        Err(Suspect::Mismatch { offset: 123 })
    );
    assert!(matches!(
        check_readback(&src, &rb[..10], 0x5000, &c),
        Err(Suspect::LengthMismatch { .. })
    ));
    // Source that itself carries the magic word: equal, but still suspect.
    let mut magic_src = src.clone();
    tear(&mut magic_src, 0x5000, 0, 8, &c);
    assert!(matches!(
        check_readback(&magic_src, &magic_src, 0x5000, &c),
        Err(Suspect::Magic { .. })
    ));
}

#[test]
fn version_rules() {
    assert_eq!(check_versions(&[1, 3, 5], &[1, 3, 5]), Ok(()));
    assert_eq!(
        check_versions(&[1, 3], &[1, 5]),
        Err(Suspect::VersionChanged {
            page: 1,
            before: 3,
            after: 5
        })
    );
    assert_eq!(
        check_versions(&[1, 2], &[1, 2]),
        Err(Suspect::VersionAbsent {
            page: 1,
            version: 2
        })
    );
    assert_eq!(
        check_versions(&[1], &[1, 1]),
        Err(Suspect::VersionCount {
            before: 1,
            after: 2
        })
    );
    assert_eq!(check_versions(&[], &[]), Ok(()));
}

#[test]
fn page_span_and_precheck() {
    assert_eq!(page_span(0x1000, 0x1000, 4096), Some((0x1000, 1)));
    assert_eq!(page_span(0x1fff, 2, 4096), Some((0x1000, 2)));
    assert_eq!(page_span(0x1234, 0, 4096), Some((0x1000, 0)));
    assert_eq!(page_span(u64::MAX - 10, 100, 4096), None);
    assert_eq!(precheck_local(0x1ff0, 0x20, 4096, |_| true), Ok(()));
    assert_eq!(
        precheck_local(0x1ff0, 0x20, 4096, |p| p != 0x2000),
        Err(Suspect::NotResident { page_addr: 0x2000 })
    );
    assert_eq!(
        precheck_local(u64::MAX, 2, 4096, |_| true),
        Err(Suspect::BadRange)
    );
}

#[test]
fn huge_atoms_do_not_overflow() {
    let atom = 1usize << (usize::BITS - 2);
    for grid in [AtomGrid::Aligned, AtomGrid::Both] {
        let c = CheckConfig::new(atom, 0xdead_beef, atom, grid).unwrap();
        let d = clean_bytes(300, 1);
        assert_eq!(check_read(&d, 0x1003, u64::MAX - 100, &c), Ok(()));
        let mut sig = d.clone();
        tear(&mut sig, 0x1000, 0, 300, &c);
        assert_eq!(
            check_read(&sig, 0x1000, 0x1000, &c),
            Err(Suspect::Magic { offset: 0 })
        );
    }
}

fn arb_cfg() -> impl Strategy<Value = CheckConfig> {
    (2u32..=10, any::<u32>()).prop_map(|(sh, magic)| {
        // Atoms 4 B .. 1 KiB, small pages so tears cross page boundaries.
        let atom = 1usize << sh;
        CheckConfig::new(atom, magic | 0x8080_8080, 4096.max(atom), AtomGrid::Aligned).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// A swap-out during a READ: every target atom from some atom boundary
    /// to the end of one page reads as signature. Always detected.
    #[test]
    fn suffix_tear_within_a_page_is_detected(
        c in arb_cfg(),
        remote in 0u64..(1 << 40), local in 0u64..(1 << 40),
        len in 1usize..9000, page_pick in any::<usize>(), atom_pick in any::<usize>(),
        seed in any::<u8>(), prefix in any::<bool>()
    ) {
        let mut d = clean_bytes(len, seed);
        prop_assert_eq!(check_read(&d, local, remote, &c), Ok(()));
        let ps = c.page_size() as u64;
        let (first, npages) = page_span(remote, len as u64, c.page_size()).unwrap();
        let page = first + (page_pick as u64 % npages) * ps;
        let lo = remote.max(page);
        let hi = (remote + len as u64).min(page + ps);
        // Atom boundaries of the target grid strictly inside (lo, hi).
        let atom = c.atom() as u64;
        let first_b = (lo / atom + 1) * atom;
        let nb = if first_b < hi { (hi - first_b).div_ceil(atom) } else { 0 };
        // Swap-out mid-transfer tears a suffix [cut, hi); swap-in tears a
        // prefix [lo, cut); `cut` is lo, an inner boundary, or hi.
        let cut = match atom_pick as u64 % (nb + 1) {
            0 if prefix => hi,
            0 => lo,
            i => first_b + (i - 1) * atom,
        };
        let (ts, te) = if prefix { (lo, cut) } else { (cut, hi) };
        prop_assume!(ts < te);
        tear(&mut d, remote, (ts - remote) as usize, (te - remote) as usize, &c);
        prop_assert!(check_read(&d, local, remote, &c).is_err(), "tear [{ts:#x},{te:#x}) missed");
    }

    /// Any random set of whole target atoms replaced by signature data is
    /// detected; with no torn atom the data passes.
    #[test]
    fn random_torn_atoms_are_detected(
        c in arb_cfg(), remote in 0u64..(1 << 30), local in 0u64..(1 << 30),
        len in 1usize..5000, mask in any::<u64>(), seed in any::<u8>()
    ) {
        let mut d = clean_bytes(len, seed);
        let atom = c.atom() as u64;
        let mut a = remote - remote % atom;
        let mut torn = false;
        let mut k = 0u32;
        while a < remote + len as u64 {
            let s = a.max(remote);
            let e = (a + atom).min(remote + len as u64);
            if mask.rotate_left(k) & 1 == 1 {
                tear(&mut d, remote, (s - remote) as usize, (e - remote) as usize, &c);
                torn = true;
            }
            a += atom;
            k += 1;
        }
        prop_assert_eq!(check_read(&d, local, remote, &c).is_err(), torn);
    }

    /// The initiator-side view: an absent local page shows signature bytes in
    /// the *local* alignment; tearing whole local atoms is detected too.
    #[test]
    fn local_view_tears_are_detected(
        c in arb_cfg(), remote in 0u64..(1 << 30), local in 0u64..(1 << 30),
        len in 1usize..5000, pick in any::<usize>(), seed in any::<u8>()
    ) {
        let mut d = clean_bytes(len, seed);
        let atom = c.atom() as u64;
        let n_atoms = ((local + len as u64 - 1) / atom) - local / atom + 1;
        let a = (local / atom + pick as u64 % n_atoms) * atom;
        let s = a.max(local);
        let e = (a + atom).min(local + len as u64);
        tear(&mut d, local, (s - local) as usize, (e - local) as usize, &c);
        prop_assert!(check_read(&d, local, remote, &c).is_err());
    }

    /// Engines that cut atoms from the transfer start are covered by
    /// `AtomGrid::Both`.
    #[test]
    fn relative_grid_tears_detected_with_both(
        sh in 2u32..=10, remote in 0u64..(1 << 30), len in 1usize..5000,
        pick in any::<usize>(), seed in any::<u8>()
    ) {
        let c = CheckConfig::new(1 << sh, 0xdeadbeef, 4096.max(1 << sh), AtomGrid::Both).unwrap();
        let atom = c.atom();
        let mut d = clean_bytes(len, seed);
        let k = pick % len.div_ceil(atom);
        let s = k * atom;
        let e = (s + atom).min(len);
        tear(&mut d, remote, s, e, &c);
        prop_assert!(check_read(&d, remote + 1, remote, &c).is_err());
    }

    #[test]
    fn versions_pass_iff_equal_and_odd(v in prop::collection::vec(any::<u32>(), 0..64), flip in any::<usize>(), bump in any::<bool>()) {
        let all_odd = v.iter().all(|x| x % 2 == 1);
        prop_assert_eq!(check_versions(&v, &v).is_ok(), all_odd);
        if !v.is_empty() && bump {
            let mut w = v.clone();
            let i = flip % w.len();
            w[i] = w[i].wrapping_add(2);
            prop_assert!(check_versions(&v, &w).is_err());
        }
    }
}

/// Independent byte model of the read check, straight from the module doc:
/// cut the data at every boundary of the target grid, the initiator grid
/// and (with `Both`) the transfer-relative grid; in each piece, for the
/// target's and the initiator's alignment, the first aligned `u32` is the
/// window, or every byte if none fits. First suspect piece wins.
fn model_check_read(data: &[u8], local: u64, remote: u64, c: &CheckConfig) -> Result<(), Suspect> {
    let atom = c.atom() as u64;
    let both = c.grid() == AtomGrid::Both;
    let is_cut = |i: usize| {
        let i64_ = i as u64;
        (remote + i64_) % atom == 0 || (local + i64_) % atom == 0 || (both && i64_ % atom == 0)
    };
    let mut s = 0;
    while s < data.len() {
        let mut e = s + 1;
        while e < data.len() && !is_cut(e) {
            e += 1;
        }
        for base in [remote, local] {
            let mut w = s;
            while (base + w as u64) % 4 != 0 {
                w += 1;
            }
            let magic = if w + 4 <= e {
                u32::from_le_bytes(data[w..w + 4].try_into().unwrap()) == c.magic()
            } else {
                (s..e).all(|j| data[j] == c.magic_byte(base + j as u64))
            };
            if magic {
                return Err(Suspect::Magic { offset: s });
            }
        }
        s = e;
    }
    Ok(())
}

/// Addresses for the agreement tests: congruent mod the atom (the fast
/// one-grid path), congruent mod 4 only, or anything.
fn arb_addrs(atom: usize) -> impl Strategy<Value = (u64, u64)> {
    let atom = atom as u64;
    (0u64..(1 << 30), 0u64..(1 << 20), 0u8..3).prop_map(move |(remote, k, kind)| {
        let local = match kind {
            0 => (remote + k * atom) % (1 << 30),
            1 => (remote + k * 4) % (1 << 30),
            _ => k.wrapping_mul(0x9e37_79b9) % (1 << 30),
        };
        (local, remote)
    })
}

/// Config, addresses, data: clean background with magic words planted at
/// random offsets (any alignment) and runs of signature bytes of random
/// phase and length (partial words, whole atoms).
fn arb_case() -> impl Strategy<Value = (CheckConfig, u64, u64, Vec<u8>)> {
    (2u32..=10, any::<u32>(), any::<bool>())
        .prop_flat_map(|(sh, magic, both)| {
            let atom = 1usize << sh;
            let grid = if both {
                AtomGrid::Both
            } else {
                AtomGrid::Aligned
            };
            let c = CheckConfig::new(atom, magic | 0x8080_8080, 4096.max(atom), grid).unwrap();
            (
                Just(c),
                arb_addrs(atom),
                1usize..6000,
                any::<u8>(),
                prop::collection::vec((any::<usize>(), 1usize..300, 0u8..4, any::<bool>()), 0..4),
            )
        })
        .prop_map(|(c, (local, remote), len, seed, plants)| {
            let mut d = clean_bytes(len, seed);
            let m = c.magic().to_le_bytes();
            for (at, run, phase, word) in plants {
                let s = at % len;
                if word {
                    // A whole magic word at an arbitrary offset.
                    for (j, b) in d[s..(s + 4).min(len)].iter_mut().enumerate() {
                        *b = m[j];
                    }
                } else {
                    let e = (s + run).min(len);
                    for (j, b) in d[s..e].iter_mut().enumerate() {
                        *b = m[(phase as usize + j) & 3];
                    }
                }
            }
            (c, local, remote, d)
        })
}

#[test]
fn fast_path_matches_walk_on_every_small_geometry() {
    // Exhaustive over residues for a small atom: every (local, remote)
    // residue pair, lengths around the fast-path threshold, one magic word
    // planted at every offset.
    for grid in [AtomGrid::Aligned, AtomGrid::Both] {
        let c = CheckConfig::new(16, 0xdead_beef, 4096, grid).unwrap();
        for rm in 0..16u64 {
            for lm in 0..16u64 {
                // Below and above the fast-path threshold (8 atoms).
                for len in [40usize, 77, 131, 150] {
                    let (local, remote) = (0x1000 + lm, 0x8000 + rm);
                    let clean = clean_bytes(len, 5);
                    assert_eq!(check_read(&clean, local, remote, &c), Ok(()));
                    for at in 0..len {
                        let mut d = clean.clone();
                        let m = c.magic().to_le_bytes();
                        for (j, b) in d[at..(at + 4).min(len)].iter_mut().enumerate() {
                            *b = m[j];
                        }
                        let want = model_check_read(&d, local, remote, &c);
                        assert_eq!(check_read_walk(&d, local, remote, &c), want);
                        assert_eq!(
                            check_read(&d, local, remote, &c),
                            want,
                            "{grid:?} rm {rm} lm {lm} len {len} magic at {at}"
                        );
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// The fast path (one-grid stride loop, multi-grid template) gives
    /// exactly the reference walk's answer, offset included, and both agree
    /// with the byte model.
    #[test]
    fn fast_path_agrees_with_walk_and_byte_model((c, local, remote, d) in arb_case()) {
        let fast = check_read(&d, local, remote, &c);
        let walk = check_read_walk(&d, local, remote, &c);
        prop_assert_eq!(fast, walk);
        prop_assert_eq!(fast, model_check_read(&d, local, remote, &c));
        // The read-back check uses the same scan on the target grid.
        prop_assert_eq!(check_readback(&d, &d, remote, &c), model_check_read(&d, remote, remote, &c));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Atoms above 4 KiB take the unspecialised loops of the fast path; they
    /// must agree with the walk too.
    #[test]
    fn large_atoms_agree_with_walk(
        sh in 13u32..=14, both in any::<bool>(), (local, remote) in arb_addrs(1 << 13),
        len in 1usize..70_000, seed in any::<u8>(),
        plants in prop::collection::vec((any::<usize>(), 0u8..3, 0usize..5, 0u8..4), 0..3)
    ) {
        let grid = if both { AtomGrid::Both } else { AtomGrid::Aligned };
        let atom = 1usize << sh;
        let c = CheckConfig::new(atom, 0xdead_beef, atom, grid).unwrap();
        let mut d = clean_bytes(len, seed);
        let m = c.magic().to_le_bytes();
        // Plant signature bytes near boundaries of one of the three grids,
        // where the windows are.
        for (k, which, jitter, phase) in plants {
            let base = match which {
                0 => remote as usize,
                1 => local as usize,
                _ => 0,
            } % atom;
            let s = ((k % (len / atom + 1)) * atom + (atom - base) % atom + jitter) % len;
            for (j, b) in d[s..(s + 6).min(len)].iter_mut().enumerate() {
                *b = m[(phase as usize + j) & 3];
            }
        }
        let fast = check_read(&d, local, remote, &c);
        prop_assert_eq!(fast, check_read_walk(&d, local, remote, &c));
        prop_assert_eq!(fast, model_check_read(&d, local, remote, &c));
    }
}
