//! Key mapping: an application MR is three NIC MRs (Read, Write, Version);
//! the application only knows the Read MR's rkey. A [`KeyTable`] maps app
//! rkey → (write rkey, version rkey, region, version table) and validates
//! accesses; [`PeerKeys`] is the per-peer copy learned over the control
//! channel with its first-use synchronisation state. The local side keeps
//! its own mappings in a [`KeyTable`] too and chunks them into
//! [`Repr::KeySync`] messages with [`KeyTable::sync_messages`].

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::check::page_span;
use crate::ctrl::{CtrlConfig, KeyMapping, Repr};

/// Bytes per version word in the version table.
pub const VERSION_WORD: u64 = 4;

/// Key-mapping errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyMapError {
    /// No mapping for this rkey (unknown, revoked, or not synced yet).
    #[error("unknown rkey {0:#x}")]
    UnknownKey(u32),
    /// The access does not lie inside the region.
    #[error("access {addr:#x}+{len} outside the region of rkey {rkey:#x}")]
    OutOfBounds {
        /// Remote key.
        rkey: u32,
        /// Address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A mapping that is internally inconsistent.
    #[error("invalid mapping for rkey {rkey:#x}: {reason}")]
    BadMapping {
        /// Remote key.
        rkey: u32,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Page size not a power of two.
    #[error("page size {0} is not a power of two")]
    BadPageSize(usize),
    /// A control message that is not a key-sync message.
    #[error("not a key-mapping message")]
    NotKeyMessage,
}

/// Everything needed to run one operation against a remote region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Translation {
    /// Read MR rkey (what the application passed).
    pub read_rkey: u32,
    /// Write MR rkey (use for one-sided WRITEs).
    pub write_rkey: u32,
    /// Version MR rkey.
    pub version_rkey: u32,
    /// Index of the first touched page within the region.
    pub first_page: u64,
    /// Number of touched pages (0 for a zero-length access).
    pub page_count: u64,
    /// Address of the first touched page's version word.
    pub version_addr: u64,
    /// Bytes of version words covering the access (`4 * page_count`).
    pub version_len: u64,
}

/// A set of key mappings indexed by app rkey.
#[derive(Debug, Clone)]
pub struct KeyTable {
    page_size: usize,
    map: BTreeMap<u32, KeyMapping>,
}

impl KeyTable {
    /// An empty table for `page_size`-byte pages.
    pub fn new(page_size: usize) -> Result<Self, KeyMapError> {
        if !page_size.is_power_of_two() {
            return Err(KeyMapError::BadPageSize(page_size));
        }
        Ok(KeyTable {
            page_size,
            map: BTreeMap::new(),
        })
    }

    /// Page size.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Number of mappings.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// No mappings.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Check a mapping's internal consistency (bounds, page count, version
    /// table range).
    pub fn validate(&self, m: &KeyMapping) -> Result<(), KeyMapError> {
        let bad = |reason| KeyMapError::BadMapping {
            rkey: m.app_rkey,
            reason,
        };
        let (_, pages) =
            page_span(m.region_va, m.region_len, self.page_size).ok_or(bad("region wraps"))?;
        if pages != m.page_count as u64 {
            return Err(bad("page count does not match the region"));
        }
        m.version_va
            .checked_add(pages * VERSION_WORD)
            .ok_or(bad("version table wraps"))?;
        Ok(())
    }

    /// Insert or replace a mapping; returns the one it replaced.
    pub fn insert(&mut self, m: KeyMapping) -> Result<Option<KeyMapping>, KeyMapError> {
        self.validate(&m)?;
        Ok(self.map.insert(m.app_rkey, m))
    }

    /// Remove a mapping.
    pub fn remove(&mut self, rkey: u32) -> Option<KeyMapping> {
        self.map.remove(&rkey)
    }

    /// The mapping of `rkey`.
    pub fn get(&self, rkey: u32) -> Option<&KeyMapping> {
        self.map.get(&rkey)
    }

