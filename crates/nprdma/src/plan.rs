//! The planner: how one application work request maps to NIC work requests
//! (crate docs § 3). Pure decisions, no I/O: the engine asks
//! [`choose`] for a [`Strategy`], [`nic_steps`] for the NIC WRs to post in a
//! row on the data QP (at most [`MAX_NIC_WRS`], which is why the NIC QP is
//! three times as deep as the application's), and [`order_desc`] for the
//! ordering table's view of the WR.

use crate::keymap::Translation;
use crate::nic::WrOp;
use crate::ordering::{OpDesc, Range};

/// Most NIC WRs one application WR turns into on the data QP.
pub const MAX_NIC_WRS: usize = 3;

/// Application operation: the verbs operation itself ([`WrOp`]). The
/// planner maps one onto at most [`MAX_NIC_WRS`] NIC WRs of the same
/// vocabulary.
pub use crate::nic::WrOp as AppOp;

/// Tuning of the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanConfig {
    /// WRITEs longer than this use page versions instead of a read-back.
    pub write_version_threshold: u64,
    /// READs longer than this use page versions instead of per-atom magic
    /// checks (`None`: always magic).
    pub read_version_threshold: Option<u64>,
    /// Largest payload sent inline on the control channel (two-sided).
    pub inline_max: u64,
    /// No IOMMU control: every operation is two-sided.
    pub user_space_mode: bool,
    /// READs at least this long, on a QP whose last such READ met a page
    /// out, first read the target pages' versions
    /// ([`Strategy::VersionProbe`]) and go two-sided at once if a page is
    /// out, instead of copying signature frames first (`None`: never); a
    /// probe that finds every page in stops the probing, so a QP without
    /// faults never probes. The probe is a round trip through the engine
    /// (≈ 3 µs on the software NIC); it saves the copy of the signature
    /// view (≈ 6 µs at 64 KiB) and, in a window of READs into one buffer,
    /// the optimistic copies of every READ replayed behind a failed one.
    /// (WRITEs are not probed: a WRITE into the black hole copies nothing.)
    pub probe_min: Option<u64>,
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            write_version_threshold: 16 * 1024,
            read_version_threshold: None,
            inline_max: crate::ctrl::DEFAULT_MAX_INLINE as u64,
            user_space_mode: false,
            probe_min: Some(64 << 10),
        }
    }
}

/// How the operation is attempted first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// 1 READ, then [`crate::check::check_read`].
    ReadMagic,
    /// READ versions, READ data, READ versions; [`crate::check::check_versions`].
    ReadVersioned,
    /// WRITE, then a READ-back into a temporary buffer
    /// ([`crate::check::check_readback`]); `deferred` = unsignaled WRITE whose
    /// read-back waits for the next signaled WR of the QP.
    WriteReadback {
        /// The read-back waits for the next signaled WR.
        deferred: bool,
    },
    /// READ versions, WRITE, READ versions (also WRITE_WITH_IMM, followed by
    /// the notification on the control channel).
    WriteVersioned,
    /// Two-sided from the start.
    TwoSided(TwoSided),
    /// READ the target pages' versions only; if all are odd (resident and
    /// mapped) the operation continues with [`choose`]'s strategy, otherwise
    /// it goes two-sided without moving the data one-sided first.
    VersionProbe,
    /// User-space mode: one READ/WRITE through the target's registration of
    /// the range, lent to this initiator for a while (a lease), from a
    /// temporary MR of the local range: the pages at both ends are pinned,
    /// so nothing is checked (the engine posts it itself).
    Leased,
}

/// Two-sided forms (control-channel message that starts them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TwoSided {
    /// Atomic executed by the target CPU.
    Atomic,
    /// SEND with inline data.
    SendInline,
    /// SEND by rendezvous (receiver reverse-READs).
    SendRendezvous,
    /// READ/WRITE with inline data (≤ inline_max).
    Inline,
    /// READ/WRITE through a fault request and a reverse operation.
    Reverse,
}

