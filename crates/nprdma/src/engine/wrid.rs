//! The NIC work-request id of every WR the engine posts: which QP
//! (index + generation), what kind of WR, which step of an operation and
//! which operation or slot it belongs to, packed into the 64-bit `wr_id`.

pub(super) const K_OP: u64 = 0;
pub(super) const K_REV: u64 = 1;
pub(super) const K_CSEND: u64 = 2;
pub(super) const K_CRECV: u64 = 3;
pub(super) const K_RB: u64 = 4;
/// A WR of the QP's lean-path operation ([`fast`]).
pub(super) const K_FAST: u64 = 5;

pub(super) fn enc(qi: usize, gen: u8, kind: u64, step: u64, id: u32) -> u64 {
    (qi as u64) << 48 | (gen as u64) << 40 | kind << 36 | step << 32 | id as u64
}

pub(super) fn dec(w: u64) -> (usize, u8, u64, u64, u32) {
    (
        (w >> 48) as usize,
        (w >> 40) as u8,
        (w >> 36) & 0xf,
        (w >> 32) & 0xf,
        w as u32,
    )
}
