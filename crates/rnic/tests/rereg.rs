//! Re-registration (`Mr::rereg`): an MR moved to new rights, a new range or another
//! PD keeps its keys; a peer's access is judged by the registration of the moment
//! (the old range and rights reach nothing once it returns); bad input changes nothing.

mod common;
use common::*;
use rnic::*;

#[test]
fn new_rights_apply_at_once_and_bad_input_changes_nothing() {
    for cfg in [HostConfig::default(), secure_cfg()] {
        let (a, b) = pair_cfg(cfg);
        let src = buf(&a.pd, 64, 0);
        src.write(0, &pattern(64, 1));
        let mut r1 = vec![0u8; 4096];
        // SAFETY: the buffer outlives the MR (dropped at the end of the block).
        let mut mr = unsafe { b.pd.reg_mr(r1.as_mut_ptr() as usize, 4096, all_access()) }.unwrap();
        let key = mr.rkey();
        let write = |to: u64, id: u64| {
            let sge = [src.sge(0, 64)];
            a.qp.post_send(&[SendWr::new(id, WrOpcode::Write, &sge).remote(to, key)])
                .unwrap();
            wait1(&a.cq).status
        };
        // Rights: read-only now, a WRITE is refused (and fails the QP).
        // SAFETY: the range is unchanged.
        unsafe { mr.rereg(None, None, Some(Access::LOCAL_WRITE | Access::REMOTE_READ)) }.unwrap();
        assert_eq!(mr.rkey(), key);
        assert_eq!(write(r1.as_ptr() as u64, 1), WcStatus::RemAccessErr);
        // Bad input changes nothing: REMOTE_WRITE without LOCAL_WRITE.
        // SAFETY: as above.
        assert!(unsafe { mr.rereg(None, None, Some(Access::REMOTE_WRITE)) }.is_err());
        assert_eq!(mr.access(), Access::LOCAL_WRITE | Access::REMOTE_READ);
        assert!(r1.iter().all(|&x| x == 0));
        drop(mr);
    }
}

#[test]
fn a_new_range_is_reached_and_the_old_one_is_not() {
    let (a, b) = pair();
    let src = buf(&a.pd, 64, 0);
    src.write(0, &pattern(64, 2));
    let mut r1 = vec![0u8; 4096];
    let mut r2 = vec![0u8; 4096];
    let pd2 = b.ctx.alloc_pd().unwrap();
    // SAFETY: both buffers outlive the MR.
    let mut mr = unsafe { b.pd.reg_mr(r1.as_mut_ptr() as usize, 4096, all_access()) }.unwrap();
    let key = mr.rkey();
    // SAFETY: r2 outlives the MR.
    unsafe { mr.rereg(None, Some((r2.as_mut_ptr() as usize, 4096)), None) }.unwrap();
    assert_eq!((mr.rkey(), mr.addr()), (key, r2.as_ptr() as usize));
    let sge = [src.sge(0, 64)];
    a.qp.post_send(&[SendWr::new(1, WrOpcode::Write, &sge).remote(r2.as_ptr() as u64, key)])
        .unwrap();
    assert_eq!(wait1(&a.cq).status, WcStatus::Success);
    assert_eq!(r2[..64], pattern(64, 2)[..]);
    a.qp.post_send(&[SendWr::new(2, WrOpcode::Write, &sge).remote(r1.as_ptr() as u64, key)])
        .unwrap();
    assert_eq!(wait1(&a.cq).status, WcStatus::RemAccessErr);
    assert!(r1.iter().all(|&x| x == 0), "the old range was reached");
    // Another PD: the QP (on the first PD) cannot use it any more.
    // SAFETY: the range is unchanged.
    unsafe { mr.rereg(Some(&pd2), None, None) }.unwrap();
    assert_eq!(mr.pd().id(), pd2.id());
    drop(mr);
}
