//! Decoded control messages ([`Repr`]) with `parse` and `emit`.

use std::borrow::Cow;

use super::layout as l;
use super::packet::{content_end, data_offset};
use super::{flags, slots_for, CtrlConfig, CtrlError, Opcode, Packet, Status, SLOT};

/// One key mapping: how to reach an application MR of the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyMapping {
    /// The rkey the application knows (the Read MR's rkey).
    pub app_rkey: u32,
    /// rkey of the auxiliary Write MR (absent pages → black hole).
    pub write_rkey: u32,
    /// rkey of the pinned version-table MR.
    pub version_rkey: u32,
    /// Pages covered by the region (entries in the version table).
    pub page_count: u32,
    /// Region start (application virtual address).
    pub region_va: u64,
    /// Region length in bytes.
    pub region_len: u64,
    /// Address of the region's first version word (in the version MR).
    pub version_va: u64,
}

/// READ or WRITE in a fault-handling request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FaultKind {
    /// Initiator reads target memory (target does a reverse WRITE).
    Read = 1,
    /// Initiator writes target memory (target does a reverse READ).
    Write = 2,
}

/// Two-sided fault-handling request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FaultRequest {
    /// Request id (answers echo it).
    pub req_id: u32,
    /// READ or WRITE.
    pub kind: FaultKind,
    /// Initiator buffer (pinned by the initiator for the request's lifetime).
    pub local_addr: u64,
    /// Key the target uses to reach `local_addr` with its reverse op.
    pub local_key: u32,
    /// Target address.
    pub remote_addr: u64,
    /// Application rkey of the target region.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u32,
    /// The target may answer inline instead of a reverse operation.
    pub inline_ok: bool,
    /// Answer ReceiverReady after pinning; the initiator retries one-sided.
    pub retry_mode: bool,
    /// The initiator would take a [`Repr::Lease`] on the range.
    pub want_lease: bool,
}

/// Atomic operation kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AtomicKind {
    /// Compare-and-swap.
    CmpSwap = 1,
    /// Fetch-and-add.
    FetchAdd = 2,
}

/// Atomic request executed by the target CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicRequest {
    /// Request id (answers echo it).
    pub req_id: u32,
    /// Which atomic.
    pub kind: AtomicKind,
    /// Target address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Compare value (CMP_SWP) or addend (FETCH_ADD).
    pub compare_add: u64,
    /// Swap value (CMP_SWP; zero for FETCH_ADD).
    pub swap: u64,
}

