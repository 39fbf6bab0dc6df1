//! Property test: random sequences of operations over random buffers, checked
//! byte-exactly against a sequential model, with exactly one completion per signaled
//! WR (and none for unsignaled ones), on both data paths.

mod common;
use common::*;
use proptest::prelude::*;
use rnic::*;

const L: usize = 8192;
const R: usize = 8192;
const RV: usize = 4 * 2048;

#[derive(Clone, Debug)]
enum Op {
    Write {
        lo: usize,
        ro: usize,
        len: usize,
    },
    Read {
        lo: usize,
        ro: usize,
        len: usize,
    },
    Send {
        lo: usize,
        len: usize,
        imm: Option<u32>,
    },
    WriteImm {
        lo: usize,
        ro: usize,
        len: usize,
        imm: u32,
    },
    FetchAdd {
        slot: usize,
        lo: usize,
        add: u64,
    },
    CmpSwap {
        slot: usize,
        lo: usize,
        hit: bool,
        swap: u64,
    },
}

fn op() -> impl Strategy<Value = (Op, bool)> {
    let rw = (0..L, 0..R, 0usize..3000).prop_map(|(lo, ro, len)| {
        let len = len.min(L - lo).min(R - ro);
        (lo, ro, len)
    });
    let o = prop_oneof![
        3 => rw.clone().prop_map(|(lo, ro, len)| Op::Write { lo, ro, len }),
        3 => rw.clone().prop_map(|(lo, ro, len)| Op::Read { lo, ro, len }),
        1 => (0..L, 0usize..2048, any::<Option<u32>>()).prop_map(|(lo, len, imm)| Op::Send { lo, len: len.min(L - lo), imm }),
        1 => (rw, any::<u32>()).prop_map(|((lo, ro, len), imm)| Op::WriteImm { lo, ro, len, imm }),
        1 => (0usize..8, 0usize..L / 8, any::<u64>()).prop_map(|(slot, lo, add)| Op::FetchAdd { slot, lo: lo * 8, add }),
        1 => (0usize..8, 0usize..L / 8, any::<bool>(), any::<u64>()).prop_map(|(slot, lo, hit, swap)| Op::CmpSwap { slot, lo: lo * 8, hit, swap }),
    ];
    (o, any::<bool>())
}

fn same(got: &[u8], exp: &[u8], what: &str) {
    if let Some(i) = got.iter().zip(exp).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {} expected {}",
            got[i], exp[i]
        );
    }
}

