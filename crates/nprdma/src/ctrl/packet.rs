//! Typed, bounds-checked view over the bytes of one control message.

use super::layout::{self, Field};
use super::{slots_for, CtrlError, Opcode, SLOT, VERSION};

/// A read/write view over a control message held in `T`.
///
/// Build it with [`Packet::new_checked`] for untrusted bytes: after that every
/// accessor is in bounds. [`Packet::new_unchecked`] is for buffers the caller
/// sized itself (e.g. before emitting); accessors on a too-short unchecked
/// buffer panic, exactly like smoltcp's.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

/// Where the opcode's content (fixed body + inline data or entries) ends,
/// given the header's `len` field. `None` for [`Opcode::Pad`].
pub(crate) fn content_end(op: Opcode, len: usize) -> Option<usize> {
    use Opcode::*;
    Some(match op {
        KeyQuery | KeyRevoke => layout::KEY_RKEY.end,
        KeySync => layout::KEY_ENTRIES + len * layout::KEY_ENTRY_LEN,
        FaultRequest => layout::FAULT_END,
        WriteInline => layout::WRITE_INLINE_DATA + len,
        ReadInline => layout::READ_INLINE_END,
        ReadInlineResp => layout::READ_RESP_DATA + len,
        Completion => layout::COMP_BYTE_LEN.end,
        ReceiverReady | Release => layout::HEADER_LEN,
        AtomicRequest => layout::ATOMIC_END,
        AtomicResp => layout::ATOMIC_ORIG.end,
        SendRendezvous => layout::RDV_END,
        SendInline => layout::SEND_INLINE_DATA + len,
        WriteImmNotify => layout::WIMM_END,
        Lease => layout::LEASE_END,
        LeaseRelease => layout::RELEASE_END,
        Pad => return None,
    })
}

/// Offset of the inline data of `op`, if it carries any.
pub(crate) fn data_offset(op: Opcode) -> Option<usize> {
    match op {
        Opcode::WriteInline => Some(layout::WRITE_INLINE_DATA),
        Opcode::ReadInlineResp => Some(layout::READ_RESP_DATA),
        Opcode::SendInline => Some(layout::SEND_INLINE_DATA),
        _ => None,
    }
}

