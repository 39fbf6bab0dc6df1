//! Control-channel wire format: the 64-byte command slots exchanged over the
//! small pinned control QP that pairs each data QP (key sync, two-sided fault
//! handling, inline data, atomics, send rendezvous, write-with-imm notices).
//!
//! Layout (all integers little-endian, the byte order of the host memory the
//! command queue lives in). A *message* is `nslots` consecutive 64-byte slots;
//! it is described by the 12-byte header in its first slot, and its body and
//! inline payload continue straight into the following *continuation slots*
//! (which carry no header of their own):
//!
//! ```text
//!  0       1       2       3       4       6       7       8          12
//!  +-------+-------+-------+-------+-------+-------+-------+----------+----- body
//!  |version|opcode |nslots | flags |  len  |status | kind  |  req_id  | ...
//!  +-------+-------+-------+-------+-------+-------+-------+----------+-----
//! ```
//!
//! `len` is the inline-data length (or the key-mapping entry count for
//! [`Opcode::KeySync`]). `nslots` must be exactly the minimum number of slots
//! that holds the message (only [`Opcode::Pad`] may span any number of slots:
//! a sender uses it to skip the tail of a ring). The per-opcode body layout is
//! in [`layout`].
//!
//! A receiver that owns one 64-byte receive buffer per slot reads the first
//! slot, learns the message size with [`message_len`], gathers the remaining
//! slots (a sender posts all slots of one message as one WR chain on the RC
//! control QP, so they arrive consecutively), then views the bytes with
//! [`Packet::new_checked`] and decodes them with [`Repr::parse`].
//!
//! As in smoltcp, [`Packet`] is a typed view over a byte buffer (checked
//! constructor, field accessors) and [`Repr`] is the decoded form with
//! `parse`/`emit`. Malformed input never panics: it yields a [`CtrlError`].

mod packet;
mod repr;

pub use packet::{message_len, Packet};
pub use repr::{AtomicKind, AtomicRequest, FaultKind, FaultRequest, KeyMapping, Repr};

/// Size of one command slot in bytes.
pub const SLOT: usize = 64;
/// Wire-format version carried in byte 0 of every message.
pub const VERSION: u8 = 1;
/// Hard upper bound on the slots of one message (`nslots` is a `u8`).
pub const MAX_SLOTS: usize = 255;
/// Default maximum inline payload (the paper: inline is worth it up to 1 KB).
pub const DEFAULT_MAX_INLINE: usize = 1024;

/// Control-channel configuration shared by both peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtrlConfig {
    /// Largest inline payload (WRITE/READ/SEND data) accepted or emitted.
    pub max_inline: usize,
}

impl Default for CtrlConfig {
    fn default() -> Self {
        CtrlConfig {
            max_inline: DEFAULT_MAX_INLINE,
        }
    }
}

impl CtrlConfig {
    /// A configuration with the given inline limit, checked against the hard
    /// slot limit.
    pub fn with_max_inline(max_inline: usize) -> Result<Self, CtrlError> {
        let cfg = CtrlConfig { max_inline };
        if cfg.max_message_slots() > MAX_SLOTS {
            return Err(CtrlError::InlineTooLong {
                len: max_inline,
                max: (MAX_SLOTS * SLOT) - layout::WRITE_INLINE_DATA,
            });
        }
        Ok(cfg)
    }

    /// Slots of the largest message this configuration allows: the size of
    /// the reassembly buffer a receiver needs.
    pub fn max_message_slots(&self) -> usize {
        slots_for(layout::WRITE_INLINE_DATA + self.max_inline)
    }

    /// Most key-mapping entries that fit in one [`Repr::KeySync`] message.
    pub fn max_key_entries(&self) -> usize {
        (self.max_message_slots() * SLOT - layout::KEY_ENTRIES) / layout::KEY_ENTRY_LEN
    }
}

/// Number of slots needed for a message of `bytes` bytes (at least one).
pub fn slots_for(bytes: usize) -> usize {
    bytes.div_ceil(SLOT).max(1)
}

