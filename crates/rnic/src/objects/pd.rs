//! Protection domains: a PD is a number of its host, which it keeps alive;
//! registration on a PD is in `mr`, QP creation in `qp`.

use crate::error::Result;
use crate::objects::context::{Context, Host};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Context {
    /// Allocate a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd> {
        let id = self.host.inner().next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(Pd::new(self.host.clone(), id))
    }
}

struct PdInner {
    host: Host,
    id: u32,
}

/// A protection domain.
#[derive(Clone)]
pub struct Pd {
    inner: Arc<PdInner>,
}

impl Pd {
    pub(crate) fn new(host: Host, id: u32) -> Pd {
        Pd {
            inner: Arc::new(PdInner { host, id }),
        }
    }
    /// The PD number.
    pub fn id(&self) -> u32 {
        self.inner.id
    }
    /// The host of the PD.
    pub fn host(&self) -> &Host {
        &self.inner.host
    }
}