    /// Validate an access of `len` bytes at `addr` under `rkey` and translate
    /// it. A zero-length access may sit anywhere in `[va, va + len]`.
    pub fn lookup(&self, rkey: u32, addr: u64, len: u64) -> Result<Translation, KeyMapError> {
        let m = self.map.get(&rkey).ok_or(KeyMapError::UnknownKey(rkey))?;
        let oob = KeyMapError::OutOfBounds { rkey, addr, len };
        let end = addr.checked_add(len).ok_or(oob.clone())?;
        let region_end = m.region_va + m.region_len; // validated on insert
        if addr < m.region_va || end > region_end {
            return Err(oob);
        }
        let ps = self.page_size as u64;
        let region_first = m.region_va & !(ps - 1);
        let (first, count) = page_span(addr, len, self.page_size).ok_or(oob)?;
        let first_page = (first - region_first) / ps;
        Ok(Translation {
            read_rkey: m.app_rkey,
            write_rkey: m.write_rkey,
            version_rkey: m.version_rkey,
            first_page,
            page_count: count,
            version_addr: m.version_va + first_page * VERSION_WORD,
            version_len: count * VERSION_WORD,
        })
    }

    /// All mappings as KeySync messages of at most `cfg.max_key_entries()`
    /// entries each, every message but the last flagged `more`. An empty
    /// table yields one empty message (the peer still learns it is synced).
    pub fn sync_messages(&self, req_id: u32, cfg: &CtrlConfig) -> Vec<Repr<'static>> {
        let all: Vec<KeyMapping> = self.map.values().copied().collect();
        let per = cfg.max_key_entries().max(1);
        if all.is_empty() {
            return vec![Repr::KeySync {
                req_id,
                more: false,
                entries: Cow::Owned(Vec::new()),
            }];
        }
        let n = all.len().div_ceil(per);
        all.chunks(per)
            .enumerate()
            .map(|(i, c)| Repr::KeySync {
                req_id,
                more: i + 1 < n,
                entries: Cow::Owned(c.to_vec()),
            })
            .collect()
    }
}

/// First-use key synchronisation state of one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncState {
    /// Nothing requested yet: the first operation must send a KeyQuery.
    Unsynced,
    /// KeyQuery `req_id` sent; operations wait for the last KeySync.
    Pending {
        /// Request id (answers echo it).
        req_id: u32,
    },
    /// Full table received; later MRs arrive as unsolicited KeySync.
    Synced,
}

/// The key mappings learned from one peer.
#[derive(Debug, Clone)]
pub struct PeerKeys {
    table: KeyTable,
    state: SyncState,
}

impl PeerKeys {
    /// Empty and unsynced.
    pub fn new(page_size: usize) -> Result<Self, KeyMapError> {
        Ok(PeerKeys {
            table: KeyTable::new(page_size)?,
            state: SyncState::Unsynced,
        })
    }

    /// Current sync state.
    pub fn state(&self) -> SyncState {
        self.state
    }

    /// The mappings.
    pub fn table(&self) -> &KeyTable {
        &self.table
    }

    /// Whether an operation must wait for (or start) the key sync.
    pub fn needs_sync(&self) -> bool {
        self.state != SyncState::Synced
    }

    /// Record that KeyQuery `req_id` (for all keys) was sent.
    pub fn begin_sync(&mut self, req_id: u32) {
        self.state = SyncState::Pending { req_id };
    }

    /// Apply a KeySync / KeyRevoke message from the peer. All entries are
    /// validated before any is applied. A KeySync without `more` answering
    /// the pending query completes the sync.
    pub fn apply(&mut self, msg: &Repr<'_>) -> Result<(), KeyMapError> {
        match msg {
            Repr::KeySync {
                req_id,
                more,
                entries,
            } => {
                for e in entries.iter() {
                    self.table.validate(e)?;
                }
                for e in entries.iter() {
                    self.table.insert(*e)?;
                }
                if !more && self.state == (SyncState::Pending { req_id: *req_id }) {
                    self.state = SyncState::Synced;
                }
                Ok(())
            }
            Repr::KeyRevoke { rkey, .. } => {
                self.table.remove(*rkey);
                Ok(())
            }
            _ => Err(KeyMapError::NotKeyMessage),
        }
    }

    /// See [`KeyTable::lookup`].
    pub fn lookup(&self, rkey: u32, addr: u64, len: u64) -> Result<Translation, KeyMapError> {
        self.table.lookup(rkey, addr, len)
    }
}

#[cfg(test)]
mod tests;