/// Message opcodes (byte 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Ask the peer for its key mappings (one rkey, or all).
    KeyQuery = 1,
    /// Key mappings (app rkey → write rkey, version rkey, region).
    KeySync = 2,
    /// An application MR was deregistered: forget its mapping.
    KeyRevoke = 3,
    /// Two-sided fault handling request for a READ or WRITE.
    FaultRequest = 4,
    /// WRITE whose data travels inline.
    WriteInline = 5,
    /// READ whose data should come back inline.
    ReadInline = 6,
    /// Inline data answering [`Opcode::ReadInline`].
    ReadInlineResp = 7,
    /// Completion of a request {request id, status}.
    Completion = 8,
    /// Retry mode: target pinned the pages; initiator may retry one-sided.
    ReceiverReady = 9,
    /// Retry mode: initiator is done; target may unpin.
    Release = 10,
    /// Atomic executed by the target CPU.
    AtomicRequest = 11,
    /// Result of an atomic (original value).
    AtomicResp = 12,
    /// SEND by rendezvous: the receiver reverse-READs the sender's buffer.
    SendRendezvous = 13,
    /// SEND whose data travels inline.
    SendInline = 14,
    /// Notice that a WRITE-with-immediate landed; receiver checks magic words.
    WriteImmNotify = 15,
    /// Padding: skip `nslots` slots (ring wrap).
    Pad = 16,
    /// The target lends the initiator its registration of a range it just
    /// served two-sided (user-space mode): one-sided READs (or WRITEs) of that
    /// range may use `key` for `ms` milliseconds from the request's sending.
    Lease = 17,
    /// The initiator is done with a lease (its time of use is over and none
    /// of its operations on it is in flight): the target may drop it.
    LeaseRelease = 18,
}

impl TryFrom<u8> for Opcode {
    type Error = CtrlError;
    fn try_from(v: u8) -> Result<Self, CtrlError> {
        use Opcode::*;
        Ok(match v {
            1 => KeyQuery,
            2 => KeySync,
            3 => KeyRevoke,
            4 => FaultRequest,
            5 => WriteInline,
            6 => ReadInline,
            7 => ReadInlineResp,
            8 => Completion,
            9 => ReceiverReady,
            10 => Release,
            11 => AtomicRequest,
            12 => AtomicResp,
            13 => SendRendezvous,
            14 => SendInline,
            15 => WriteImmNotify,
            16 => Pad,
            17 => Lease,
            18 => LeaseRelease,
            other => return Err(CtrlError::UnknownOpcode(other)),
        })
    }
}

/// Status carried by responses (byte 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// Done.
    Ok = 0,
    /// Unknown key, out of bounds, or missing access right.
    RemoteAccess = 1,
    /// Malformed or unsupported request.
    RemoteInvalid = 2,
    /// The target could not get resources (pin failed, swap full, ...).
    NoResources = 3,
    /// Suspected fault: redo the operation through the two-sided path.
    Retry = 4,
    /// No receive buffer posted (SEND / WRITE-with-imm).
    RnrNoRecv = 5,
    /// The target QP was torn down / flushed.
    Flushed = 6,
    /// The target hit an operational error executing the request.
    RemoteOp = 7,
    /// Not an outcome: the receiver holds the SEND / WRITE_WITH_IMM notice
    /// until a RECV is posted, however long that takes (the sender's
    /// `rnr_retry` is 7); its outcome follows in a later answer.
    RnrWait = 8,
}

impl TryFrom<u8> for Status {
    type Error = CtrlError;
    fn try_from(v: u8) -> Result<Self, CtrlError> {
        Ok(match v {
            0 => Status::Ok,
            1 => Status::RemoteAccess,
            2 => Status::RemoteInvalid,
            3 => Status::NoResources,
            4 => Status::Retry,
            5 => Status::RnrNoRecv,
            6 => Status::Flushed,
            7 => Status::RemoteOp,
            8 => Status::RnrWait,
            other => return Err(CtrlError::UnknownStatus(other)),
        })
    }
}

/// Message flag bits (byte 3); which ones are legal depends on the opcode.
pub mod flags {
    /// KeyQuery: send every mapping (the rkey field is ignored).
    pub const ALL: u8 = 0x01;
    /// KeySync: more KeySync messages follow for the same request.
    pub const MORE: u8 = 0x01;
    /// FaultRequest: the target may answer a READ inline / a WRITE by
    /// ReadInline instead of the reverse one-sided operation.
    pub const INLINE_OK: u8 = 0x01;
    /// FaultRequest: retry mode — answer ReceiverReady after pinning instead
    /// of doing the reverse operation.
    pub const RETRY_MODE: u8 = 0x02;
    /// FaultRequest / ReadInline / WriteInline: the initiator would take a lease
    /// ([`super::Opcode::Lease`]) on the target's registration of the range
    /// (user-space mode).
    pub const WANT_LEASE: u8 = 0x04;
    /// Lease: it grants REMOTE_WRITE (else REMOTE_READ).
    pub const LEASE_WRITE: u8 = 0x01;
    /// Send*: an immediate value is present.
    pub const HAS_IMM: u8 = 0x01;
    /// Send* / WriteImmNotify: solicited event.
    pub const SOLICITED: u8 = 0x02;
    /// Send* / WriteImmNotify: the sender QP's `rnr_retry` (3 bits).
    pub const RNR_RETRY: u8 = 0x1c;
    /// Shift of [`RNR_RETRY`].
    pub const RNR_RETRY_SHIFT: u8 = 2;
}

