//! Values made once per process, fork included: a child made by `fork()` has copies of
//! its parent's memory but not its threads, and its parent's NIC, CM reactor and
//! device segment are the parent's (shared memory, the parent's threads serving them),
//! so the first use in the child makes its own. The parent's copy is left as it is in
//! the child (never dropped there: dropping would join threads the child has not got).

use parking_lot::Mutex;

/// A value per process, made on first use (in each process).
pub struct PerProcess<T: 'static> {
    cell: Mutex<Option<(u32, &'static T)>>,
}

impl<T: 'static> PerProcess<T> {
    /// An empty cell.
    pub const fn new() -> Self {
        PerProcess {
            cell: Mutex::new(None),
        }
    }

    /// This process's value, made by `f` if this process has none yet (`f` runs under
    /// the cell's lock: once per process).
    pub fn get_or_init(&self, f: impl FnOnce() -> T) -> &'static T {
        let pid = std::process::id();
        let mut c = self.cell.lock();
        match *c {
            Some((p, v)) if p == pid => v,
            _ => {
                let v: &'static T = Box::leak(Box::new(f()));
                *c = Some((pid, v));
                v
            }
        }
    }

    /// This process's value, if it has made one.
    pub fn get(&self) -> Option<&'static T> {
        let pid = std::process::id();
        match *self.cell.lock() {
            Some((p, v)) if p == pid => Some(v),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_once_and_again_in_a_child() {
        static C: PerProcess<u32> = PerProcess::new();
        assert!(C.get().is_none());
        assert_eq!(*C.get_or_init(|| 1), 1);
        assert_eq!(*C.get_or_init(|| 2), 1, "once per process");
        // SAFETY: the child only calls async-signal-safe-enough code of its own
        // (no other thread holds the cell's lock) and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let ok = C.get().is_none() && *C.get_or_init(|| 3) == 3;
            // SAFETY: ends the child without running the test harness's exit code.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut st = 0;
        // SAFETY: waiting for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
        assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0);
        assert_eq!(*C.get().unwrap(), 1, "the parent's value is untouched");
    }
}