/// Validate the header in `bytes` (at least the first slot of a message) and
/// return the full message length in bytes (`nslots * SLOT`). A receiver
/// calls this on the first slot to learn how many slots to gather.
pub fn message_len(bytes: &[u8]) -> Result<usize, CtrlError> {
    if bytes.len() < SLOT {
        return Err(CtrlError::Truncated {
            need: SLOT,
            have: bytes.len(),
        });
    }
    if bytes[layout::VERSION] != VERSION {
        return Err(CtrlError::BadVersion(bytes[layout::VERSION]));
    }
    let op = Opcode::try_from(bytes[layout::OPCODE])?;
    let nslots = bytes[layout::NSLOTS] as usize;
    let len = u16::from_le_bytes([bytes[layout::LEN.start], bytes[layout::LEN.start + 1]]) as usize;
    match content_end(op, len) {
        None if nslots == 0 => Err(CtrlError::BadSlotCount { nslots, need: 1 }),
        None => Ok(nslots * SLOT),
        Some(end) => {
            let need = slots_for(end);
            if nslots != need {
                return Err(CtrlError::BadSlotCount { nslots, need });
            }
            Ok(nslots * SLOT)
        }
    }
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap without any check.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wrap and validate: version, opcode, slot count consistent with the
    /// content, and the whole message present in the buffer.
    pub fn new_checked(buffer: T) -> Result<Packet<T>, CtrlError> {
        let p = Packet::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// The structural checks of [`Packet::new_checked`].
    pub fn check_len(&self) -> Result<(), CtrlError> {
        let bytes = self.buffer.as_ref();
        let total = message_len(bytes)?;
        if bytes.len() < total {
            return Err(CtrlError::Truncated {
                need: total,
                have: bytes.len(),
            });
        }
        Ok(())
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// Read a little-endian `u32` field (see [`layout`]).
    pub fn u32_field(&self, f: Field) -> u32 {
        let mut a = [0u8; 4];
        a.copy_from_slice(&self.b()[f]);
        u32::from_le_bytes(a)
    }

    /// Read a little-endian `u64` field (see [`layout`]).
    pub fn u64_field(&self, f: Field) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&self.b()[f]);
        u64::from_le_bytes(a)
    }

    /// Format version (byte 0).
    pub fn version(&self) -> u8 {
        self.b()[layout::VERSION]
    }
    /// Raw opcode byte.
    pub fn opcode_raw(&self) -> u8 {
        self.b()[layout::OPCODE]
    }
    /// Decoded opcode.
    pub fn opcode(&self) -> Result<Opcode, CtrlError> {
        Opcode::try_from(self.opcode_raw())
    }
    /// Number of slots the message spans.
    pub fn nslots(&self) -> usize {
        self.b()[layout::NSLOTS] as usize
    }
    /// Message length in bytes (`nslots * SLOT`).
    pub fn total_len(&self) -> usize {
        self.nslots() * SLOT
    }
    /// Flag bits.
    pub fn flags(&self) -> u8 {
        self.b()[layout::FLAGS]
    }
    /// The `len` field: inline-data length or key-entry count.
    pub fn len_field(&self) -> u16 {
        let b = self.b();
        u16::from_le_bytes([b[layout::LEN.start], b[layout::LEN.start + 1]])
    }
    /// Raw status byte.
    pub fn status_raw(&self) -> u8 {
        self.b()[layout::STATUS]
    }
    /// Raw kind byte (fault READ/WRITE, atomic CMP_SWP/FETCH_ADD).
    pub fn kind(&self) -> u8 {
        self.b()[layout::KIND]
    }
    /// Request id.
    pub fn req_id(&self) -> u32 {
        self.u32_field(layout::REQ_ID)
    }

    /// Inline data of WriteInline / ReadInlineResp / SendInline (empty for
    /// other opcodes).
    pub fn payload(&self) -> &[u8] {
        match self.opcode().ok().and_then(data_offset) {
            Some(off) => &self.b()[off..off + self.len_field() as usize],
            None => &[],
        }
    }

    /// Raw bytes of key entry `i` of a KeySync message.
    pub fn key_entry(&self, i: usize) -> Option<&[u8]> {
        if self.opcode().ok()? != Opcode::KeySync || i >= self.len_field() as usize {
            return None;
        }
        let off = layout::KEY_ENTRIES + i * layout::KEY_ENTRY_LEN;
        self.b().get(off..off + layout::KEY_ENTRY_LEN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    /// Write a little-endian `u32` field.
    pub fn set_u32_field(&mut self, f: Field, v: u32) {
        self.bm()[f].copy_from_slice(&v.to_le_bytes());
    }
    /// Write a little-endian `u64` field.
    pub fn set_u64_field(&mut self, f: Field, v: u64) {
        self.bm()[f].copy_from_slice(&v.to_le_bytes());
    }
    /// Write the common header.
    #[allow(clippy::too_many_arguments)]
    pub fn set_header(
        &mut self,
        op: Opcode,
        nslots: u8,
        flags: u8,
        len: u16,
        status: u8,
        kind: u8,
        req_id: u32,
    ) {
        let b = self.bm();
        b[layout::VERSION] = VERSION;
        b[layout::OPCODE] = op as u8;
        b[layout::NSLOTS] = nslots;
        b[layout::FLAGS] = flags;
        b[layout::LEN].copy_from_slice(&len.to_le_bytes());
        b[layout::STATUS] = status;
        b[layout::KIND] = kind;
        b[layout::REQ_ID].copy_from_slice(&req_id.to_le_bytes());
    }
    /// Mutable bytes from `off` to the end of the buffer.
    pub fn bytes_mut_from(&mut self, off: usize) -> &mut [u8] {
        &mut self.bm()[off..]
    }
}
