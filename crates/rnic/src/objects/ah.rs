//! Address handles (`ibv_create_ah`): a destination host for UD sends, resolved (its
//! segment mapped, if it is another process's) when the handle is created.

use crate::error::Result;
use crate::hw::peer::Peer;
use crate::objects::pd::Pd;
use crate::verbs::{HostAddr, UdDest};
use std::sync::Arc;

impl Pd {
    /// An address handle for host `dest` (a UD destination): fails if no host of that
    /// address can be reached (none in this process; another process's segment does
    /// not open or is another incarnation's).
    pub fn create_ah(&self, dest: HostAddr) -> Result<Ah> {
        let peer = self.host().inner().resolve_peer(dest)?;
        Ok(Ah {
            dest,
            _peer: peer,
            _pd: self.clone(),
        })
    }
}

/// An address handle: a resolved destination host.
#[derive(Clone)]
pub struct Ah {
    dest: HostAddr,
    // Keeps the peer's mapping (the host's peer cache holds it too).
    _peer: Arc<Peer>,
    _pd: Pd,
}

impl Ah {
    /// The destination host (the GID).
    pub fn dest(&self) -> HostAddr {
        self.dest
    }

    /// A UD send's destination: QP `remote_qpn` of this host, presenting
    /// `remote_qkey` (high bit set: the sending QP's own Q_Key).
    pub fn to(&self, remote_qpn: u32, remote_qkey: u32) -> UdDest {
        UdDest {
            dest: self.dest,
            remote_qpn,
            remote_qkey,
        }
    }
}
