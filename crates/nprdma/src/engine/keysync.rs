//! Pushing key-table changes to the peers whose initial sync happened: new
//! MRs and revoked keys.

use std::borrow::Cow;

use super::backend::Backend;
use super::state::{Shared, State};
use crate::ctrl::{KeyMapping, Repr};

/// Tell every peer whose initial key sync happened about a new MR (the
/// others learn it with the whole table on their first use; pushing to a
/// peer QP not yet connected would kill our control QP).
pub(crate) fn broadcast_keysync<N: Backend>(sh: &Shared<N>, st: &mut State<N>, m: KeyMapping) {
    for qp in st.qps.iter_mut().flatten() {
        if qp.connected && qp.keys_served && !qp.dead {
            qp.send_ctrl(
                &sh.cfg.ctrl,
                &Repr::KeySync {
                    req_id: 0,
                    more: false,
                    entries: Cow::Owned(vec![m]),
                },
            );
        }
    }
}

/// Tell every peer whose initial key sync happened to forget `rkey` (the
/// others never got it).
pub(crate) fn broadcast_revoke<N: Backend>(sh: &Shared<N>, st: &mut State<N>, rkey: u32) {
    for qp in st.qps.iter_mut().flatten() {
        if qp.connected && qp.keys_served && !qp.dead {
            qp.send_ctrl(&sh.cfg.ctrl, &Repr::KeyRevoke { req_id: 0, rkey });
        }
    }
}