/// Per-opcode field offsets (absolute, from the start of the message).
pub mod layout {
    use core::ops::Range;
    /// A byte range within the message.
    pub type Field = Range<usize>;

    /// Byte: format version.
    pub const VERSION: usize = 0;
    /// Byte: opcode.
    pub const OPCODE: usize = 1;
    /// Byte: slots the message spans.
    pub const NSLOTS: usize = 2;
    /// Byte: flags.
    pub const FLAGS: usize = 3;
    /// Content length.
    pub const LEN: Field = 4..6;
    /// Byte: status.
    pub const STATUS: usize = 6;
    /// Byte: kind (fault / atomic).
    pub const KIND: usize = 7;
    /// Request id.
    pub const REQ_ID: Field = 8..12;
    /// End of the common header.
    pub const HEADER_LEN: usize = 12;

    // KeyQuery / KeyRevoke
    /// KeyQuery / KeyRevoke: the rkey.
    pub const KEY_RKEY: Field = 12..16;

    // KeySync: `len` entries of KEY_ENTRY_LEN bytes from KEY_ENTRIES.
    /// KeySync: first entry.
    pub const KEY_ENTRIES: usize = 16;
    /// KeySync: bytes per entry.
    pub const KEY_ENTRY_LEN: usize = 40;
    /// Offsets inside one key entry.
    pub const KE_APP_RKEY: Field = 0..4;
    /// Key entry: Write MR rkey.
    pub const KE_WRITE_RKEY: Field = 4..8;
    /// Key entry: Version MR rkey.
    pub const KE_VERSION_RKEY: Field = 8..12;
    /// Key entry: pages of the region.
    pub const KE_PAGE_COUNT: Field = 12..16;
    /// Key entry: region start.
    pub const KE_REGION_VA: Field = 16..24;
    /// Key entry: region length.
    pub const KE_REGION_LEN: Field = 24..32;
    /// Key entry: version table address.
    pub const KE_VERSION_VA: Field = 32..40;

    // FaultRequest (kind = READ/WRITE)
    /// FaultRequest: length.
    pub const FAULT_LEN: Field = 12..16;
    /// FaultRequest: initiator buffer.
    pub const FAULT_LADDR: Field = 16..24;
    /// FaultRequest: key of the initiator buffer.
    pub const FAULT_LKEY: Field = 24..28;
    /// FaultRequest: target rkey.
    pub const FAULT_RKEY: Field = 28..32;
    /// FaultRequest: target address.
    pub const FAULT_RADDR: Field = 32..40;
    /// FaultRequest: end.
    pub const FAULT_END: usize = 40;

    // WriteInline
    /// WriteInline: rkey.
    pub const WRITE_INLINE_RKEY: Field = 12..16;
    /// WriteInline: target address.
    pub const WRITE_INLINE_RADDR: Field = 16..24;
    /// WriteInline: first data byte.
    pub const WRITE_INLINE_DATA: usize = 24;

    // ReadInline
    /// ReadInline: length.
    pub const READ_INLINE_LEN: Field = 12..16;
    /// ReadInline: target address.
    pub const READ_INLINE_RADDR: Field = 16..24;
    /// ReadInline: rkey.
    pub const READ_INLINE_RKEY: Field = 24..28;
    /// ReadInline: end.
    pub const READ_INLINE_END: usize = 28;

    // ReadInlineResp
    /// ReadInlineResp: first data byte.
    pub const READ_RESP_DATA: usize = 12;

    // Completion
    /// Completion: bytes transferred.
    pub const COMP_BYTE_LEN: Field = 12..16;

