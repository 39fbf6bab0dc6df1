//! The contract tests of the [`crate::nic`] traits, for any backend: the
//! verbs NP-RDMA relies on ([`verbs_contract`]), owned buffers and QP access
//! changes ([`buffers_and_access_contract`]), IOMMU control
//! ([`iommu_contract`]). Compiled for this crate's tests and, with the
//! `contract` feature, for other crates' (a backend living elsewhere, e.g.
//! `ibverbs-nic`, runs the same contract). Each function panics at the
//! first broken promise.

use std::time::{Duration, Instant};

use super::{
    Access, CompOp, Completion, Frame, IommuControl, Nic, NicBuf, NicCq, NicMr, NicQp, QpSpec,
    RecvRequest, Sge, WcStatus, WorkRequest, WrOp,
};

/// Wait for one completion on `cq` (panics after 5 s).
pub fn one<C: NicCq>(cq: &C) -> Completion {
    let t0 = Instant::now();
    let mut c = [Completion::default(); 1];
    while t0.elapsed() < Duration::from_secs(5) {
        if cq.poll(&mut c).expect("poll") == 1 {
            return c[0];
        }
        std::thread::yield_now();
    }
    panic!("no completion within 5 s");
}

/// A signaled WR of `op` over `sg` to `raddr` under `rkey`.
pub fn wr(wr_id: u64, op: WrOp, sg: &[Sge], raddr: u64, rkey: u32) -> WorkRequest<'_> {
    WorkRequest {
        wr_id,
        op,
        sg_list: sg,
        remote_addr: raddr,
        rkey,
        signaled: true,
        fence: false,
        inline: false,
    }
}

/// The verbs contract NP-RDMA relies on, for any [`Nic`]: one-sided
/// WRITE/READ/atomic, SEND with immediate (gathered and inline) into
/// posted RECVs, remote access errors as completions, flush on ERR.
pub fn verbs_contract<N: Nic>(a: &N, b: &N) {
    let (qa, qb, ca, cb) = connected(a, b);
    let rights = ALL_REMOTE;
    let mut la = vec![0u8; 4096];
    let mut lb = vec![0u8; 4096];
    let acc = Access::LOCAL_WRITE | rights;
    // SAFETY: both vectors outlive their MRs (dropped at the end of
    // this function, MRs first: declared later).
    #[allow(unsafe_code)]
    let (ma, mb) = unsafe {
        (
            a.reg_mr(la.as_mut_ptr() as u64, 4096, acc).expect("mr a"),
            b.reg_mr(lb.as_mut_ptr() as u64, 4096, acc).expect("mr b"),
        )
    };
    let sge = |m: &N::Mr, off: u64, len: u32| Sge {
        addr: m.addr() + off,
        length: len,
        lkey: m.lkey(),
    };
    for (i, x) in la.iter_mut().enumerate().take(64) {
        *x = i as u8 + 1;
    }
    // WRITE a[0..64] → b[100..164].
    let s = [sge(&ma, 0, 64)];
    qa.post_send(&[wr(1, WrOp::Write, &s, mb.addr() + 100, mb.rkey())])
        .expect("post write");
    let c = one(&ca);
    assert_eq!((c.wr_id, c.status, c.op), (1, 0, CompOp::Write));
    assert_eq!(&lb[100..164], &la[..64]);
    // READ b[100..164] → a[1000..1064], gathered into two SGEs.
    let s = [sge(&ma, 1000, 32), sge(&ma, 2000, 32)];
    qa.post_send(&[wr(2, WrOp::Read, &s, mb.addr() + 100, mb.rkey())])
        .expect("post read");
    let c = one(&ca);
    assert_eq!(
        (c.wr_id, c.status, c.op, c.byte_len),
        (2, 0, CompOp::Read, 64)
    );
    assert_eq!(&la[1000..1032], &la[..32]);
    assert_eq!(&la[2000..2032], &la[32..64]);
    // FETCH_ADD on b[512] (8-aligned in the MR).
    lb[512..520].copy_from_slice(&5u64.to_le_bytes());
    let s = [sge(&ma, 3000, 8)];
    qa.post_send(&[wr(
        3,
        WrOp::FetchAdd { add: 2 },
        &s,
        mb.addr() + 512,
        mb.rkey(),
    )])
    .expect("post atomic");
    let c = one(&ca);
    assert_eq!((c.wr_id, c.status, c.op), (3, 0, CompOp::FetchAdd));
    assert_eq!(la[3000..3008], 5u64.to_le_bytes());
    assert_eq!(lb[512..520], 7u64.to_le_bytes());
    // SEND with immediate into a posted RECV, then an inline SEND.
    let r = [sge(&mb, 1024, 128)];
    let r2 = [sge(&mb, 2048, 128)];
    qb.post_recv(&[
        RecvRequest {
            wr_id: 40,
            sg_list: &r,
        },
        RecvRequest {
            wr_id: 41,
            sg_list: &r2,
        },
    ])
    .expect("post recv");
    let s = [sge(&ma, 0, 16)];
    // Inline: no lkey, the bytes are copied at post time.
    let data = [Sge {
        addr: la.as_ptr() as u64 + 16,
        length: 8,
        lkey: 0,
    }];
    let inline = WorkRequest {
        inline: true,
        ..wr(5, WrOp::Send, &data, 0, 0)
    };
    qa.post_send(&[wr(4, WrOp::SendImm(99), &s, 0, 0), inline])
        .expect("post sends");
    let (c1, c2) = (one(&ca), one(&ca));
    assert_eq!((c1.wr_id, c1.status, c2.wr_id, c2.status), (4, 0, 5, 0));
    let r1 = one(&cb);
    assert_eq!(
        (r1.wr_id, r1.status, r1.op, r1.byte_len, r1.imm),
        (40, 0, CompOp::Recv, 16, Some(99))
    );
    let r2 = one(&cb);
    assert_eq!(
        (r2.wr_id, r2.status, r2.op, r2.byte_len),
        (41, 0, CompOp::Recv, 8)
    );
    assert_eq!(&lb[1024..1040], &la[..16]);
    assert_eq!(&lb[2048..2056], &la[16..24]);
    // In ERR, posted RECVs flush (a second pair: ERR is for good).
    let qa2 = a.create_qp(&SPEC, &ca, &ca).expect("qp a2");
    let qb2 = b.create_qp(&SPEC, &cb, &cb).expect("qp b2");
    qa2.connect(b.addr(), qb2.qpn(), rights)
        .expect("connect a2");
    qb2.connect(a.addr(), qa2.qpn(), rights)
        .expect("connect b2");
    qb2.post_recv(&[RecvRequest {
        wr_id: 42,
        sg_list: &r,
    }])
    .expect("post recv");
    qb2.set_error().expect("to ERR");
    let c = one(&cb);
    assert_eq!((c.wr_id, c.status), (42, Completion::WR_FLUSH_ERR));
    // A bad rkey fails at the responder: an error completion.
    let s = [sge(&ma, 0, 8)];
    qa.post_send(&[wr(6, WrOp::Write, &s, mb.addr(), mb.rkey() ^ 0x4000)])
        .expect("post bad write");
    let c = one(&ca);
    assert_eq!(c.wr_id, 6);
    assert_eq!(WcStatus::from_code(c.status), WcStatus::RemAccessErr);
    drop((ma, mb));
}