/// A decoded control message. Inline data borrows from the packet on parse
/// (`Cow::Borrowed`); key entries are decoded into a vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repr<'a> {
    /// Ask for key mappings: one rkey, or `None` for all.
    KeyQuery {
        /// Request id (answers echo it).
        req_id: u32,
        /// Remote key.
        rkey: Option<u32>,
    },
    /// Key mappings; `more` = further KeySync messages follow.
    KeySync {
        /// Request id (answers echo it).
        req_id: u32,
        /// Further KeySync messages follow.
        more: bool,
        /// The mappings.
        entries: Cow<'a, [KeyMapping]>,
    },
    /// Forget the mapping of `rkey`.
    KeyRevoke {
        /// Request id (answers echo it).
        req_id: u32,
        /// Remote key.
        rkey: u32,
    },
    /// Fault-handling request.
    Fault(FaultRequest),
    /// WRITE with inline data.
    WriteInline {
        /// Request id (answers echo it).
        req_id: u32,
        /// Target address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// The initiator would take a [`Repr::Lease`] on the page(s).
        want_lease: bool,
        /// The payload.
        data: Cow<'a, [u8]>,
    },
    /// READ to be answered inline.
    ReadInline {
        /// Request id (answers echo it).
        req_id: u32,
        /// Target address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// The initiator would take a [`Repr::Lease`] on the page(s).
        want_lease: bool,
        /// Length in bytes.
        len: u32,
    },
    /// Inline READ data (empty unless `status` is Ok).
    ReadInlineResp {
        /// Request id (answers echo it).
        req_id: u32,
        /// Outcome.
        status: Status,
        /// The payload.
        data: Cow<'a, [u8]>,
    },
    /// Completion of request `req_id`.
    Completion {
        /// Request id (answers echo it).
        req_id: u32,
        /// Outcome.
        status: Status,
        /// Bytes transferred.
        byte_len: u32,
    },
    /// Retry mode: pages pinned, retry one-sided now.
    ReceiverReady {
        /// Request id (answers echo it).
        req_id: u32,
        /// Outcome.
        status: Status,
    },
    /// Retry mode: done, unpin.
    Release {
        /// Request id (answers echo it).
        req_id: u32,
    },
    /// Atomic request.
    Atomic(AtomicRequest),
    /// Atomic response with the original value.
    AtomicResp {
        /// Request id (answers echo it).
        req_id: u32,
        /// Outcome.
        status: Status,
        /// The value before the atomic.
        original: u64,
    },
    /// SEND by rendezvous (receiver reverse-READs `addr`).
    SendRendezvous {
        /// Request id (answers echo it).
        req_id: u32,
        /// Address.
        addr: u64,
        /// Length in bytes.
        len: u32,
        /// Key the receiver reads it through.
        key: u32,
        /// Immediate data.
        imm: Option<u32>,
        /// The SEND was solicited.
        solicited: bool,
        /// The sender QP's `rnr_retry` (0–7, 7 = forever): how long the
        /// receiver holds the message for a RECV before answering
        /// [`Status::RnrNoRecv`] (see the engine's receiver-not-ready rule).
        rnr_retry: u8,
    },
    /// SEND with inline data.
    SendInline {
        /// Request id (answers echo it).
        req_id: u32,
        /// Immediate data.
        imm: Option<u32>,
        /// The SEND was solicited.
        solicited: bool,
        /// The sender QP's `rnr_retry` (0–7, 7 = forever): how long the
        /// receiver holds the message for a RECV before answering
        /// [`Status::RnrNoRecv`] (see the engine's receiver-not-ready rule).
        rnr_retry: u8,
        /// The payload.
        data: Cow<'a, [u8]>,
    },
    /// A WRITE-with-immediate landed at `addr..addr+len` (under `rkey`).
    WriteImmNotify {
        /// Request id (answers echo it).
        req_id: u32,
        /// Address.
        addr: u64,
        /// Length in bytes.
        len: u32,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
        /// The SEND was solicited.
        solicited: bool,
        /// The sender QP's `rnr_retry` (0–7, 7 = forever): how long the
        /// receiver holds the message for a RECV before answering
        /// [`Status::RnrNoRecv`] (see the engine's receiver-not-ready rule).
        rnr_retry: u8,
    },
    /// A lease on the target's registration of `[addr, addr+len)` of the
    /// application MR `rkey` (user-space mode; sent before the answer to
    /// request `req_id`): one-sided READs (`write`: WRITEs) of that range may
    /// use the NIC key `key` until `ms` milliseconds after the request was
    /// sent, as the initiator's clock counts them (the target keeps the
    /// registration at least that long after it sends this).
    Lease {
        /// The request it answers.
        req_id: u32,
        /// The application rkey of the range.
        rkey: u32,
        /// The NIC rkey of the target's registration.
        key: u32,
        /// Start of the leased range.
        addr: u64,
        /// Length of the leased range.
        len: u64,
        /// REMOTE_WRITE (else REMOTE_READ).
        write: bool,
        /// Milliseconds the initiator may use the lease for.
        ms: u32,
        /// The grant's number: a renewal bumps it ([`Repr::LeaseRelease`]
        /// names the last one the initiator saw).
        seq: u32,
    },
    /// The initiator is done with the lease `key` as of grant `seq`: its time
    /// of use is over and no operation of it on the lease is in flight. The
    /// target drops the lease unless it renewed it since (a later `seq`).
    LeaseRelease {
        /// The NIC rkey of the lease.
        key: u32,
        /// The last grant number the initiator saw.
        seq: u32,
    },
    /// Padding over `slots` slots.
    Pad {
        /// Slots the padding covers.
        slots: u8,
    },
}

fn bad(field: &'static str, value: u64) -> CtrlError {
    CtrlError::BadField { field, value }
}

fn check_flags(flags: u8, allowed: u8) -> Result<(), CtrlError> {
    if flags & !allowed != 0 {
        return Err(bad("flags", flags as u64));
    }
    Ok(())
}

fn check_inline(len: usize, cfg: &CtrlConfig) -> Result<(), CtrlError> {
    if len > cfg.max_inline || len > u16::MAX as usize {
        return Err(CtrlError::InlineTooLong {
            len,
            max: cfg.max_inline.min(u16::MAX as usize),
        });
    }
    Ok(())
}