fn run(cfg: HostConfig, seed: u8, ops: Vec<(Op, bool)>) {
    let (a, b) = pair_cfg(cfg);
    let mut ml = pattern(L, seed);
    let mut mr = pattern(R, seed.wrapping_add(77));
    let mut ma = vec![0u64; 8];
    let mut mrv = vec![0u8; RV];
    let lb = buf(&a.pd, L, 0);
    lb.write(0, &ml);
    let rb = buf(&b.pd, R, 0);
    rb.write(0, &mr);
    let ab = buf(&b.pd, 64, 0);
    let rvb = buf(&b.pd, RV, 0);
    // receives for every SEND / WRITE_WITH_IMM
    let nrecv = ops
        .iter()
        .filter(|(o, _)| matches!(o, Op::Send { .. } | Op::WriteImm { .. }))
        .count();
    let rsges: Vec<[Sge; 1]> = (0..nrecv).map(|i| [rvb.sge((i % 4) * 2048, 2048)]).collect();
    let rwrs: Vec<RecvWr> = rsges
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: 1000 + i as u64,
            sg_list: s,
        })
        .collect();
    b.qp.post_recv(&rwrs).unwrap();
    let mut sges: Vec<[Sge; 1]> = Vec::new();
    for (o, _) in &ops {
        let s = match *o {
            Op::Write { lo, len, .. }
            | Op::Read { lo, len, .. }
            | Op::Send { lo, len, .. }
            | Op::WriteImm { lo, len, .. } => lb.sge(lo, len as u32),
            Op::FetchAdd { lo, .. } | Op::CmpSwap { lo, .. } => lb.sge(lo, 8),
        };
        sges.push([s]);
    }
    let mut wrs = Vec::new();
    let mut expect_wc = Vec::new();
    let mut expect_recv = Vec::new();
    let mut recv_i = 0usize;
    let n = ops.len();
    for (i, (o, sig)) in ops.iter().enumerate() {
        let signaled = *sig || i + 1 == n;
        let flags = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        let ra = rb.addr() as u64;
        let wr = match *o {
            Op::Write { lo, ro, len } => {
                mr[ro..ro + len].copy_from_slice(&ml[lo..lo + len]);
                SendWr::new(i as u64, WrOpcode::Write, &sges[i]).remote(ra + ro as u64, rb.rkey())
            }
            Op::Read { lo, ro, len } => {
                ml[lo..lo + len].copy_from_slice(&mr[ro..ro + len]);
                SendWr::new(i as u64, WrOpcode::Read, &sges[i]).remote(ra + ro as u64, rb.rkey())
            }
            Op::Send { lo, len, imm } => {
                let off = (recv_i % 4) * 2048;
                mrv[off..off + len].copy_from_slice(&ml[lo..lo + len]);
                expect_recv.push((1000 + recv_i as u64, WcOpcode::Recv, len as u32, imm));
                recv_i += 1;
                let opc = match imm {
                    Some(x) => WrOpcode::SendImm(x),
                    None => WrOpcode::Send,
                };
                SendWr::new(i as u64, opc, &sges[i])
            }
            Op::WriteImm { lo, ro, len, imm } => {
                mr[ro..ro + len].copy_from_slice(&ml[lo..lo + len]);
                expect_recv.push((1000 + recv_i as u64, WcOpcode::RecvRdmaWithImm, len as u32, Some(imm)));
                recv_i += 1;
                SendWr::new(i as u64, WrOpcode::WriteImm(imm), &sges[i]).remote(ra + ro as u64, rb.rkey())
            }
            Op::FetchAdd { slot, lo, add } => {
                ml[lo..lo + 8].copy_from_slice(&ma[slot].to_le_bytes());
                ma[slot] = ma[slot].wrapping_add(add);
                SendWr::new(i as u64, WrOpcode::FetchAdd { add }, &sges[i])
                    .remote(ab.addr() as u64 + 8 * slot as u64, ab.rkey())
            }
            Op::CmpSwap { slot, lo, hit, swap } => {
                let compare = if hit { ma[slot] } else { ma[slot] ^ 1 };
                ml[lo..lo + 8].copy_from_slice(&ma[slot].to_le_bytes());
                if hit {
                    ma[slot] = swap;
                }
                SendWr::new(i as u64, WrOpcode::CmpSwap { compare, swap }, &sges[i])
                    .remote(ab.addr() as u64 + 8 * slot as u64, ab.rkey())
            }
        };
        if signaled {
            expect_wc.push(i as u64);
        }
        wrs.push(wr.flags(flags));
    }
    a.qp.post_send(&wrs).unwrap();
    let got = a.cq.poll_wait(expect_wc.len(), T).unwrap();
    for w in &got {
        assert_eq!(w.status, WcStatus::Success, "{w:?}");
    }
    assert_eq!(
        got.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        expect_wc,
        "one completion per signaled WR, in order"
    );
    let rgot = b.rcq.poll_wait(expect_recv.len(), T).unwrap();
    for (w, &(id, opc, len, imm)) in rgot.iter().zip(&expect_recv) {
        assert_eq!(
            (w.status, w.wr_id, w.opcode, w.byte_len),
            (WcStatus::Success, id, opc, len)
        );
        assert_eq!(imm.is_some(), w.wc_flags.contains(WcFlags::WITH_IMM));
        if let Some(x) = imm {
            assert_eq!(w.imm_data, x);
        }
    }
    assert_empty(&a.cq);
    assert_empty(&b.rcq);
    same(&lb.to_vec(0, L), &ml, "local buffer");
    same(&rb.to_vec(0, R), &mr, "remote buffer");
    let av: Vec<u64> = (0..8)
        .map(|s| u64::from_le_bytes(ab.to_vec(8 * s, 8).try_into().unwrap()))
        .collect();
    assert_eq!(av, ma, "atomic slots");
    if expect_recv.len() <= 4 {
        same(&rvb.to_vec(0, RV), &mrv, "receive buffer");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn random_ops_match_model_direct(seed in any::<u8>(), ops in prop::collection::vec(op(), 1..40)) {
        run(HostConfig::default(), seed, ops);
    }

    #[test]
    fn random_ops_match_model_ring(seed in any::<u8>(), ops in prop::collection::vec(op(), 1..40)) {
        run(ring_cfg(), seed, ops);
    }

    /// Target-enforced protection: every op through the target's ring, in parts of a
    /// small slot (so messages and transfers span many parts).
    #[test]
    fn random_ops_match_model_target_enforced(seed in any::<u8>(), ops in prop::collection::vec(op(), 1..40)) {
        run(HostConfig { ring_max: 4096, ring_slots: 4, ..secure_cfg() }, seed, ops);
    }
}