/// The QPs of the contracts.
const SPEC: QpSpec = QpSpec {
    qpn: None,
    max_send_wr: 16,
    max_recv_wr: 16,
    max_sge: 2,
    max_inline: 64,
    domain: 0,
};

/// The remote rights of [`connected`] QPs.
const ALL_REMOTE: Access =
    Access(Access::REMOTE_READ.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0);

/// A connected RC pair `a` → `b` with all remote rights, and its CQs.
fn connected<N: Nic>(a: &N, b: &N) -> (N::Qp, N::Qp, N::Cq, N::Cq) {
    let (ca, cb) = (
        a.create_cq(64).expect("cq a"),
        b.create_cq(64).expect("cq b"),
    );
    let qa = a.create_qp(&SPEC, &ca, &ca).expect("qp a");
    let qb = b.create_qp(&SPEC, &cb, &cb).expect("qp b");
    qa.connect(b.addr(), qb.qpn(), ALL_REMOTE)
        .expect("connect a");
    qb.connect(a.addr(), qa.qpn(), ALL_REMOTE)
        .expect("connect b");
    (qa, qb, ca, cb)
}

/// The rest of the verbs contract the engine relies on, for any [`Nic`]:
/// owned registered buffers (zeroed, read back, SGEs), the QP's access
/// flags changed while connected (a request they no longer grant fails,
/// except into an [`Access::ANY_QP`] MR), the completion-channel wait.
pub fn buffers_and_access_contract<N: Nic>(a: &N, b: &N) {
    let (qa, qb, ca, _cb) = connected(a, b);
    let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let src = a.alloc_buf(4096, acc).expect("buf a");
    let dst = b.alloc_buf(4096, acc).expect("buf b");
    let any = b
        .alloc_buf(4096, acc | Access::ANY_QP)
        .expect("any-QP buf b");
    let mut z = vec![1u8; 4096];
    dst.read(0, &mut z);
    assert!(z.iter().all(|&x| x == 0), "allocated zeroed");
    assert_eq!(src.len(), 4096);
    let s = src.sge(8, 16);
    assert_eq!((s.addr, s.length, s.lkey), (src.addr() + 8, 16, src.lkey()));
    crate::mem::write(src.addr(), &[7u8; 64]).expect("test memory is mapped");
    qa.post_send(&[wr(
        1,
        WrOp::Write,
        &[src.sge(0, 64)],
        dst.addr(),
        dst.rkey(),
    )])
    .expect("post write");
    let c = one(&ca);
    assert_eq!((c.wr_id, c.status), (1, 0));
    let mut got = [0u8; 64];
    dst.read(0, &mut got);
    assert_eq!(got, [7u8; 64]);
    // READ only from now on: a WRITE still reaches an ANY_QP MR ...
    qb.set_access(Access::REMOTE_READ).expect("set access");
    qa.post_send(&[wr(2, WrOp::Write, &[src.sge(0, 8)], any.addr(), any.rkey())])
        .expect("post write to any-QP");
    let c = one(&ca);
    assert_eq!((c.wr_id, c.status), (2, 0));
    // ... but not a plain one.
    crate::mem::write(src.addr(), &[9u8; 8]).expect("test memory is mapped");
    qa.post_send(&[wr(3, WrOp::Write, &[src.sge(0, 8)], dst.addr(), dst.rkey())])
        .expect("post refused write");
    let c = one(&ca);
    assert_eq!(c.wr_id, 3);
    assert_ne!(c.status, 0, "a WRITE the QP no longer grants fails");
    dst.read(0, &mut got[..8]);
    assert_eq!(got[..8], [7u8; 8]);
    // Nothing armed completes: the wait times out.
    let t = std::time::Instant::now();
    ca.arm(false).expect("arm");
    let _ = a.wait_event(Duration::from_millis(5)).expect("wait");
    assert!(t.elapsed() < Duration::from_secs(2));
}