    // AtomicRequest (kind = CMP_SWP/FETCH_ADD)
    /// AtomicRequest: rkey.
    pub const ATOMIC_RKEY: Field = 12..16;
    /// AtomicRequest: target address.
    pub const ATOMIC_RADDR: Field = 16..24;
    /// AtomicRequest: compare value or addend.
    pub const ATOMIC_COMPARE_ADD: Field = 24..32;
    /// AtomicRequest: swap value.
    pub const ATOMIC_SWAP: Field = 32..40;
    /// AtomicRequest: end.
    pub const ATOMIC_END: usize = 40;

    // AtomicResp
    /// AtomicResp: original value.
    pub const ATOMIC_ORIG: Field = 16..24;

    // SendRendezvous
    /// SendRendezvous: length.
    pub const RDV_LEN: Field = 12..16;
    /// SendRendezvous: sender buffer.
    pub const RDV_ADDR: Field = 16..24;
    /// SendRendezvous: key of the sender buffer.
    pub const RDV_KEY: Field = 24..28;
    /// SendRendezvous: immediate data.
    pub const RDV_IMM: Field = 28..32;
    /// SendRendezvous: end.
    pub const RDV_END: usize = 32;

    // SendInline
    /// SendInline: immediate data.
    pub const SEND_INLINE_IMM: Field = 12..16;
    /// SendInline: first data byte.
    pub const SEND_INLINE_DATA: usize = 16;

    // WriteImmNotify
    /// WriteImmNotify: length.
    pub const WIMM_LEN: Field = 12..16;
    /// WriteImmNotify: address.
    pub const WIMM_ADDR: Field = 16..24;
    /// WriteImmNotify: rkey.
    pub const WIMM_RKEY: Field = 24..28;
    /// WriteImmNotify: immediate data.
    pub const WIMM_IMM: Field = 28..32;
    /// WriteImmNotify: end.
    pub const WIMM_END: usize = 32;

    // Lease
    /// u32: the application rkey of the leased range.
    pub const LEASE_RKEY: Field = 12..16;
    /// u32: the NIC rkey of the target's registration.
    pub const LEASE_KEY: Field = 16..20;
    /// u32: milliseconds the lease holds.
    pub const LEASE_MS: Field = 20..24;
    /// u64: start of the leased range.
    pub const LEASE_ADDR: Field = 24..32;
    /// u64: length of the leased range.
    pub const LEASE_LEN: Field = 32..40;
    /// u32: the lease's grant number (bumped by every renewal).
    pub const LEASE_SEQ: Field = 40..44;
    /// End of a Lease message's content.
    pub const LEASE_END: usize = 44;

    // LeaseRelease
    /// u32: the NIC rkey of the lease.
    pub const RELEASE_KEY: Field = 12..16;
    /// u32: the last grant number of it the initiator saw.
    pub const RELEASE_SEQ: Field = 16..20;
    /// End of a LeaseRelease message's content.
    pub const RELEASE_END: usize = 20;
}

/// Errors from decoding or encoding control messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CtrlError {
    /// The buffer is shorter than the message claims (or than one slot).
    #[error("truncated control message: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes there.
        have: usize,
    },
    /// Byte 0 is not [`VERSION`].
    #[error("unsupported control message version {0}")]
    BadVersion(u8),
    /// Unknown opcode byte.
    #[error("unknown control opcode {0}")]
    UnknownOpcode(u8),
    /// Unknown status byte.
    #[error("unknown control status {0}")]
    UnknownStatus(u8),
    /// `nslots` is zero or not the size the content needs.
    #[error("bad slot count {nslots} (content needs {need})")]
    BadSlotCount {
        /// Slot count in the header.
        nslots: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Inline data or key entries run past the message's slots.
    #[error("bad length: content ends at byte {end}, message has {cap}")]
    BadLength {
        /// Where the content ends.
        end: usize,
        /// Bytes the message has.
        cap: usize,
    },
    /// Inline length above the configured maximum.
    #[error("inline length {len} exceeds the maximum {max}")]
    InlineTooLong {
        /// Length in bytes.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// Too many key entries for one message.
    #[error("{count} key entries exceed the per-message maximum {max}")]
    TooManyEntries {
        /// How many.
        count: usize,
        /// The maximum.
        max: usize,
    },
    /// An enumerated or flag field holds an undefined value.
    #[error("invalid value {value:#x} in field {field}")]
    BadField {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The output buffer is too small for the message.
    #[error("output buffer too small: need {need} bytes, have {have}")]
    BufferTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes there.
        have: usize,
    },
}

#[cfg(test)]
mod tests;