/// First strategy for an operation of `len` bytes.
#[inline]
pub fn choose(op: AppOp, len: u64, signaled: bool, cfg: &PlanConfig) -> Strategy {
    match op {
        AppOp::CmpSwap { .. } | AppOp::FetchAdd { .. } => Strategy::TwoSided(TwoSided::Atomic),
        AppOp::Send | AppOp::SendImm(_) if len <= cfg.inline_max => {
            Strategy::TwoSided(TwoSided::SendInline)
        }
        AppOp::Send | AppOp::SendImm(_) => Strategy::TwoSided(TwoSided::SendRendezvous),
        AppOp::Read | AppOp::Write | AppOp::WriteImm(_) if cfg.user_space_mode => {
            Strategy::TwoSided(fallback(len, cfg))
        }
        AppOp::Read => match cfg.read_version_threshold {
            Some(t) if len > t => Strategy::ReadVersioned,
            _ => Strategy::ReadMagic,
        },
        AppOp::WriteImm(_) => Strategy::WriteVersioned,
        AppOp::Write if len > cfg.write_version_threshold => Strategy::WriteVersioned,
        AppOp::Write => Strategy::WriteReadback {
            deferred: !signaled,
        },
    }
}

/// Whether an operation of `len` bytes starts with a [`Strategy::VersionProbe`].
#[inline]
pub fn probes_first(op: AppOp, len: u64, cfg: &PlanConfig) -> bool {
    !cfg.user_space_mode && op == AppOp::Read && cfg.probe_min.is_some_and(|m| len >= m)
}

/// Two-sided form of a READ/WRITE whose optimistic attempt failed.
pub fn fallback(len: u64, cfg: &PlanConfig) -> TwoSided {
    if len <= cfg.inline_max {
        TwoSided::Inline
    } else {
        TwoSided::Reverse
    }
}

/// Which local memory a NIC WR uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalBuf {
    /// The application's SG list through its local Read MR view (absent
    /// pages read as signature).
    AppRead,
    /// The application's SG list through its local Write MR view (writes to
    /// absent pages vanish).
    AppWrite,
    /// The QP's pinned temporary buffer (read-backs).
    Temp,
    /// The QP's pinned version scratch words: before / after.
    VersionsBefore,
    /// The version words after.
    VersionsAfter,
}

/// Role of a NIC WR in its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepRole {
    /// The application's data.
    Data,
    /// A read-back of written data.
    Readback,
    /// The page versions before.
    VersionsBefore,
    /// The page versions after.
    VersionsAfter,
}

/// One NIC WR to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NicStep {
    /// What the WR is for.
    pub role: StepRole,
    /// The NIC operation.
    pub op: WrOp,
    /// Its local buffer.
    pub local: LocalBuf,
    /// Length in bytes.
    pub len: u64,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// The NIC WRs of a one-sided strategy, in posting order (empty for
/// two-sided and for the deferred part of an unsignaled WRITE: the engine
/// posts its [`readback_step`] later). WRITE_WITH_IMM is posted as a plain
/// WRITE: the immediate travels in the control-channel notification.
pub fn nic_steps(s: Strategy, remote_addr: u64, len: u64, t: &Translation) -> Vec<NicStep> {
    nic_steps_small(s, remote_addr, len, t).into_vec()
}

/// [`nic_steps`] without a heap allocation (at most 3 steps), for the
/// engine's per-operation fast path.
#[inline]
pub fn nic_steps_small(
    s: Strategy,
    remote_addr: u64,
    len: u64,
    t: &Translation,
) -> smallvec::SmallVec<[NicStep; 3]> {
    use smallvec::smallvec as vec;
    let data_read = NicStep {
        role: StepRole::Data,
        op: WrOp::Read,
        local: LocalBuf::AppWrite,
        len,
        remote_addr,
        rkey: t.read_rkey,
    };
    let data_write = NicStep {
        role: StepRole::Data,
        op: WrOp::Write,
        local: LocalBuf::AppRead,
        len,
        remote_addr,
        rkey: t.write_rkey,
    };
    let ver = |role, local| NicStep {
        role,
        op: WrOp::Read,
        local,
        len: t.version_len,
        remote_addr: t.version_addr,
        rkey: t.version_rkey,
    };
    let before = ver(StepRole::VersionsBefore, LocalBuf::VersionsBefore);
    let after = ver(StepRole::VersionsAfter, LocalBuf::VersionsAfter);
    match s {
        Strategy::ReadMagic => vec![data_read],
        Strategy::ReadVersioned => vec![before, data_read, after],
        Strategy::WriteReadback { deferred: false } => {
            vec![data_write, readback_step(remote_addr, len, t)]
        }
        Strategy::WriteReadback { deferred: true } => vec![data_write],
        Strategy::WriteVersioned => vec![before, data_write, after],
        Strategy::VersionProbe => vec![before],
        Strategy::TwoSided(_) | Strategy::Leased => smallvec::SmallVec::new(),
    }
}