/// The IOMMU-control contract, for a [`Nic`] that offers it: an MR over an
/// IOVA range reaches, page by page, the process page its entry names, the
/// signature page (reads as [`DeviceCaps::magic`]) or the black hole
/// (absorbs writes); an unmapped page fails the WR.
pub fn iommu_contract<N: Nic>(a: &N, b: &N) {
    let io = a.iommu().expect("IOMMU control");
    let magic = a.caps().magic;
    let ps = a.caps().page_size as u64;
    let (qb, _qa, cb, _ca) = connected(b, a);
    // Two pages of a's memory (page-aligned inside a larger vector).
    let mut mem = vec![0u8; 3 * ps as usize];
    let base = (mem.as_mut_ptr() as u64).next_multiple_of(ps);
    crate::mem::write(base, &[0x5au8; 16]).expect("test memory is mapped");
    let range = io.alloc_range(2).expect("range");
    io.map(&range, 0, Frame::Ram(base)).expect("map ram");
    io.map(&range, 1, Frame::Signature).expect("map signature");
    io.flush().expect("flush");
    let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    // SAFETY: `mem` outlives the MR (dropped first, below).
    #[allow(unsafe_code)]
    let mr = unsafe { io.reg_mr_iova(base, 2 * ps, acc, &range, 0) }.expect("iova mr");
    let local = b.alloc_buf(4096, acc).expect("local buf");
    // READ across the two pages: the real bytes, then the magic words.
    qb.post_send(&[wr(
        1,
        WrOp::Read,
        &[local.sge(0, 32)],
        base + ps - 16,
        mr.rkey(),
    )])
    .expect("post read");
    let c = one(&cb);
    assert_eq!((c.wr_id, c.status), (1, 0));
    let mut got = [0u8; 32];
    local.read(0, &mut got);
    assert_eq!(got[..16], mem_at(base + ps - 16, 16)[..]);
    let words: Vec<u8> = (0..4).flat_map(|_| magic.to_le_bytes()).collect();
    assert_eq!(got[16..], words[..]);
    // The black hole absorbs a WRITE: it completes, the page is untouched.
    io.map(&range, 0, Frame::BlackHole).expect("map black hole");
    io.flush().expect("flush");
    crate::mem::write(local.addr(), &[0xeeu8; 8]).expect("test memory is mapped");
    qb.post_send(&[wr(2, WrOp::Write, &[local.sge(0, 8)], base, mr.rkey())])
        .expect("post write");
    let c = one(&cb);
    assert_eq!((c.wr_id, c.status), (2, 0));
    assert_eq!(mem_at(base, 8), [0x5a; 8]);
    // An unmapped page fails the WR.
    io.map(&range, 0, Frame::Unmapped).expect("unmap");
    io.flush().expect("flush");
    qb.post_send(&[wr(3, WrOp::Read, &[local.sge(0, 8)], base, mr.rkey())])
        .expect("post read of an unmapped page");
    let c = one(&cb);
    assert_eq!(c.wr_id, 3);
    assert_ne!(c.status, 0, "DMA through an unmapped page fails");
    drop(mr);
    io.free_range(range).expect("free range");
    drop(mem);
}

/// `n` bytes at `addr` (a copy).
fn mem_at(addr: u64, n: usize) -> Vec<u8> {
    crate::mem::read(addr, n).expect("test memory is mapped")
}
