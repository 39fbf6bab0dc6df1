//! The transport's test-only fault injector (this kernel has no netem): drops,
//! duplicates, reorders and corrupts outgoing packets at seeded rates, so loss,
//! duplication and reordering are exercised on any machine. Off unless
//! `NPRDMA_WIRE_FAULTS` is set, e.g. `drop=0.01,dup=0.001,reorder=0.01,corrupt=0.001,seed=7`.

use std::collections::VecDeque;

/// Rates (0..=1) of each fault, per packet.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    pub drop: f64,
    pub dup: f64,
    pub reorder: f64,
    pub corrupt: f64,
    pub seed: u64,
}

impl Faults {
    /// Parse `key=value,...` (unknown keys or bad numbers are an error).
    pub fn parse(s: &str) -> Result<Faults, String> {
        let mut f = Faults {
            seed: 1,
            ..Faults::default()
        };
        for kv in s.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("{kv}: want key=value"))?;
            if k == "seed" {
                f.seed = v.parse().map_err(|_| format!("{kv}: bad seed"))?;
                continue;
            }
            let r: f64 = v.parse().map_err(|_| format!("{kv}: bad rate"))?;
            if !(0.0..=1.0).contains(&r) {
                return Err(format!("{kv}: rate outside 0..1"));
            }
            match k {
                "drop" => f.drop = r,
                "dup" => f.dup = r,
                "reorder" => f.reorder = r,
                "corrupt" => f.corrupt = r,
                _ => return Err(format!("{k}: unknown fault (drop, dup, reorder, corrupt, seed)")),
            }
        }
        Ok(f)
    }

    /// From `NPRDMA_WIRE_FAULTS` (None when unset or empty; a bad value is reported
    /// and ignored).
    pub fn from_env() -> Option<Faults> {
        let s = std::env::var("NPRDMA_WIRE_FAULTS").ok()?;
        if s.trim().is_empty() {
            return None;
        }
        match Faults::parse(&s) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::error!("NPRDMA_WIRE_FAULTS ignored: {e}");
                None
            }
        }
    }
}

/// What the injector did, for the transport's counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct Injected {
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
}

/// The injector's state: a seeded generator and the packet held back to reorder.
pub struct Injector {
    f: Faults,
    x: u64,
    held: Option<Vec<u8>>,
    pub counts: Injected,
}

impl Injector {
    pub fn new(f: Faults) -> Injector {
        Injector {
            f,
            x: f.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            held: None,
            counts: Injected::default(),
        }
    }

    fn next(&mut self) -> f64 {
        // xorshift64*
        self.x ^= self.x >> 12;
        self.x ^= self.x << 25;
        self.x ^= self.x >> 27;
        (self.x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Apply the faults to `pkts` (in sending order), producing what goes out.
    pub fn apply(&mut self, pkts: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
        let mut out = VecDeque::with_capacity(pkts.len() + 2);
        for mut p in pkts {
            if self.next() < self.f.drop {
                self.counts.dropped += 1;
                continue;
            }
            if self.next() < self.f.corrupt && !p.is_empty() {
                let i = (self.next() * p.len() as f64) as usize % p.len();
                p[i] ^= 0x5a;
                self.counts.corrupted += 1;
            }
            if self.next() < self.f.dup {
                self.counts.duplicated += 1;
                out.push_back(p.clone());
            }
            if self.held.is_none() && self.next() < self.f.reorder {
                // Goes out after the next packet.
                self.counts.reordered += 1;
                self.held = Some(p);
                continue;
            }
            out.push_back(p);
            if let Some(h) = self.held.take() {
                out.push_back(h);
            }
        }
        // Never keep a packet past the batch: the last one of a burst would otherwise
        // wait for traffic that may never come.
        if let Some(h) = self.held.take() {
            out.push_back(h);
        }
        out.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        let f = Faults::parse("drop=0.01, dup=0.5,seed=9").unwrap();
        assert_eq!((f.drop, f.dup, f.seed), (0.01, 0.5, 9));
        assert!(Faults::parse("drop=2").is_err());
        assert!(Faults::parse("lose=0.1").is_err());
        assert!(Faults::parse("drop").is_err());
    }

    #[test]
    fn rates_are_roughly_honoured_and_seeded() {
        let f = Faults::parse("drop=0.1,dup=0.05,reorder=0.05,corrupt=0.02,seed=3").unwrap();
        let run = || {
            let mut inj = Injector::new(f);
            let pkts: Vec<Vec<u8>> = (0..10_000u32).map(|i| i.to_be_bytes().to_vec()).collect();
            let out = inj.apply(pkts);
            (out, inj.counts)
        };
        let (a, ca) = run();
        let (b, _) = run();
        assert_eq!(a, b, "same seed, same faults");
        assert!((800..1200).contains(&ca.dropped), "{ca:?}");
        assert!((350..650).contains(&ca.duplicated), "{ca:?}");
        assert!(ca.reordered > 300 && ca.corrupted > 100, "{ca:?}");
        assert_eq!(a.len() as u64, 10_000 - ca.dropped + ca.duplicated);
        let in_order = a.windows(2).filter(|w| w[0] <= w[1]).count();
        assert!(in_order < a.len() - 1, "something was reordered");
    }

    #[test]
    fn off_changes_nothing() {
        let mut inj = Injector::new(Faults::default());
        let pkts: Vec<Vec<u8>> = (0..100u8).map(|i| vec![i]).collect();
        assert_eq!(inj.apply(pkts.clone()), pkts);
    }
}
