//! The host's subnet: LIDs of the devices of one user on this machine. Each device
//! that joins holds a slot of a small shared file (`/dev/shm/nprdma-subnet-<uid>`)
//! while it lives: slot number = LID, its content = the device's [`HostAddr`] and the
//! GIDs it answers to. The slot is held by an OFD lock on its first byte, so a process
//! that dies frees its LID without a word; a reader sees a slot live only while
//! someone holds that lock, and only with a content whose checksum holds. A LID also
//! fixes the device's QP numbers, `[LID << 14, (LID + 1) << 14)`, so a QP number names
//! its device (an IP-addressed GID says which host, not which process).

use crate::error::{Error, Result};
use crate::verbs::HostAddr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Highest LID handed out (LIDs 1..=MAX_LID; LID L owns QPNs `[L << 14, (L+1) << 14)`,
/// all of them below 2^24).
pub const MAX_LID: u16 = 1023;
/// Bits of a QP number below the LID.
pub const QPN_SHIFT: u32 = 14;
/// GIDs a slot lists.
pub const SLOT_GIDS: usize = 24;
const SLOT: u64 = 512;
const MAGIC: u32 = 0x4e50_4c44; // "NPLD"

/// The QP numbers of the device with `lid`.
pub fn qpn_range(lid: u16) -> (u32, u32) {
    ((lid as u32) << QPN_SHIFT, (lid as u32 + 1) << QPN_SHIFT)
}

/// The LID whose device owns QP number `qpn` (0 if none can).
pub fn lid_of_qpn(qpn: u32) -> u16 {
    let l = qpn >> QPN_SHIFT;
    if (1..=MAX_LID as u32).contains(&l) {
        l as u16
    } else {
        0
    }
}

/// What a live slot says of its device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Where the device's NIC is reached.
    pub addr: HostAddr,
    /// The GIDs the device answers to (its GID table but GID 0).
    pub gids: Vec<[u8; 16]>,
}

/// The registry file of this user.
pub fn default_path() -> PathBuf {
    let uid = rustix::process::geteuid().as_raw();
    PathBuf::from(format!("/dev/shm/nprdma-subnet-{uid}"))
}

fn open(path: &Path) -> Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    let want = SLOT * (MAX_LID as u64 + 1);
    if f.metadata().map_err(|e| Error::Io(e.to_string()))?.len() < want {
        f.set_len(want).map_err(|e| Error::Io(e.to_string()))?;
    }
    Ok(f)
}

/// `F_OFD_SETLK` (`set`) or `F_OFD_GETLK` on the first byte of slot `lid`: for a
/// set, whether the lock was taken; for a get, whether someone else holds it.
fn ofd_lock(f: &File, lid: u16, set: bool) -> Result<bool> {
    // SAFETY: plain C data.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = (lid as u64 * SLOT) as libc::off_t;
    fl.l_len = 1;
    let cmd = if set { libc::F_OFD_SETLK } else { libc::F_OFD_GETLK };
    // SAFETY: `f` is an open file; `fl` a valid flock the call reads and (GETLK) writes.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut fl) };
    if r == 0 {
        return Ok(if set { true } else { fl.l_type != libc::F_UNLCK as i16 });
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) if set => Ok(false),
        _ => Err(Error::Io(format!("subnet lock: {e}"))),
    }
}

fn checksum(b: &[u8]) -> u32 {
    // FNV-1a: a torn read (a slot being rewritten) fails it.
    b.iter()
        .fold(0x811c_9dc5u32, |h, &x| (h ^ x as u32).wrapping_mul(0x0100_0193))
}

fn encode(e: &Entry) -> [u8; SLOT as usize] {
    let mut b = [0u8; SLOT as usize];
    b[4..8].copy_from_slice(&MAGIC.to_le_bytes());
    b[8..24].copy_from_slice(&e.addr.to_bytes());
    let n = e.gids.len().min(SLOT_GIDS);
    b[24..28].copy_from_slice(&(n as u32).to_le_bytes());
    for (i, g) in e.gids.iter().take(n).enumerate() {
        b[32 + 16 * i..48 + 16 * i].copy_from_slice(g);
    }
    let c = checksum(&b[4..]);
    b[0..4].copy_from_slice(&c.to_le_bytes());
    b
}

fn decode(b: &[u8; SLOT as usize]) -> Option<Entry> {
    let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    if word(4) != MAGIC || word(0) != checksum(&b[4..]) {
        return None;
    }
    let n = (word(24) as usize).min(SLOT_GIDS);
    Some(Entry {
        addr: HostAddr::from_bytes(b[8..24].try_into().expect("16 bytes")),
        gids: (0..n)
            .map(|i| b[32 + 16 * i..48 + 16 * i].try_into().expect("16 bytes"))
            .collect(),
    })
}

/// A LID held by this process (released when dropped or when the process dies).
pub struct Lease {
    lock: File,
    lid: u16,
}

