//! Big-endian field access at fixed offsets of a header the caller has already checked is
//! long enough (every view's `new_checked` does): the one place bytes become integers.

/// The big-endian `u16` at `at`.
pub fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// The big-endian 24-bit value at `at`.
pub fn get_u24(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
}

/// The big-endian `u32` at `at`.
pub fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The big-endian `u64` at `at`.
pub fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

/// Writes `v` big-endian at `at`.
pub fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// Writes the low 24 bits of `v` big-endian at `at`.
pub fn put_u24(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

/// Writes `v` big-endian at `at`.
pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

/// Writes `v` big-endian at `at`.
pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_big_endian() {
        let mut b = [0u8; 17];
        put_u16(&mut b, 0, 0x1234);
        put_u24(&mut b, 2, 0xfe_abcdef); // the top byte is dropped
        put_u32(&mut b, 5, 0xdead_beef);
        put_u64(&mut b, 9, 0x0102_0304_0506_0708);
        assert_eq!(
            b,
            [0x12, 0x34, 0xab, 0xcd, 0xef, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8]
        );
        assert_eq!(get_u16(&b, 0), 0x1234);
        assert_eq!(get_u24(&b, 2), 0xab_cdef);
        assert_eq!(get_u32(&b, 5), 0xdead_beef);
        assert_eq!(get_u64(&b, 9), 0x0102_0304_0506_0708);
        assert_eq!(get_u32(&b, 1), 0x34ab_cdef);
    }
}
