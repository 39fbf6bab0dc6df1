//! The NIC work-request id of every WR the engine posts ([`WrTag`]): which
//! QP (index + generation), what kind of WR, which step of an operation and
//! which operation or slot it belongs to, packed into the 64-bit `wr_id`.

/// What a NIC WR of the engine is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum WrKind {
    /// A step of an application operation's one-sided attempt.
    Op = 0,
    /// A reverse operation (target side of a fault request or rendezvous).
    Rev = 1,
    /// A control-message slot sent.
    CtrlSend = 2,
    /// A command-ring slot received (its id is the slot).
    CtrlRecv = 3,
    /// A read-back READ of deferred WRITEs (its id is the batch).
    Readback = 4,
    /// A step of the QP's lean-path operation (the `fast` file).
    Fast = 5,
    /// A zero-length RDMA WRITE on the control QP asking the NIC whether the
    /// peer QP is still there (`QpState::probe_peer`).
    Probe = 6,
}

impl WrKind {
    fn from_bits(b: u64) -> Option<WrKind> {
        Some(match b {
            0 => WrKind::Op,
            1 => WrKind::Rev,
            2 => WrKind::CtrlSend,
            3 => WrKind::CtrlRecv,
            4 => WrKind::Readback,
            5 => WrKind::Fast,
            6 => WrKind::Probe,
            _ => return None,
        })
    }
}

/// The decoded `wr_id` of an engine WR: bits 48.. QP index, 40..48 its
/// generation, 36..40 the [`WrKind`], 32..36 the step within an operation,
/// 0..32 the operation / request / slot / batch id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WrTag {
    /// Index of the QP in the engine's table.
    pub qi: usize,
    /// Generation of that table slot (a completion of a destroyed QP's WR
    /// does not match its successor).
    pub gen: u8,
    pub kind: WrKind,
    /// Which NIC WR of a multi-WR operation (0..16).
    pub step: u8,
    pub id: u32,
}

impl WrTag {
    /// A tag for QP `qi` of generation `gen`.
    #[inline]
    pub fn new(qi: usize, gen: u8, kind: WrKind, step: u8, id: u32) -> WrTag {
        WrTag {
            qi,
            gen,
            kind,
            step,
            id,
        }
    }

    /// The packed `wr_id`.
    #[inline]
    pub fn wr_id(self) -> u64 {
        (self.qi as u64) << 48
            | (self.gen as u64) << 40
            | (self.kind as u64) << 36
            | (u64::from(self.step) & 0xf) << 32
            | self.id as u64
    }

    /// Decode a `wr_id` (`None`: not one the engine made).
    #[inline]
    pub fn from_wr_id(w: u64) -> Option<WrTag> {
        Some(WrTag {
            qi: (w >> 48) as usize,
            gen: (w >> 40) as u8,
            kind: WrKind::from_bits((w >> 36) & 0xf)?,
            step: ((w >> 32) & 0xf) as u8,
            id: w as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_through_wr_ids() {
        let kinds = [
            WrKind::Op,
            WrKind::Rev,
            WrKind::CtrlSend,
            WrKind::CtrlRecv,
            WrKind::Readback,
            WrKind::Fast,
        ];
        for (k, kind) in kinds.into_iter().enumerate() {
            let t = WrTag::new(
                65535 - k,
                255 - k as u8,
                kind,
                (k % 16) as u8,
                u32::MAX - k as u32,
            );
            assert_eq!(WrTag::from_wr_id(t.wr_id()), Some(t));
        }
    }

    #[test]
    fn unknown_kinds_are_not_engine_wrs() {
        let w = WrTag::new(1, 2, WrKind::Op, 3, 4).wr_id() | 0xf << 36;
        assert_eq!(WrTag::from_wr_id(w), None);
    }
}