fn rd32(b: &[u8], f: l::Field) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[f]);
    u32::from_le_bytes(a)
}
fn rd64(b: &[u8], f: l::Field) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[f]);
    u64::from_le_bytes(a)
}

impl<'a> Repr<'a> {
    /// Parse untrusted bytes (validates structure and configuration limits).
    pub fn parse_bytes(bytes: &'a [u8], cfg: &CtrlConfig) -> Result<Repr<'a>, CtrlError> {
        Repr::parse(&Packet::new_checked(bytes)?, cfg)
    }

    /// Decode a checked packet. Fields an opcode does not use must be zero;
    /// unknown flag bits, kinds and statuses are rejected.
    pub fn parse(p: &Packet<&'a [u8]>, cfg: &CtrlConfig) -> Result<Repr<'a>, CtrlError> {
        p.check_len()?;
        let op = p.opcode()?;
        let bytes: &'a [u8] = p.clone().into_inner();
        let fl = p.flags();
        let len = p.len_field() as usize;
        let req_id = p.req_id();
        let uses_status = matches!(
            op,
            Opcode::ReadInlineResp
                | Opcode::Completion
                | Opcode::ReceiverReady
                | Opcode::AtomicResp
        );
        let uses_kind = matches!(op, Opcode::FaultRequest | Opcode::AtomicRequest);
        let uses_len = matches!(op, Opcode::KeySync) || data_offset(op).is_some();
        if !uses_status && p.status_raw() != 0 {
            return Err(bad("status", p.status_raw() as u64));
        }
        if !uses_kind && p.kind() != 0 {
            return Err(bad("kind", p.kind() as u64));
        }
        if !uses_len && len != 0 {
            return Err(bad("len", len as u64));
        }
        if op == Opcode::Pad {
            check_flags(fl, 0)?;
            if req_id != 0 {
                return Err(bad("req_id", req_id as u64));
            }
            return Ok(Repr::Pad {
                slots: p.nslots() as u8,
            });
        }
        // Structural length check: content within the message's slots.
        let end = content_end(op, len).unwrap_or(0);
        if end > p.total_len() {
            return Err(CtrlError::BadLength {
                end,
                cap: p.total_len(),
            });
        }
        let status = || Status::try_from(p.status_raw());
        let data = || -> Result<Cow<'a, [u8]>, CtrlError> {
            check_inline(len, cfg)?;
            let off = data_offset(op).unwrap_or(l::HEADER_LEN);
            Ok(Cow::Borrowed(&bytes[off..off + len]))
        };
        let imm = |present: bool, f: l::Field| present.then(|| rd32(bytes, f));
        Ok(match op {
            Opcode::KeyQuery => {
                check_flags(fl, flags::ALL)?;
                let all = fl & flags::ALL != 0;
                let rkey = rd32(bytes, l::KEY_RKEY);
                if all && rkey != 0 {
                    return Err(bad("rkey", rkey as u64));
                }
                Repr::KeyQuery {
                    req_id,
                    rkey: (!all).then_some(rkey),
                }
            }
            Opcode::KeySync => {
                check_flags(fl, flags::MORE)?;
                if len > cfg.max_key_entries() {
                    return Err(CtrlError::TooManyEntries {
                        count: len,
                        max: cfg.max_key_entries(),
                    });
                }
                let entries = (0..len)
                    .map(|i| {
                        let off = l::KEY_ENTRIES + i * l::KEY_ENTRY_LEN;
                        let e = &bytes[off..off + l::KEY_ENTRY_LEN];
                        KeyMapping {
                            app_rkey: rd32(e, l::KE_APP_RKEY),
                            write_rkey: rd32(e, l::KE_WRITE_RKEY),
                            version_rkey: rd32(e, l::KE_VERSION_RKEY),
                            page_count: rd32(e, l::KE_PAGE_COUNT),
                            region_va: rd64(e, l::KE_REGION_VA),
                            region_len: rd64(e, l::KE_REGION_LEN),
                            version_va: rd64(e, l::KE_VERSION_VA),
                        }
                    })
                    .collect::<Vec<_>>();
                Repr::KeySync {
                    req_id,
                    more: fl & flags::MORE != 0,
                    entries: Cow::Owned(entries),
                }
            }
            Opcode::KeyRevoke => {
                check_flags(fl, 0)?;
                Repr::KeyRevoke {
                    req_id,
                    rkey: rd32(bytes, l::KEY_RKEY),
                }
            }
            Opcode::FaultRequest => {
                check_flags(fl, flags::INLINE_OK | flags::RETRY_MODE | flags::WANT_LEASE)?;
                let kind = match p.kind() {
                    1 => FaultKind::Read,
                    2 => FaultKind::Write,
                    k => return Err(bad("fault kind", k as u64)),
                };
                Repr::Fault(FaultRequest {
                    req_id,
                    kind,
                    local_addr: rd64(bytes, l::FAULT_LADDR),
                    local_key: rd32(bytes, l::FAULT_LKEY),
                    remote_addr: rd64(bytes, l::FAULT_RADDR),
                    rkey: rd32(bytes, l::FAULT_RKEY),
                    len: rd32(bytes, l::FAULT_LEN),
                    inline_ok: fl & flags::INLINE_OK != 0,
                    retry_mode: fl & flags::RETRY_MODE != 0,
                    want_lease: fl & flags::WANT_LEASE != 0,
                })
            }
            Opcode::WriteInline => {
                check_flags(fl, flags::WANT_LEASE)?;
                Repr::WriteInline {
                    req_id,
                    remote_addr: rd64(bytes, l::WRITE_INLINE_RADDR),
                    rkey: rd32(bytes, l::WRITE_INLINE_RKEY),
                    want_lease: fl & flags::WANT_LEASE != 0,
                    data: data()?,
                }
            }
            Opcode::ReadInline => {
                check_flags(fl, flags::WANT_LEASE)?;
                let rlen = rd32(bytes, l::READ_INLINE_LEN);
                check_inline(rlen as usize, cfg)?;
                Repr::ReadInline {
                    req_id,
                    remote_addr: rd64(bytes, l::READ_INLINE_RADDR),
                    rkey: rd32(bytes, l::READ_INLINE_RKEY),
                    want_lease: fl & flags::WANT_LEASE != 0,
                    len: rlen,
                }
            }
            Opcode::ReadInlineResp => {
                check_flags(fl, 0)?;
                let status = status()?;
                if status != Status::Ok && len != 0 {
                    return Err(bad("len", len as u64));
                }
                Repr::ReadInlineResp {
                    req_id,
                    status,
                    data: data()?,
                }
            }
            Opcode::Completion => {
                check_flags(fl, 0)?;
                Repr::Completion {
                    req_id,
                    status: status()?,
                    byte_len: rd32(bytes, l::COMP_BYTE_LEN),
                }
            }
            Opcode::ReceiverReady => {
                check_flags(fl, 0)?;
                Repr::ReceiverReady {
                    req_id,
                    status: status()?,
                }
            }
            Opcode::Release => {
                check_flags(fl, 0)?;
                Repr::Release { req_id }
            }
            Opcode::AtomicRequest => {
                check_flags(fl, 0)?;
                let kind = match p.kind() {
                    1 => AtomicKind::CmpSwap,
                    2 => AtomicKind::FetchAdd,
                    k => return Err(bad("atomic kind", k as u64)),
                };
                let swap = rd64(bytes, l::ATOMIC_SWAP);
                if kind == AtomicKind::FetchAdd && swap != 0 {
                    return Err(bad("swap", swap));
                }
                Repr::Atomic(AtomicRequest {
                    req_id,
                    kind,
                    remote_addr: rd64(bytes, l::ATOMIC_RADDR),
                    rkey: rd32(bytes, l::ATOMIC_RKEY),
                    compare_add: rd64(bytes, l::ATOMIC_COMPARE_ADD),
                    swap,
                })
            }
            Opcode::AtomicResp => {
                check_flags(fl, 0)?;
                Repr::AtomicResp {
                    req_id,
                    status: status()?,
                    original: rd64(bytes, l::ATOMIC_ORIG),
                }
            }
            Opcode::SendRendezvous => {
                check_flags(fl, flags::HAS_IMM | flags::SOLICITED | flags::RNR_RETRY)?;
                let has = fl & flags::HAS_IMM != 0;
                if !has && rd32(bytes, l::RDV_IMM) != 0 {
                    return Err(bad("imm", rd32(bytes, l::RDV_IMM) as u64));
                }
                Repr::SendRendezvous {
                    req_id,
                    addr: rd64(bytes, l::RDV_ADDR),
                    len: rd32(bytes, l::RDV_LEN),
                    key: rd32(bytes, l::RDV_KEY),
                    imm: imm(has, l::RDV_IMM),
                    solicited: fl & flags::SOLICITED != 0,
                    rnr_retry: (fl & flags::RNR_RETRY) >> flags::RNR_RETRY_SHIFT,
                }
            }
            Opcode::SendInline => {
                check_flags(fl, flags::HAS_IMM | flags::SOLICITED | flags::RNR_RETRY)?;
                let has = fl & flags::HAS_IMM != 0;
                if !has && rd32(bytes, l::SEND_INLINE_IMM) != 0 {
                    return Err(bad("imm", rd32(bytes, l::SEND_INLINE_IMM) as u64));
                }
                Repr::SendInline {
                    req_id,
                    imm: imm(has, l::SEND_INLINE_IMM),
                    solicited: fl & flags::SOLICITED != 0,
                    rnr_retry: (fl & flags::RNR_RETRY) >> flags::RNR_RETRY_SHIFT,
                    data: data()?,
                }
            }
            Opcode::WriteImmNotify => {
                check_flags(fl, flags::SOLICITED | flags::RNR_RETRY)?;
                Repr::WriteImmNotify {
                    req_id,
                    addr: rd64(bytes, l::WIMM_ADDR),
                    len: rd32(bytes, l::WIMM_LEN),
                    rkey: rd32(bytes, l::WIMM_RKEY),
                    imm: rd32(bytes, l::WIMM_IMM),
                    solicited: fl & flags::SOLICITED != 0,
                    rnr_retry: (fl & flags::RNR_RETRY) >> flags::RNR_RETRY_SHIFT,
                }
            }
            Opcode::Lease => {
                check_flags(fl, flags::LEASE_WRITE)?;
                Repr::Lease {
                    req_id,
                    rkey: rd32(bytes, l::LEASE_RKEY),
                    key: rd32(bytes, l::LEASE_KEY),
                    addr: rd64(bytes, l::LEASE_ADDR),
                    len: rd64(bytes, l::LEASE_LEN),
                    write: fl & flags::LEASE_WRITE != 0,
                    ms: rd32(bytes, l::LEASE_MS),
                    seq: rd32(bytes, l::LEASE_SEQ),
                }
            }
            Opcode::LeaseRelease => {
                check_flags(fl, 0)?;
                if req_id != 0 {
                    return Err(bad("req_id", req_id as u64));
                }
                Repr::LeaseRelease {
                    key: rd32(bytes, l::RELEASE_KEY),
                    seq: rd32(bytes, l::RELEASE_SEQ),
                }
            }
            Opcode::Pad => unreachable!("handled above"),
        })
    }

    /// Opcode of this message.
    pub fn opcode(&self) -> Opcode {
        match self {
            Repr::KeyQuery { .. } => Opcode::KeyQuery,
            Repr::KeySync { .. } => Opcode::KeySync,
            Repr::KeyRevoke { .. } => Opcode::KeyRevoke,
            Repr::Fault(_) => Opcode::FaultRequest,
            Repr::WriteInline { .. } => Opcode::WriteInline,
            Repr::ReadInline { .. } => Opcode::ReadInline,
            Repr::ReadInlineResp { .. } => Opcode::ReadInlineResp,
            Repr::Completion { .. } => Opcode::Completion,
            Repr::ReceiverReady { .. } => Opcode::ReceiverReady,
            Repr::Release { .. } => Opcode::Release,
            Repr::Atomic(_) => Opcode::AtomicRequest,
            Repr::AtomicResp { .. } => Opcode::AtomicResp,
            Repr::SendRendezvous { .. } => Opcode::SendRendezvous,
            Repr::SendInline { .. } => Opcode::SendInline,
            Repr::WriteImmNotify { .. } => Opcode::WriteImmNotify,
            Repr::Lease { .. } => Opcode::Lease,
            Repr::LeaseRelease { .. } => Opcode::LeaseRelease,
            Repr::Pad { .. } => Opcode::Pad,
        }
    }

    /// Request id (0 for Pad).
    pub fn req_id(&self) -> u32 {
        match self {
            Repr::KeyQuery { req_id, .. }
            | Repr::KeySync { req_id, .. }
            | Repr::KeyRevoke { req_id, .. }
            | Repr::WriteInline { req_id, .. }
            | Repr::ReadInline { req_id, .. }
            | Repr::ReadInlineResp { req_id, .. }
            | Repr::Completion { req_id, .. }
            | Repr::ReceiverReady { req_id, .. }
            | Repr::Release { req_id }
            | Repr::AtomicResp { req_id, .. }
            | Repr::SendRendezvous { req_id, .. }
            | Repr::SendInline { req_id, .. }
            | Repr::WriteImmNotify { req_id, .. }
            | Repr::Lease { req_id, .. } => *req_id,
            Repr::Fault(f) => f.req_id,
            Repr::Atomic(a) => a.req_id,
            Repr::Pad { .. } | Repr::LeaseRelease { .. } => 0,
        }
    }

    /// The `len` header field this message is emitted with.
    fn len_field(&self) -> usize {
        match self {
            Repr::KeySync { entries, .. } => entries.len(),
            Repr::WriteInline { data, .. }
            | Repr::ReadInlineResp { data, .. }
            | Repr::SendInline { data, .. } => data.len(),
            _ => 0,
        }
    }

    /// Number of slots the emitted message occupies.
    pub fn nslots(&self) -> usize {
        match self {
            Repr::Pad { slots } => *slots as usize,
            _ => slots_for(content_end(self.opcode(), self.len_field()).unwrap_or(SLOT)),
        }
    }

    /// Bytes the emitted message occupies (`nslots * SLOT`).
    pub fn buffer_len(&self) -> usize {
        self.nslots() * SLOT
    }

    /// Check the limits `emit` would enforce.
    pub fn validate(&self, cfg: &CtrlConfig) -> Result<(), CtrlError> {
        match self {
            Repr::KeySync { entries, .. } if entries.len() > cfg.max_key_entries() => {
                Err(CtrlError::TooManyEntries {
                    count: entries.len(),
                    max: cfg.max_key_entries(),
                })
            }
            Repr::WriteInline { data, .. } | Repr::SendInline { data, .. } => {
                check_inline(data.len(), cfg)
            }
            Repr::ReadInlineResp { data, status, .. } => {
                if *status != Status::Ok && !data.is_empty() {
                    return Err(bad("len", data.len() as u64));
                }
                check_inline(data.len(), cfg)
            }
            Repr::ReadInline { len, .. } => check_inline(*len as usize, cfg),
            Repr::Atomic(a) if a.kind == AtomicKind::FetchAdd && a.swap != 0 => {
                Err(bad("swap", a.swap))
            }
            Repr::Pad { slots: 0 } => Err(CtrlError::BadSlotCount { nslots: 0, need: 1 }),
            _ => Ok(()),
        }
    }

    /// Encode into the start of `buf`; returns the bytes written
    /// ([`Repr::buffer_len`]). Unused bytes of the message are zeroed.
    pub fn emit(&self, buf: &mut [u8], cfg: &CtrlConfig) -> Result<usize, CtrlError> {
        self.validate(cfg)?;
        let total = self.buffer_len();
        if buf.len() < total {
            return Err(CtrlError::BufferTooSmall {
                need: total,
                have: buf.len(),
            });
        }
        let msg = &mut buf[..total];
        msg.fill(0);
        let mut p = Packet::new_unchecked(msg);
        let (mut fl, mut status, mut kind) = (0u8, 0u8, 0u8);
        match self {
            Repr::KeyQuery { rkey, .. } => match rkey {
                Some(k) => p.set_u32_field(l::KEY_RKEY, *k),
                None => fl |= flags::ALL,
            },
            Repr::KeySync { more, entries, .. } => {
                if *more {
                    fl |= flags::MORE;
                }
                for (i, e) in entries.iter().enumerate() {
                    let off = l::KEY_ENTRIES + i * l::KEY_ENTRY_LEN;
                    let at = |f: l::Field| off + f.start..off + f.end;
                    p.set_u32_field(at(l::KE_APP_RKEY), e.app_rkey);
                    p.set_u32_field(at(l::KE_WRITE_RKEY), e.write_rkey);
                    p.set_u32_field(at(l::KE_VERSION_RKEY), e.version_rkey);
                    p.set_u32_field(at(l::KE_PAGE_COUNT), e.page_count);
                    p.set_u64_field(at(l::KE_REGION_VA), e.region_va);
                    p.set_u64_field(at(l::KE_REGION_LEN), e.region_len);
                    p.set_u64_field(at(l::KE_VERSION_VA), e.version_va);
                }
            }
            Repr::KeyRevoke { rkey, .. } => p.set_u32_field(l::KEY_RKEY, *rkey),
            Repr::Fault(f) => {
                kind = f.kind as u8;
                if f.inline_ok {
                    fl |= flags::INLINE_OK;
                }
                if f.retry_mode {
                    fl |= flags::RETRY_MODE;
                }
                if f.want_lease {
                    fl |= flags::WANT_LEASE;
                }
                p.set_u32_field(l::FAULT_LEN, f.len);
                p.set_u64_field(l::FAULT_LADDR, f.local_addr);
                p.set_u32_field(l::FAULT_LKEY, f.local_key);
                p.set_u32_field(l::FAULT_RKEY, f.rkey);
                p.set_u64_field(l::FAULT_RADDR, f.remote_addr);
            }
            Repr::WriteInline {
                remote_addr,
                rkey,
                data,
                want_lease,
                ..
            } => {
                if *want_lease {
                    fl |= flags::WANT_LEASE;
                }
                p.set_u32_field(l::WRITE_INLINE_RKEY, *rkey);
                p.set_u64_field(l::WRITE_INLINE_RADDR, *remote_addr);
                p.bytes_mut_from(l::WRITE_INLINE_DATA)[..data.len()].copy_from_slice(data);
            }
            Repr::ReadInline {
                remote_addr,
                rkey,
                len,
                want_lease,
                ..
            } => {
                if *want_lease {
                    fl |= flags::WANT_LEASE;
                }
                p.set_u32_field(l::READ_INLINE_LEN, *len);
                p.set_u64_field(l::READ_INLINE_RADDR, *remote_addr);
                p.set_u32_field(l::READ_INLINE_RKEY, *rkey);
            }
            Repr::ReadInlineResp {
                status: s, data, ..
            } => {
                status = *s as u8;
                p.bytes_mut_from(l::READ_RESP_DATA)[..data.len()].copy_from_slice(data);
            }
            Repr::Completion {
                status: s,
                byte_len,
                ..
            } => {
                status = *s as u8;
                p.set_u32_field(l::COMP_BYTE_LEN, *byte_len);
            }
            Repr::ReceiverReady { status: s, .. } => status = *s as u8,
            Repr::Release { .. } => {}
            Repr::Lease {
                rkey,
                key,
                addr,
                len,
                write,
                ms,
                seq,
                ..
            } => {
                if *write {
                    fl |= flags::LEASE_WRITE;
                }
                p.set_u32_field(l::LEASE_RKEY, *rkey);
                p.set_u32_field(l::LEASE_KEY, *key);
                p.set_u32_field(l::LEASE_MS, *ms);
                p.set_u64_field(l::LEASE_ADDR, *addr);
                p.set_u64_field(l::LEASE_LEN, *len);
                p.set_u32_field(l::LEASE_SEQ, *seq);
            }
            Repr::LeaseRelease { key, seq } => {
                p.set_u32_field(l::RELEASE_KEY, *key);
                p.set_u32_field(l::RELEASE_SEQ, *seq);
            }
            Repr::Atomic(a) => {
                kind = a.kind as u8;
                p.set_u32_field(l::ATOMIC_RKEY, a.rkey);
                p.set_u64_field(l::ATOMIC_RADDR, a.remote_addr);
                p.set_u64_field(l::ATOMIC_COMPARE_ADD, a.compare_add);
                p.set_u64_field(l::ATOMIC_SWAP, a.swap);
            }
            Repr::AtomicResp {
                status: s,
                original,
                ..
            } => {
                status = *s as u8;
                p.set_u64_field(l::ATOMIC_ORIG, *original);
            }
            Repr::SendRendezvous {
                addr,
                len,
                key,
                imm,
                solicited,
                rnr_retry,
                ..
            } => {
                p.set_u32_field(l::RDV_LEN, *len);
                p.set_u64_field(l::RDV_ADDR, *addr);
                p.set_u32_field(l::RDV_KEY, *key);
                if let Some(i) = imm {
                    fl |= flags::HAS_IMM;
                    p.set_u32_field(l::RDV_IMM, *i);
                }
                if *solicited {
                    fl |= flags::SOLICITED;
                }
                fl |= (*rnr_retry).min(7) << flags::RNR_RETRY_SHIFT;
            }
            Repr::SendInline {
                imm,
                solicited,
                rnr_retry,
                data,
                ..
            } => {
                if let Some(i) = imm {
                    fl |= flags::HAS_IMM;
                    p.set_u32_field(l::SEND_INLINE_IMM, *i);
                }
                if *solicited {
                    fl |= flags::SOLICITED;
                }
                fl |= (*rnr_retry).min(7) << flags::RNR_RETRY_SHIFT;
                p.bytes_mut_from(l::SEND_INLINE_DATA)[..data.len()].copy_from_slice(data);
            }
            Repr::WriteImmNotify {
                addr,
                len,
                rkey,
                imm,
                solicited,
                rnr_retry,
                ..
            } => {
                p.set_u32_field(l::WIMM_LEN, *len);
                p.set_u64_field(l::WIMM_ADDR, *addr);
                p.set_u32_field(l::WIMM_RKEY, *rkey);
                p.set_u32_field(l::WIMM_IMM, *imm);
                if *solicited {
                    fl |= flags::SOLICITED;
                }
                fl |= (*rnr_retry).min(7) << flags::RNR_RETRY_SHIFT;
            }
            Repr::Pad { .. } => {}
        }
        p.set_header(
            self.opcode(),
            self.nslots() as u8,
            fl,
            self.len_field() as u16,
            status,
            kind,
            self.req_id(),
        );
        Ok(total)
    }

    /// Convert into an owned (`'static`) message.
    pub fn into_owned(self) -> Repr<'static> {
        match self {
            Repr::KeySync {
                req_id,
                more,
                entries,
            } => Repr::KeySync {
                req_id,
                more,
                entries: Cow::Owned(entries.into_owned()),
            },
            Repr::WriteInline {
                req_id,
                remote_addr,
                rkey,
                want_lease,
                data,
            } => Repr::WriteInline {
                req_id,
                remote_addr,
                rkey,
                want_lease,
                data: Cow::Owned(data.into_owned()),
            },
            Repr::ReadInlineResp {
                req_id,
                status,
                data,
            } => Repr::ReadInlineResp {
                req_id,
                status,
                data: Cow::Owned(data.into_owned()),
            },
            Repr::SendInline {
                req_id,
                imm,
                solicited,
                rnr_retry,
                data,
            } => Repr::SendInline {
                req_id,
                imm,
                solicited,
                rnr_retry,
                data: Cow::Owned(data.into_owned()),
            },
            Repr::KeyQuery { req_id, rkey } => Repr::KeyQuery { req_id, rkey },
            Repr::KeyRevoke { req_id, rkey } => Repr::KeyRevoke { req_id, rkey },
            Repr::Fault(f) => Repr::Fault(f),
            Repr::ReadInline {
                req_id,
                remote_addr,
                rkey,
                want_lease,
                len,
            } => Repr::ReadInline {
                req_id,
                remote_addr,
                rkey,
                want_lease,
                len,
            },
            Repr::Completion {
                req_id,
                status,
                byte_len,
            } => Repr::Completion {
                req_id,
                status,
                byte_len,
            },
            Repr::ReceiverReady { req_id, status } => Repr::ReceiverReady { req_id, status },
            Repr::Release { req_id } => Repr::Release { req_id },
            Repr::Lease {
                req_id,
                rkey,
                key,
                addr,
                len,
                write,
                ms,
                seq,
            } => Repr::Lease {
                req_id,
                rkey,
                key,
                addr,
                len,
                write,
                ms,
                seq,
            },
            Repr::LeaseRelease { key, seq } => Repr::LeaseRelease { key, seq },
            Repr::Atomic(a) => Repr::Atomic(a),
            Repr::AtomicResp {
                req_id,
                status,
                original,
            } => Repr::AtomicResp {
                req_id,
                status,
                original,
            },
            Repr::SendRendezvous {
                req_id,
                addr,
                len,
                key,
                imm,
                solicited,
                rnr_retry,
            } => Repr::SendRendezvous {
                req_id,
                addr,
                len,
                key,
                imm,
                solicited,
                rnr_retry,
            },
            Repr::WriteImmNotify {
                req_id,
                addr,
                len,
                rkey,
                imm,
                solicited,
                rnr_retry,
            } => Repr::WriteImmNotify {
                req_id,
                addr,
                len,
                rkey,
                imm,
                solicited,
                rnr_retry,
            },
            Repr::Pad { slots } => Repr::Pad { slots },
        }
    }
}
