//! Two simulated hosts in one process: connect an RC QP pair, WRITE a message into the
//! peer's memory, READ it back, then show what happens with a bad rkey.
//!
//! Run: `cargo run -p rnic --example demo`

use rnic::*;
use std::time::Duration;

fn main() -> Result<()> {
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let (host_a, host_b) = (Host::new(HostConfig::default())?, Host::new(HostConfig::default())?);
    let attr = host_a.query_device();
    println!(
        "device: max_qp={} max_mr={} max_sge={} max_inline={} max_tlp={} B magic={:#x}",
        attr.max_qp, attr.max_mr, attr.max_sge, attr.max_inline_data, attr.max_tlp, attr.signature_magic
    );

    let (ctx_a, ctx_b) = (host_a.open_context()?, host_b.open_context()?);
    let (pd_a, pd_b) = (ctx_a.alloc_pd()?, ctx_b.alloc_pd()?);
    let (cq_a, cq_b) = (ctx_a.create_cq(64, None)?, ctx_b.create_cq(64, None)?);
    let qp_a = pd_a.create_qp(&cq_a, &cq_a, &QpInitAttr::default())?;
    let qp_b = pd_b.create_qp(&cq_b, &cq_b, &QpInitAttr::default())?;
    qp_a.connect(access, host_b.addr(), qp_b.qpn(), 7)?;
    qp_b.connect(access, host_a.addr(), qp_a.qpn(), 7)?;
    println!(
        "host A {} qpn {:#x} <-> host B {} qpn {:#x}: {:?}/{:?}",
        host_a.addr().to_hex(),
        qp_a.qpn(),
        host_b.addr().to_hex(),
        qp_b.qpn(),
        qp_a.state(),
        qp_b.state()
    );

    let local = pd_a.reg_mr_owned(vec![0; 4096], access)?;
    let remote = pd_b.reg_mr_owned(vec![0; 4096], access)?;
    let msg = b"hello from host A, written by RDMA WRITE";
    local.write(0, msg);

    let sge = [local.sge(0, msg.len() as u32)];
    qp_a.post_send(&[SendWr::new(1, WrOpcode::Write, &sge).remote(remote.addr() as u64, remote.rkey())])
        .map_err(|e| e.err)?;
    let wc = cq_a.poll_wait(1, Duration::from_secs(5))?[0];
    println!("WRITE  completion: {:?} {} bytes", wc.status, wc.byte_len);
    println!(
        "host B memory now: {:?}",
        String::from_utf8_lossy(&remote.to_vec(0, msg.len()))
    );

    let sge = [local.sge(1024, msg.len() as u32)];
    qp_a.post_send(&[SendWr::new(2, WrOpcode::Read, &sge).remote(remote.addr() as u64, remote.rkey())])
        .map_err(|e| e.err)?;
    let wc = cq_a.poll_wait(1, Duration::from_secs(5))?[0];
    println!(
        "READ   completion: {:?} {} bytes -> {:?}",
        wc.status,
        wc.byte_len,
        String::from_utf8_lossy(&local.to_vec(1024, msg.len()))
    );
    assert_eq!(local.to_vec(1024, msg.len()), msg);

    let sge = [local.sge(0, 8)];
    qp_a.post_send(&[SendWr::new(3, WrOpcode::Read, &sge).remote(remote.addr() as u64, remote.rkey() ^ 0x100)])
        .map_err(|e| e.err)?;
    let wc = cq_a.poll_wait(1, Duration::from_secs(5))?[0];
    println!(
        "READ with a wrong rkey: {:?}; QPs now {:?}/{:?}",
        wc.status,
        qp_a.state(),
        qp_b.state()
    );
    let s = host_a.stats();
    println!(
        "host A stats: {} WRs, {} bytes, {} atoms, non-resident DMA {}",
        s.wrs, s.bytes, s.atoms, s.nonresident_dma
    );
    Ok(())
}
