//! The applications' data and key streams: self-describing checksummed blocks
//! (cache items, shuffle partitions) and the uniform / zipfian key generator.
//!
//! A block is `[tag u64][version u64][checksum u64][len u64]` followed by a
//! payload whose words are a function of (tag, version); the checksum is a hash
//! of the payload. A reader that knows (tag, version) checks the header and the
//! checksum of what it actually received, so a torn, stale or misplaced block
//! is caught, never counted as verified.

/// Bytes of a block header.
pub const HEADER: usize = 32;

/// splitmix64: a fast, well-mixed 64-bit generator step.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn seed(tag: u64, version: u64) -> u64 {
    mix(tag ^ mix(version.wrapping_add(0x5bd1_e995)))
}

/// The checksum of `payload` (whole words; a trailing partial word is padded).
pub fn checksum(payload: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut it = payload.chunks_exact(8);
    for w in &mut it {
        let x = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        h = (h ^ x).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(5);
    }
    let rest = it.remainder();
    if !rest.is_empty() {
        let mut b = [0u8; 8];
        b[..rest.len()].copy_from_slice(rest);
        h = (h ^ u64::from_le_bytes(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Write block (tag, version) into `buf` (its whole length).
pub fn fill(buf: &mut [u8], tag: u64, version: u64) {
    if buf.len() < HEADER {
        buf.fill(0);
        return;
    }
    let s = seed(tag, version);
    let (hdr, payload) = buf.split_at_mut(HEADER);
    let mut it = payload.chunks_exact_mut(8);
    for (i, w) in (&mut it).enumerate() {
        w.copy_from_slice(&mix(s ^ i as u64).to_le_bytes());
    }
    let rest = it.into_remainder();
    let n = rest.len();
    rest.copy_from_slice(&mix(!s).to_le_bytes()[..n]);
    let sum = checksum(payload);
    let len = payload.len() as u64;
    for (i, v) in [tag, version, sum, len].into_iter().enumerate() {
        hdr[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
}

fn word(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]))
}

/// Check that `buf` holds block (tag, version) intact; the reason if not.
pub fn verify(buf: &[u8], tag: u64, version: u64) -> Result<(), String> {
    if buf.len() < HEADER {
        return Err(format!(
            "block of {} B is shorter than its header",
            buf.len()
        ));
    }
    let (t, v, sum, len) = (word(buf, 0), word(buf, 1), word(buf, 2), word(buf, 3));
    if t != tag {
        return Err(format!("block {tag}: holds block {t} (misplaced)"));
    }
    if v != version {
        return Err(format!(
            "block {tag}: version {v}, expected {version} (stale or lost write)"
        ));
    }
    let payload = &buf[HEADER..];
    if len != payload.len() as u64 {
        return Err(format!(
            "block {tag}: length {len} in header, {} read",
            payload.len()
        ));
    }
    let got = checksum(payload);
    if got != sum {
        return Err(format!(
            "block {tag} v{version}: checksum {got:#x} != {sum:#x} (torn or corrupted)"
        ));
    }
    Ok(())
}

/// A small fast PRNG (xorshift64*), seeded per front-end thread.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [0, n) (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Key distribution over `n` keys: uniform, or zipfian with exponent θ
/// (rank r drawn with probability ∝ 1/(r+1)^θ), ranks scattered over the key
/// space by a fixed permutation so the hot keys are not neighbours.
pub struct KeyDist {
    n: u64,
    /// Cumulative probabilities by rank (zipfian); empty = uniform.
    cdf: Vec<f64>,
    mult: u64,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl KeyDist {
    /// `theta` = None: uniform; Some(θ), θ ≥ 0: zipfian.
    pub fn new(n: u64, theta: Option<f64>) -> KeyDist {
        let n = n.max(1);
        let cdf = match theta {
            None => Vec::new(),
            Some(t) => {
                let mut acc = 0.0;
                let mut v: Vec<f64> = (0..n)
                    .map(|r| {
                        acc += 1.0 / ((r + 1) as f64).powf(t);
                        acc
                    })
                    .collect();
                for x in &mut v {
                    *x /= acc;
                }
                v
            }
        };
        let mut mult = 0x9e37_79b1 % n;
        while n > 1 && (mult == 0 || gcd(mult, n) != 1) {
            mult = (mult + 1) % n;
        }
        KeyDist {
            n,
            cdf,
            mult: mult.max(1),
        }
    }

    /// The rank-`r` key.
    pub fn key_of_rank(&self, r: u64) -> u64 {
        ((r as u128 * self.mult as u128) % self.n as u128) as u64
    }

    /// Draw a key.
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        let rank = if self.cdf.is_empty() {
            rng.below(self.n)
        } else {
            let u = rng.unit();
            self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u64
        };
        self.key_of_rank(rank)
    }

    /// The fraction of draws that fall on the `k` most popular keys.
    pub fn mass_of_top(&self, k: u64) -> f64 {
        if k == 0 {
            return 0.0;
        }
        if self.cdf.is_empty() {
            (k as f64 / self.n as f64).min(1.0)
        } else {
            self.cdf[(k.min(self.n) - 1) as usize]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_verify_and_detect_damage() {
        let mut b = vec![0u8; 8192];
        fill(&mut b, 42, 3);
        assert_eq!(verify(&b, 42, 3), Ok(()));
        assert!(verify(&b, 42, 4).unwrap_err().contains("stale"));
        assert!(verify(&b, 41, 3).unwrap_err().contains("misplaced"));
        b[5000] ^= 1;
        assert!(verify(&b, 42, 3).unwrap_err().contains("checksum"));
        // A block torn between two versions fails too.
        let mut a = vec![0u8; 8192];
        let mut c = vec![0u8; 8192];
        fill(&mut a, 7, 1);
        fill(&mut c, 7, 2);
        a[4096..].copy_from_slice(&c[4096..]);
        assert!(verify(&a, 7, 1).is_err());
        // Odd lengths (shuffle partitions) round-trip.
        let mut o = vec![0u8; 1000 + 3];
        fill(&mut o, 9, 0);
        assert_eq!(verify(&o, 9, 0), Ok(()));
        assert!(verify(&o[..20], 9, 0).is_err());
    }

    #[test]
    fn zipf_is_skewed_and_uniform_is_not() {
        let z = KeyDist::new(10_000, Some(0.99));
        let u = KeyDist::new(10_000, None);
        assert!(z.mass_of_top(1000) > 0.6, "{}", z.mass_of_top(1000));
        assert!((u.mass_of_top(1000) - 0.1).abs() < 1e-9);
        let mut rng = Rng::new(1);
        let hot: std::collections::HashSet<u64> = (0..1000).map(|r| z.key_of_rank(r)).collect();
        assert_eq!(hot.len(), 1000, "the rank permutation is a bijection");
        let draws = 20_000;
        let hits = (0..draws)
            .filter(|_| hot.contains(&z.sample(&mut rng)))
            .count();
        let frac = hits as f64 / draws as f64;
        assert!((frac - z.mass_of_top(1000)).abs() < 0.03, "{frac}");
        assert!((0..draws).all(|_| u.sample(&mut rng) < 10_000));
    }
}