/// The read-back READ of a small WRITE (through the app rkey, i.e. the
/// target's Read MR, so absent pages show magic) into the temporary buffer.
pub fn readback_step(remote_addr: u64, len: u64, t: &Translation) -> NicStep {
    NicStep {
        role: StepRole::Readback,
        op: WrOp::Read,
        local: LocalBuf::Temp,
        len,
        remote_addr,
        rkey: t.read_rkey,
    }
}

/// The ordering table's view of an application WR with one local range. A
/// READ of at most `inline_max` bytes is answered inline on the two-sided
/// path (the CPU copies the answer), so its answer can be dropped when a
/// later READ supersedes it ([`OpDesc::suppressible`]).
pub fn order_desc(
    op: AppOp,
    local: Range,
    remote: Range,
    order_before: bool,
    order_after: bool,
    inline_max: u64,
) -> OpDesc {
    let d = match op {
        AppOp::Read => OpDesc::read(local, remote),
        AppOp::Write => OpDesc::write(local, remote),
        AppOp::WriteImm(_) => OpDesc::write_imm(local, remote),
        AppOp::Send | AppOp::SendImm(_) => OpDesc::send(local),
        AppOp::CmpSwap { .. } | AppOp::FetchAdd { .. } => OpDesc::atomic(local.addr, remote.addr),
    };
    d.order_before(order_before)
        .order_after(order_after)
        .suppressible(op == AppOp::Read && local.len <= inline_max)
}

/// An unsignaled WRITE whose read-back is deferred to the next signaled WR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeferredWrite {
    /// Caller's handle (e.g. the ordering ticket).
    pub id: u64,
    /// Target address.
    pub remote_addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Read MR rkey (app rkey) to read it back through.
    pub rkey: u32,
}

/// One read-back READ covering consecutive deferred WRITEs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadbackBatch {
    /// Start of the covered range.
    pub remote_addr: u64,
    /// Length of the covered range.
    pub len: u64,
    /// Read MR rkey (app rkey).
    pub rkey: u32,
    /// Indices (into the deferred list) of the WRITEs it covers; the data of
    /// member `i` is at offset `w.remote_addr - batch.remote_addr`.
    pub members: std::ops::Range<usize>,
}

