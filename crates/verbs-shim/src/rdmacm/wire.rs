//! The connection manager's messages between two processes' CMs, carried on one TCP
//! connection per rdma_cm connection (so a peer that dies closes it): the IB CM's
//! exchange (REQ, MRA, REP, RTU, REJ, DREQ, DREP; SIDR for UD) as a typed [`Msg`]
//! with its byte form, each frame a big-endian `u16` length and the body.

/// Private data limits (the IB CM's, after rdma_cm's header in a REQ).
pub const REQ_PRIVATE_MAX: usize = 56;
/// A REP's (and, here, a REJ's) private data.
pub const REP_PRIVATE_MAX: usize = 196;
/// A SIDR REQ's private data (rdma_cm: 216 less its 36-byte header).
pub const SIDR_REQ_PRIVATE_MAX: usize = 180;
/// A SIDR REP's private data.
pub const SIDR_REP_PRIVATE_MAX: usize = 136;
/// The longest frame body.
pub const FRAME_MAX: usize = 512;

/// One side's queue pair, as a REQ or REP states it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QpInfo {
    /// The sender's GID 0 (the address its QPs are reached at).
    pub gid: [u8; 16],
    /// Its QP number.
    pub qpn: u32,
    /// The first PSN it sends with.
    pub psn: u32,
    /// `responder_resources` it offers.
    pub responder_resources: u8,
    /// `initiator_depth` it asks for.
    pub initiator_depth: u8,
    /// `retry_count` (REQ only).
    pub retry_count: u8,
    /// `rnr_retry_count`.
    pub rnr_retry_count: u8,
    /// Whether the QP has an SRQ.
    pub srq: bool,
    /// The UD Q_Key (SIDR only).
    pub qkey: u32,
}

/// A CM message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Connection request (`sidr`: a UD service-ID resolution request).
    Req {
        /// UD (SIDR) rather than RC.
        sidr: bool,
        /// The requester's QP.
        qp: QpInfo,
        /// The address the requester connected to (its `rdma_resolve_addr` target).
        dst: std::net::SocketAddr,
        /// Private data.
        private: Vec<u8>,
    },
    /// "Message received": the passive side has the REQ and will answer.
    Mra,
    /// Connection (or SIDR) reply.
    Rep {
        /// The replier's QP.
        qp: QpInfo,
        /// Private data.
        private: Vec<u8>,
    },
    /// Ready to use: the requester has the REP.
    Rtu,
    /// Rejection with the IB CM reason (`status` of the REJECTED event).
    Rej {
        /// The reason.
        reason: u16,
        /// Private data.
        private: Vec<u8>,
    },
    /// Disconnect request.
    Dreq,
    /// Disconnect reply.
    Drep,
}

/// A frame that does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

const T_REQ: u8 = 1;
const T_MRA: u8 = 2;
const T_REP: u8 = 3;
const T_RTU: u8 = 4;
const T_REJ: u8 = 5;
const T_DREQ: u8 = 6;
const T_DREP: u8 = 7;

fn put_qp(b: &mut Vec<u8>, q: &QpInfo) {
    b.extend_from_slice(&q.gid);
    b.extend_from_slice(&q.qpn.to_be_bytes());
    b.extend_from_slice(&q.psn.to_be_bytes());
    b.extend_from_slice(&[
        q.responder_resources,
        q.initiator_depth,
        q.retry_count,
        q.rnr_retry_count,
        u8::from(q.srq),
    ]);
    b.extend_from_slice(&q.qkey.to_be_bytes());
}

fn put_private(b: &mut Vec<u8>, p: &[u8]) {
    b.push(p.len() as u8);
    b.extend_from_slice(p);
}

/// A reader over a frame body.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed);
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Malformed> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().map_err(|_| Malformed)?,
        ))
    }
    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().map_err(|_| Malformed)?,
        ))
    }
    fn qp(&mut self) -> Result<QpInfo, Malformed> {
        let gid: [u8; 16] = self.take(16)?.try_into().map_err(|_| Malformed)?;
        let qpn = self.u32()?;
        let psn = self.u32()?;
        let f = self.take(5)?;
        Ok(QpInfo {
            gid,
            qpn,
            psn,
            responder_resources: f[0],
            initiator_depth: f[1],
            retry_count: f[2],
            rnr_retry_count: f[3],
            srq: f[4] != 0,
            qkey: self.u32()?,
        })
    }
    fn private(&mut self, max: usize) -> Result<Vec<u8>, Malformed> {
        let n = self.u8()? as usize;
        if n > max {
            return Err(Malformed);
        }
        Ok(self.take(n)?.to_vec())
    }
    fn end(&self) -> Result<(), Malformed> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed)
        }
    }
}

