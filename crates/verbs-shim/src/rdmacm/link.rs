//! One rdma_cm connection's TCP stream between the two processes' CMs: sending a
//! message (whole frames, from any thread) and the bytes read so far. Closing it (or
//! the peer process dying) is how a connection's end is noticed.

use super::wire::Msg;
use parking_lot::Mutex;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

/// A CM connection's stream.
pub struct Link {
    stream: TcpStream,
    /// Serialises writers (a frame is written whole).
    wr: Mutex<()>,
    /// Bytes read and not yet parsed (the reactor's).
    pub rx: Mutex<Vec<u8>>,
}

impl Link {
    /// Wrap a connected (or connecting, non-blocking) stream.
    pub fn new(stream: TcpStream) -> Link {
        let _ = stream.set_nodelay(true);
        Link {
            stream,
            wr: Mutex::new(()),
            rx: Mutex::new(Vec::new()),
        }
    }

    /// The stream's fd (for the reactor's epoll).
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// The stream.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// This end's address.
    pub fn local(&self) -> Option<SocketAddr> {
        self.stream.local_addr().ok()
    }

    /// The other end's address.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.stream.peer_addr().ok()
    }

    /// Send `m` whole. The stream is non-blocking (the reactor reads it); a frame is at
    /// most a few hundred bytes and the CM sends a handful per connection, so a full
    /// socket buffer means a peer that stopped reading: waited for briefly, then the
    /// send fails (the caller treats the connection as lost).
    pub fn send(&self, m: &Msg) -> std::io::Result<()> {
        let f = m.frame();
        let _g = self.wr.lock();
        let mut at = 0;
        let mut spins = 0u32;
        while at < f.len() {
            match (&self.stream).write(&f[at..]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && spins < 1000 => {
                    spins += 1;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// End the stream both ways (the peer reads EOF).
    pub fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
