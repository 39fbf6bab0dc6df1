//! Target-private state of the request-ring server: the multi-part SEND being received
//! into a posted receive, one per QP. It lives in the serving host's own memory, never
//! in the shared segment (which peers write), so a peer cannot steer where a part lands.

/// A receive WQE's gather entry as it was posted (re-validated for every part, so an
/// MR deregistered mid-message is never written).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecvSge {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
}

/// A SEND whose first part claimed a receive WQE and whose last part has not arrived.
#[derive(Debug)]
pub(crate) struct Inbound {
    /// The receiving QP's number and its connected peer (a reused QP index, or a part
    /// from anyone else, does not continue this message).
    pub qpn: u32,
    pub src_nonce: u64,
    pub src_qpn: u32,
    /// RQ index of the WQE being filled (the RQ head while the message is in progress;
    /// a flush moves the head and ends the message).
    pub head: u64,
    /// The WQE was taken off a shared receive queue at the first part (other QPs take
    /// from it meanwhile): the head no longer marks it.
    pub taken: bool,
    /// The PD the receive buffers are checked against (their queue's).
    pub pd: u32,
    pub wr_id: u64,
    pub sges: Vec<RecvSge>,
    /// Message length (from the first part) and bytes received so far.
    pub total: u64,
    pub next_off: u64,
    pub imm: Option<u32>,
    pub solicited: bool,
    /// The length was not known at the first part (`segment::RING_F_OPEN`): `total`
    /// is the receive's capacity, the message ends at its last part.
    pub open: bool,
}

/// A receiving QP refusing requests after an RNR NAK: every request of the
/// connection with the NAKed request's rewind generation is refused unexecuted until
/// one of a newer generation (the requester's resend) arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocked {
    pub qpn: u32,
    pub src_nonce: u64,
    pub src_qpn: u32,
    pub gen: u16,
}

/// Everything the thread serving the request rings keeps for itself (held under
/// `nic::state::Nic::ring_server`: one consumer per ring).
pub(crate) struct RingServer {
    inbound: Vec<Option<Inbound>>,
    blocked: Vec<Option<Blocked>>,
}

impl RingServer {
    pub fn new(max_qp: u32) -> RingServer {
        RingServer {
            inbound: (0..max_qp).map(|_| None).collect(),
            blocked: vec![None; max_qp as usize],
        }
    }

    /// The message in progress on QP index `idx`, if any.
    pub fn inbound(&mut self, idx: u32) -> Option<&mut Option<Inbound>> {
        self.inbound.get_mut(idx as usize)
    }

    /// Whether QP index `idx` refuses request `b` (a request of a blocked connection
    /// and generation); a request of any other generation or connection lifts the
    /// block.
    pub fn refuses(&mut self, idx: u32, b: Blocked) -> bool {
        match self.blocked.get_mut(idx as usize) {
            Some(slot) if *slot == Some(b) => true,
            Some(slot) => {
                *slot = None;
                false
            }
            None => false,
        }
    }

    /// QP index `idx` NAKed request `b` with RNR: refuse the rest of its generation.
    pub fn block(&mut self, idx: u32, b: Blocked) {
        if let Some(slot) = self.blocked.get_mut(idx as usize) {
            *slot = Some(b);
        }
    }
}

/// The pieces of a list of `pieces` (each `len_of` bytes long) that cover
/// `[off, off + len)` of their concatenation, cut with `cut(piece, skip, n)` (the `n`
/// bytes of `piece` after its first `skip`), pushed to `out`.
pub(crate) fn window_of<T>(
    pieces: &[T],
    off: u64,
    len: u64,
    len_of: impl Fn(&T) -> u64,
    cut: impl Fn(&T, u64, u64) -> T,
    out: &mut Vec<T>,
) {
    let (mut skip, mut left) = (off, len);
    for p in pieces {
        if left == 0 {
            break;
        }
        let plen = len_of(p);
        if skip >= plen {
            skip -= plen;
            continue;
        }
        let n = (plen - skip).min(left);
        out.push(cut(p, skip, n));
        skip = 0;
        left -= n;
    }
}

/// The pieces of the gather list `sges` that cover `[off, off + len)` of the message.
pub(crate) fn window(sges: &[RecvSge], off: u64, len: u64) -> Vec<RecvSge> {
    let mut out = Vec::new();
    let cut = |s: &RecvSge, skip: u64, n: u64| RecvSge {
        addr: s.addr + skip,
        len: n,
        lkey: s.lkey,
    };
    window_of(sges, off, len, |s| s.len, cut, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sge(addr: u64, len: u64) -> RecvSge {
        RecvSge { addr, len, lkey: 7 }
    }

    #[test]
    fn window_cuts_the_gather_list_at_any_offset() {
        let sges = [sge(1000, 10), sge(5000, 4), sge(9000, 100)];
        let w = window(&sges, 0, 10);
        assert_eq!(w.iter().map(|s| (s.addr, s.len)).collect::<Vec<_>>(), [(1000, 10)]);
        let w = window(&sges, 8, 10);
        assert_eq!(
            w.iter().map(|s| (s.addr, s.len)).collect::<Vec<_>>(),
            [(1008, 2), (5000, 4), (9000, 4)]
        );
        let w = window(&sges, 14, 100);
        assert_eq!(w.iter().map(|s| (s.addr, s.len)).collect::<Vec<_>>(), [(9000, 100)]);
        // Past the end: only what exists.
        let w = window(&sges, 110, 50);
        assert_eq!(w.iter().map(|s| (s.addr, s.len)).collect::<Vec<_>>(), [(9096, 4)]);
        assert!(window(&sges, 0, 0).is_empty());
    }
}