impl Msg {
    /// The framed bytes (length prefix included).
    pub fn frame(&self) -> Vec<u8> {
        let mut b = vec![0, 0];
        match self {
            Msg::Req {
                sidr,
                qp,
                dst,
                private,
            } => {
                b.push(T_REQ);
                b.push(u8::from(*sidr));
                put_qp(&mut b, qp);
                b.extend_from_slice(&crate::rdmacm::sockaddr::gid_of(dst.ip()));
                b.extend_from_slice(&dst.port().to_be_bytes());
                put_private(&mut b, private);
            }
            Msg::Mra => b.push(T_MRA),
            Msg::Rep { qp, private } => {
                b.push(T_REP);
                put_qp(&mut b, qp);
                put_private(&mut b, private);
            }
            Msg::Rtu => b.push(T_RTU),
            Msg::Rej { reason, private } => {
                b.push(T_REJ);
                b.extend_from_slice(&reason.to_be_bytes());
                put_private(&mut b, private);
            }
            Msg::Dreq => b.push(T_DREQ),
            Msg::Drep => b.push(T_DREP),
        }
        let n = (b.len() - 2) as u16;
        b[..2].copy_from_slice(&n.to_be_bytes());
        b
    }

    /// Parse one frame body (without its length prefix).
    pub fn parse(body: &[u8]) -> Result<Msg, Malformed> {
        let mut c = Cursor(body);
        let m = match c.u8()? {
            T_REQ => {
                let sidr = c.u8()? != 0;
                let qp = c.qp()?;
                let ip16: [u8; 16] = c.take(16)?.try_into().map_err(|_| Malformed)?;
                let v6 = std::net::Ipv6Addr::from(ip16);
                let ip = v6
                    .to_ipv4_mapped()
                    .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4);
                let dst = std::net::SocketAddr::new(ip, c.u16()?);
                let max = if sidr {
                    SIDR_REQ_PRIVATE_MAX
                } else {
                    REQ_PRIVATE_MAX
                };
                Msg::Req {
                    sidr,
                    qp,
                    dst,
                    private: c.private(max)?,
                }
            }
            T_MRA => Msg::Mra,
            T_REP => Msg::Rep {
                qp: c.qp()?,
                private: c.private(REP_PRIVATE_MAX)?,
            },
            T_RTU => Msg::Rtu,
            T_REJ => Msg::Rej {
                reason: c.u16()?,
                private: c.private(REP_PRIVATE_MAX)?,
            },
            T_DREQ => Msg::Dreq,
            T_DREP => Msg::Drep,
            _ => return Err(Malformed),
        };
        c.end()?;
        Ok(m)
    }
}

/// Split complete frames off the front of `buf` (bytes read so far), leaving a partial
/// one in place. A frame longer than [`FRAME_MAX`] or one that does not parse is an
/// error (the connection is then dropped).
pub fn drain(buf: &mut Vec<u8>) -> Result<Vec<Msg>, Malformed> {
    let mut out = Vec::new();
    let mut at = 0;
    while buf.len() - at >= 2 {
        let n = u16::from_be_bytes([buf[at], buf[at + 1]]) as usize;
        if n == 0 || n > FRAME_MAX {
            return Err(Malformed);
        }
        if buf.len() - at - 2 < n {
            break;
        }
        out.push(Msg::parse(&buf[at + 2..at + 2 + n])?);
        at += 2 + n;
    }
    buf.drain(..at);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Msg> {
        let qp = QpInfo {
            gid: [7; 16],
            qpn: 0x1234,
            psn: 0xabcdef,
            responder_resources: 4,
            initiator_depth: 2,
            retry_count: 7,
            rnr_retry_count: 6,
            srq: true,
            qkey: 0x1234567,
        };
        vec![
            Msg::Req {
                sidr: false,
                qp: qp.clone(),
                dst: "127.0.0.1:7174".parse().unwrap(),
                private: vec![9; REQ_PRIVATE_MAX],
            },
            Msg::Req {
                sidr: true,
                qp: qp.clone(),
                dst: "[fe80::1]:1".parse().unwrap(),
                private: vec![],
            },
            Msg::Mra,
            Msg::Rep {
                qp,
                private: vec![1; REP_PRIVATE_MAX],
            },
            Msg::Rtu,
            Msg::Rej {
                reason: 28,
                private: vec![3; 5],
            },
            Msg::Dreq,
            Msg::Drep,
        ]
    }

    #[test]
    fn frames_round_trip_in_pieces() {
        let mut bytes = Vec::new();
        for m in all() {
            bytes.extend(m.frame());
        }
        // Fed one byte at a time, every message comes out once, in order.
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for b in bytes {
            buf.push(b);
            got.extend(drain(&mut buf).unwrap());
        }
        assert_eq!(got, all());
        assert!(buf.is_empty());
    }

    #[test]
    fn malformed_frames_are_errors_not_panics() {
        // Oversize private data, unknown type, trailing bytes, zero and huge lengths.
        let mut req = all()[0].frame();
        let pos = req.len() - REQ_PRIVATE_MAX - 1;
        req[pos] = (REQ_PRIVATE_MAX + 1) as u8;
        assert_eq!(Msg::parse(&req[2..]), Err(Malformed));
        assert_eq!(Msg::parse(&[99]), Err(Malformed));
        assert_eq!(Msg::parse(&[T_RTU, 0]), Err(Malformed));
        assert_eq!(drain(&mut vec![0, 0]), Err(Malformed));
        assert_eq!(drain(&mut vec![0xff, 0xff, 1]), Err(Malformed));
        // Every truncation of every message fails cleanly.
        for m in all() {
            let f = m.frame();
            for cut in 0..f.len() - 2 {
                assert_eq!(
                    Msg::parse(&f[2..2 + cut]),
                    Err(Malformed),
                    "{m:?} cut at {cut}"
                );
            }
        }
    }
}
