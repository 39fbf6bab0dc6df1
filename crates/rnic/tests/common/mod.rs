#![allow(dead_code)]
pub mod child;
use rnic::*;
use std::time::Duration;

pub const T: Duration = Duration::from_secs(5);

pub struct End {
    pub host: Host,
    pub ctx: Context,
    pub pd: Pd,
    pub cq: Cq,
    pub rcq: Cq,
    pub qp: Qp,
}

pub fn all_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC
}

pub fn end(host: &Host, attr: &QpInitAttr) -> End {
    end_of(host, attr, QpType::Rc)
}

/// An endpoint whose QP is of `qp_type`.
pub fn end_of(host: &Host, attr: &QpInitAttr, qp_type: QpType) -> End {
    let ctx = host.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024, None).unwrap();
    let rcq = ctx.create_cq(1024, None).unwrap();
    let qp = pd.create_qp_of(qp_type, &cq, &rcq, None, attr).unwrap();
    End {
        host: host.clone(),
        ctx,
        pd,
        cq,
        rcq,
        qp,
    }
}

pub fn connect(a: &End, b: &End, access: Access, rnr_retry: u8) {
    a.qp.connect(access, b.host.addr(), b.qp.qpn(), rnr_retry).unwrap();
    b.qp.connect(access, a.host.addr(), a.qp.qpn(), rnr_retry).unwrap();
}

/// Two connected hosts in this process.
pub fn pair_cfg(cfg: HostConfig) -> (End, End) {
    let ha = Host::new(cfg.clone()).unwrap();
    let hb = Host::new(cfg).unwrap();
    let a = end(&ha, &QpInitAttr::default());
    let b = end(&hb, &QpInitAttr::default());
    connect(&a, &b, all_access(), 7);
    (a, b)
}

pub fn pair() -> (End, End) {
    pair_cfg(HostConfig::default())
}

/// Trusting hosts whose small ops go through the target's NIC-thread ring even
/// in-process (the trusted protocol's ring half, with its `ring_max` / `ring_rw_max`
/// limits; large ops and messages direct).
pub fn ring_cfg() -> HostConfig {
    HostConfig {
        inproc_ring: true,
        trusted_peers: true,
        ..HostConfig::default()
    }
}

/// The default cross-process protocol (target-enforced protection: every op of any
/// size through the target's ring, in parts) between two hosts of this process.
pub fn secure_cfg() -> HostConfig {
    HostConfig {
        inproc_ring: true,
        ..HostConfig::default()
    }
}

pub fn buf(pd: &Pd, len: usize, fill: u8) -> OwnedMr {
    pd.reg_mr_owned(vec![fill; len], all_access()).unwrap()
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub fn wait1(cq: &Cq) -> Wc {
    cq.poll_wait(1, T).unwrap()[0]
}

pub fn assert_empty(cq: &Cq) {
    std::thread::sleep(Duration::from_millis(5));
    let mut w = [Wc::default(); 4];
    assert_eq!(cq.poll(&mut w).unwrap(), 0, "unexpected completion {:?}", w[0]);
}
