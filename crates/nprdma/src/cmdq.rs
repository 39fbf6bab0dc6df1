//! Control-channel framing over 64-byte slots: a message of `n` slots is
//! sent as `n` consecutive SENDs of one slot each on the RC control QP (one
//! WR chain), and lands in `n` consecutive 64-byte RECV buffers of the
//! receiver's pinned ring. [`slots`] cuts an emitted message into slots;
//! [`Reassembler`] rebuilds messages from slots in arrival order.
//!
//! Flow control is the RC QP's: the receiver re-posts each slot buffer as
//! soon as it has consumed it, and the control QP runs with infinite RNR
//! retry, so a burst that outruns the ring only waits.

use crate::ctrl::{message_len, CtrlConfig, CtrlError, SLOT};

/// The slots of one emitted message (`msg.len()` must be a multiple of
/// [`SLOT`]; a shorter tail is ignored).
pub fn slots(msg: &[u8]) -> impl Iterator<Item = &[u8]> {
    msg.chunks_exact(SLOT)
}

/// Rebuilds messages from slots.
#[derive(Debug)]
pub struct Reassembler {
    max_bytes: usize,
    buf: Vec<u8>,
    need: usize,
}

impl Reassembler {
    /// A reassembler accepting messages up to `cfg.max_message_slots()`.
    pub fn new(cfg: &CtrlConfig) -> Self {
        let max_bytes = cfg.max_message_slots() * SLOT;
        Reassembler {
            max_bytes,
            buf: Vec::with_capacity(max_bytes),
            need: 0,
        }
    }

    /// Whether a message is partially received.
    pub fn in_progress(&self) -> bool {
        self.need != 0
    }

    /// Feed the next slot. Returns the complete message bytes when `slot`
    /// was its last slot (valid until the next call), `None` while more
    /// slots are expected, or an error for a malformed first slot or a
    /// message above the configured size (the state is reset; the peer is
    /// broken and the control QP should go to ERR).
    pub fn push(&mut self, slot: &[u8]) -> Result<Option<&[u8]>, CtrlError> {
        if slot.len() != SLOT {
            self.reset();
            return Err(CtrlError::Truncated {
                need: SLOT,
                have: slot.len(),
            });
        }
        if self.need == 0 {
            let total = match message_len(slot) {
                Ok(t) => t,
                Err(e) => {
                    self.reset();
                    return Err(e);
                }
            };
            if total > self.max_bytes {
                self.reset();
                return Err(CtrlError::BadLength {
                    end: total,
                    cap: self.max_bytes,
                });
            }
            self.buf.clear();
            self.need = total / SLOT;
        }
        self.buf.extend_from_slice(slot);
        self.need -= 1;
        if self.need == 0 {
            Ok(Some(&self.buf))
        } else {
            Ok(None)
        }
    }

    /// Drop any partial message.
    pub fn reset(&mut self) {
        self.buf.clear();
        self.need = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use proptest::prelude::*;

    use super::*;
    use crate::ctrl::{Repr, Status};

    fn emit(r: &Repr<'_>, cfg: &CtrlConfig) -> Vec<u8> {
        let mut b = vec![0; r.buffer_len()];
        r.emit(&mut b, cfg).unwrap();
        b
    }

    #[test]
    fn single_and_multi_slot_messages_reassemble() {
        let cfg = CtrlConfig::default();
        let mut ra = Reassembler::new(&cfg);
        let a = emit(&Repr::Release { req_id: 1 }, &cfg);
        let data = vec![7u8; 700];
        let b = emit(
            &Repr::SendInline {
                req_id: 2,
                imm: Some(3),
                solicited: false,
                rnr_retry: 7,
                data: Cow::Borrowed(&data),
            },
            &cfg,
        );
        assert_eq!(ra.push(&a).unwrap(), Some(&a[..]));
        let n = b.len() / SLOT;
        for (i, s) in slots(&b).enumerate() {
            let out = ra.push(s).unwrap().map(|m| m.to_vec());
            if i + 1 < n {
                assert!(out.is_none() && ra.in_progress());
            } else {
                assert_eq!(out.as_deref(), Some(&b[..]));
            }
        }
        assert!(!ra.in_progress());
    }

    #[test]
    fn malformed_or_oversized_first_slot_is_rejected_and_resets() {
        let cfg = CtrlConfig::default();
        let mut ra = Reassembler::new(&cfg);
        assert!(ra.push(&[0u8; SLOT]).is_err());
        assert!(ra.push(&[0u8; 10]).is_err());
        // A message legal under a bigger inline limit is too big here.
        let big_cfg = CtrlConfig::with_max_inline(4096).unwrap();
        let big = emit(
            &Repr::WriteInline {
                req_id: 1,
                remote_addr: 0,
                rkey: 0,
                want_lease: false,
                data: Cow::Owned(vec![1; 3000]),
            },
            &big_cfg,
        );
        assert!(matches!(
            ra.push(&big[..SLOT]),
            Err(CtrlError::BadLength { .. })
        ));
        assert!(!ra.in_progress());
        let ok = emit(
            &Repr::Completion {
                req_id: 5,
                status: Status::Ok,
                byte_len: 0,
            },
            &cfg,
        );
        assert!(ra.push(&ok).unwrap().is_some());
    }

    proptest! {
        #[test]
        fn streams_of_messages_come_back_in_order(
            items in prop::collection::vec((any::<u32>(), 0usize..1025), 1..20)
        ) {
            let cfg = CtrlConfig::default();
            let reprs: Vec<Repr<'static>> = items
                .iter()
                .map(|&(id, n)| {
                    if n % 3 == 0 {
                        Repr::Completion { req_id: id, status: Status::Ok, byte_len: n as u32 }
                    } else {
                        Repr::WriteInline {
                            req_id: id,
                            remote_addr: n as u64,
                            rkey: id,
                            want_lease: false,
                            data: Cow::Owned((0..n).map(|i| i as u8).collect()),
                        }
                    }
                })
                .collect();
            let stream: Vec<u8> = reprs.iter().flat_map(|r| emit(r, &cfg)).collect();
            let mut ra = Reassembler::new(&cfg);
            let mut got = Vec::new();
            for s in slots(&stream) {
                if let Some(m) = ra.push(s).unwrap() {
                    got.push(Repr::parse_bytes(m, &cfg).unwrap().into_owned());
                }
            }
            prop_assert_eq!(got, reprs);
        }
    }
}