/// Group deferred WRITEs (in post order) into read-back READs: consecutive
/// WRITEs whose remote ranges are contiguous under the same rkey share one
/// READ, as long as it fits the `max_bytes` temporary buffer (a single WRITE
/// larger than that gets its own READ; the caller reads it in pieces).
pub fn batch_readbacks(deferred: &[DeferredWrite], max_bytes: u64) -> Vec<ReadbackBatch> {
    let mut out: Vec<ReadbackBatch> = Vec::new();
    for (i, w) in deferred.iter().enumerate() {
        if let Some(b) = out.last_mut() {
            let contiguous =
                b.rkey == w.rkey && b.remote_addr.checked_add(b.len) == Some(w.remote_addr);
            if contiguous && b.len.saturating_add(w.len) <= max_bytes {
                b.len += w.len;
                b.members.end = i + 1;
                continue;
            }
        }
        out.push(ReadbackBatch {
            remote_addr: w.remote_addr,
            len: w.len,
            rkey: w.rkey,
            members: i..i + 1,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::{any, prop_assert, prop_assert_eq, proptest};

    use super::*;

    fn tr() -> Translation {
        Translation {
            read_rkey: 1,
            write_rkey: 2,
            version_rkey: 3,
            first_page: 5,
            page_count: 2,
            version_addr: 0x9014,
            version_len: 8,
        }
    }

    #[test]
    fn only_large_reads_probe_first() {
        let c = PlanConfig::default();
        assert!(probes_first(AppOp::Read, 64 << 10, &c));
        assert!(!probes_first(AppOp::Read, (64 << 10) - 1, &c));
        assert!(!probes_first(AppOp::Write, 8 << 20, &c));
        assert!(!probes_first(AppOp::WriteImm(1), 8 << 20, &c));
        let off = PlanConfig {
            probe_min: None,
            ..c
        };
        assert!(!probes_first(AppOp::Read, 8 << 20, &off));
        let us = PlanConfig {
            user_space_mode: true,
            ..c
        };
        assert!(!probes_first(AppOp::Read, 8 << 20, &us));
        let s = nic_steps(Strategy::VersionProbe, 0x5000, 8192, &tr());
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].rkey, s[0].remote_addr, s[0].len), (3, 0x9014, 8));
    }

    #[test]
    fn paper_mapping_of_ops() {
        let c = PlanConfig::default();
        assert_eq!(choose(AppOp::Read, 8 << 20, true, &c), Strategy::ReadMagic);
        assert_eq!(
            choose(AppOp::Write, 4096, true, &c),
            Strategy::WriteReadback { deferred: false }
        );
        assert_eq!(
            choose(AppOp::Write, 4096, false, &c),
            Strategy::WriteReadback { deferred: true }
        );
        assert_eq!(
            choose(AppOp::Write, 1 << 20, true, &c),
            Strategy::WriteVersioned
        );
        assert_eq!(
            choose(AppOp::WriteImm(7), 8, true, &c),
            Strategy::WriteVersioned
        );
        assert_eq!(
            choose(AppOp::FetchAdd { add: 1 }, 8, true, &c),
            Strategy::TwoSided(TwoSided::Atomic)
        );
        assert_eq!(
            choose(AppOp::Send, 1024, true, &c),
            Strategy::TwoSided(TwoSided::SendInline)
        );
        assert_eq!(
            choose(AppOp::SendImm(1), 1025, true, &c),
            Strategy::TwoSided(TwoSided::SendRendezvous)
        );
        let v = PlanConfig {
            read_version_threshold: Some(65536),
            ..c
        };
        assert_eq!(
            choose(AppOp::Read, 65537, true, &v),
            Strategy::ReadVersioned
        );
        let us = PlanConfig {
            user_space_mode: true,
            ..c
        };
        assert_eq!(
            choose(AppOp::Read, 100, true, &us),
            Strategy::TwoSided(TwoSided::Inline)
        );
        assert_eq!(
            choose(AppOp::Write, 1 << 20, true, &us),
            Strategy::TwoSided(TwoSided::Reverse)
        );
    }

    #[test]
    fn steps_use_the_right_keys_and_views() {
        let t = tr();
        let s = nic_steps(Strategy::WriteReadback { deferred: false }, 0x1000, 64, &t);
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].op, s[0].rkey, s[0].local),
            (WrOp::Write, 2, LocalBuf::AppRead)
        );
        assert_eq!(
            (s[1].op, s[1].rkey, s[1].local),
            (WrOp::Read, 1, LocalBuf::Temp)
        );
        let s = nic_steps(Strategy::ReadMagic, 0x1000, 64, &t);
        assert_eq!(
            (s[0].op, s[0].rkey, s[0].local),
            (WrOp::Read, 1, LocalBuf::AppWrite)
        );
        let s = nic_steps(Strategy::WriteVersioned, 0x1000, 8192, &t);
        assert_eq!(
            s.iter().map(|x| x.role).collect::<Vec<_>>(),
            vec![
                StepRole::VersionsBefore,
                StepRole::Data,
                StepRole::VersionsAfter
            ]
        );
        assert_eq!((s[0].remote_addr, s[0].len, s[0].rkey), (0x9014, 8, 3));
        assert_eq!(s[1].rkey, 2);
        assert!(nic_steps(Strategy::TwoSided(TwoSided::Atomic), 0, 8, &t).is_empty());
        assert_eq!(
            nic_steps(Strategy::WriteReadback { deferred: true }, 0, 8, &t).len(),
            1
        );
    }

    #[test]
    fn deferred_readbacks_merge_contiguous_writes() {
        let w = |id, a, l, k| DeferredWrite {
            id,
            remote_addr: a,
            len: l,
            rkey: k,
        };
        let d = [
            w(0, 0x1000, 64, 1),
            w(1, 0x1040, 64, 1),
            w(2, 0x1080, 128, 1),
            w(3, 0x2000, 8, 1), // gap
            w(4, 0x2008, 8, 2), // other key
            w(5, 0x2010, 8, 2),
        ];
        let b = batch_readbacks(&d, 4096);
        assert_eq!(
            b.iter()
                .map(|x| (x.remote_addr, x.len, x.members.clone()))
                .collect::<Vec<_>>(),
            vec![(0x1000, 256, 0..3), (0x2000, 8, 3..4), (0x2008, 16, 4..6)]
        );
        // The temporary-buffer cap splits a run.
        let b = batch_readbacks(&d[..3], 128);
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].len, b[1].len), (128, 128));
        assert!(batch_readbacks(&[], 64).is_empty());
    }

    proptest! {
        #[test]
        fn batches_cover_every_write_once_in_order(
            ws in proptest::collection::vec((0u64..3, 1u64..300, 0u32..2), 0..40), cap in 1u64..2000
        ) {
            let mut addr = 0x10000u64;
            let d: Vec<DeferredWrite> = ws.iter().enumerate().map(|(i, &(gap, len, rkey))| {
                addr += gap * 8;
                let w = DeferredWrite { id: i as u64, remote_addr: addr, len, rkey };
                addr += len;
                w
            }).collect();
            let b = batch_readbacks(&d, cap);
            let mut next = 0;
            for batch in &b {
                prop_assert_eq!(batch.members.start, next);
                next = batch.members.end;
                let ms = &d[batch.members.clone()];
                prop_assert!(batch.len <= cap || ms.len() == 1);
                prop_assert_eq!(batch.len, ms.iter().map(|w| w.len).sum::<u64>());
                let mut a = batch.remote_addr;
                for w in ms {
                    prop_assert_eq!(w.remote_addr, a);
                    prop_assert_eq!(w.rkey, batch.rkey);
                    a += w.len;
                }
            }
            prop_assert_eq!(next, d.len());
        }

        #[test]
        fn never_more_than_three_nic_wrs_and_writes_use_the_write_key(
            k in 0u8..7, len in 0u64..(1 << 24), signaled in any::<bool>(),
            us in any::<bool>(), rv in proptest::option::of(0u64..(1 << 22))
        ) {
            let op = match k {
                0 => AppOp::Read,
                1 => AppOp::Write,
                2 => AppOp::WriteImm(1),
                3 => AppOp::Send,
                4 => AppOp::SendImm(1),
                5 => AppOp::CmpSwap { compare: 0, swap: 1 },
                _ => AppOp::FetchAdd { add: 1 },
            };
            let cfg = PlanConfig { user_space_mode: us, read_version_threshold: rv, ..PlanConfig::default() };
            let s = choose(op, len, signaled, &cfg);
            let steps = nic_steps(s, 0x1000, len, &tr());
            prop_assert!(steps.len() <= MAX_NIC_WRS);
            for st in &steps {
                match st.op {
                    WrOp::Write => prop_assert_eq!(st.rkey, tr().write_rkey),
                    WrOp::Read if st.role == StepRole::Data || st.role == StepRole::Readback => {
                        prop_assert_eq!(st.rkey, tr().read_rkey)
                    }
                    WrOp::Read => prop_assert_eq!(st.rkey, tr().version_rkey),
                    other => prop_assert!(false, "unexpected NIC op {:?}", other),
                }
            }
            // Non-idempotent and message ops never go one-sided.
            if matches!(op, AppOp::CmpSwap { .. } | AppOp::FetchAdd { .. } | AppOp::Send | AppOp::SendImm(_)) || us {
                prop_assert!(steps.is_empty());
            }
        }
    }
}