impl Lease {
    /// Take the lowest free LID of the registry at `path`.
    pub fn claim(path: &Path) -> Result<Lease> {
        let f = open(path)?;
        for lid in 1..=MAX_LID {
            if ofd_lock(&f, lid, true)? {
                // Whatever a dead holder left is not this device's.
                f.write_all_at(&[0u8; SLOT as usize], lid as u64 * SLOT)
                    .map_err(|e| Error::Io(e.to_string()))?;
                return Ok(Lease { lock: f, lid });
            }
        }
        Err(Error::NoResources("LIDs (every subnet slot is held)"))
    }

    /// The LID.
    pub fn lid(&self) -> u16 {
        self.lid
    }

    /// Say what the device is (its address and GIDs), for peers to find it by LID.
    pub fn publish(&self, e: &Entry) -> Result<()> {
        self.lock
            .write_all_at(&encode(e), self.lid as u64 * SLOT)
            .map_err(|e| Error::Io(e.to_string()))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Clear the slot before the lock goes with the file (a reader that raced the
        // clear still needs the lock held, which it is not once the file closes).
        let _ = self.lock.write_all_at(&[0u8; SLOT as usize], self.lid as u64 * SLOT);
    }
}

/// A reader of the registry at a path (its own open file: OFD locks of another
/// description are seen, including this process's own leases).
pub struct Directory {
    f: File,
}

impl Directory {
    /// Open the registry at `path` (created if absent).
    pub fn open(path: &Path) -> Result<Directory> {
        Ok(Directory { f: open(path)? })
    }

    /// Whether a live device lists `gid` (a scan of every slot: for address handles,
    /// whose GID alone must name some device of the host).
    pub fn any_with_gid(&self, gid: &[u8; 16]) -> bool {
        (1..=MAX_LID).any(|l| self.lookup(l).ok().flatten().is_some_and(|e| e.gids.contains(gid)))
    }

    /// The live device with `lid`, if any.
    pub fn lookup(&self, lid: u16) -> Result<Option<Entry>> {
        if lid == 0 || lid > MAX_LID || !ofd_lock(&self.f, lid, false)? {
            return Ok(None);
        }
        let mut b = [0u8; SLOT as usize];
        self.f
            .read_exact_at(&mut b, lid as u64 * SLOT)
            .map_err(|e| Error::Io(e.to_string()))?;
        Ok(decode(&b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("rnic-subnet-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    fn entry(pid: u32) -> Entry {
        Entry {
            addr: HostAddr { pid, fd: 3, nonce: 7 },
            gids: vec![[1; 16], [2; 16]],
        }
    }

    #[test]
    fn leases_take_distinct_lids_and_free_them() {
        let p = tmp("leases");
        let a = Lease::claim(&p).unwrap();
        let b = Lease::claim(&p).unwrap();
        assert_eq!((a.lid(), b.lid()), (1, 2));
        let d = Directory::open(&p).unwrap();
        // Held but not yet published: no entry.
        assert_eq!(d.lookup(1).unwrap(), None);
        a.publish(&entry(10)).unwrap();
        b.publish(&entry(11)).unwrap();
        assert_eq!(d.lookup(1).unwrap(), Some(entry(10)));
        assert_eq!(d.lookup(2).unwrap(), Some(entry(11)));
        assert_eq!(d.lookup(3).unwrap(), None);
        assert!(d.any_with_gid(&[2; 16]) && !d.any_with_gid(&[3; 16]));
        assert_eq!(d.lookup(0).unwrap(), None);
        assert_eq!(d.lookup(MAX_LID + 1).unwrap(), None);
        drop(a);
        assert_eq!(d.lookup(1).unwrap(), None);
        // The freed LID is taken again first.
        let c = Lease::claim(&p).unwrap();
        assert_eq!(c.lid(), 1);
        assert_eq!(d.lookup(1).unwrap(), None, "the old content is gone");
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_stale_slot_without_its_lock_is_not_live() {
        let p = tmp("stale");
        let a = Lease::claim(&p).unwrap();
        a.publish(&entry(5)).unwrap();
        // Content left behind by a holder that died (no lock): ignored.
        let raw = encode(&entry(6));
        a.lock.write_all_at(&raw, 2 * SLOT).unwrap();
        let d = Directory::open(&p).unwrap();
        assert_eq!(d.lookup(2).unwrap(), None);
        // A torn slot (checksum) is ignored too.
        let mut torn = encode(&entry(5));
        torn[40] ^= 1;
        a.lock.write_all_at(&torn, SLOT).unwrap();
        assert_eq!(d.lookup(1).unwrap(), None);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn qpn_ranges_name_their_lid() {
        assert_eq!(qpn_range(1), (16384, 32768));
        assert_eq!(lid_of_qpn(16384), 1);
        assert_eq!(lid_of_qpn(32767), 1);
        assert_eq!(lid_of_qpn(0x101), 0);
        assert_eq!(lid_of_qpn(qpn_range(MAX_LID).1 - 1), MAX_LID);
        assert!(qpn_range(MAX_LID).1 <= 1 << 24);
        assert_eq!(lid_of_qpn(1 << 24), 0);
    }
}
