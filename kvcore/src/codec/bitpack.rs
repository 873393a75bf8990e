//! LSB-first bit packing of 2- to 6-bit codes.
//!
//! Code `i` of a row occupies bits `[i·b, (i+1)·b)` of the row's byte string, least significant
//! bit first. With head_dim a multiple of 8, every row is exactly `head_dim·b/8` bytes and every
//! group of 8 codes is exactly `b` bytes, which is what the readers below iterate over.

/// Packs `idx` (each `< 2^bits`) into `out` (`idx.len()·bits/8` bytes).
pub(crate) fn pack(idx: &[u8], bits: u8, out: &mut [u8]) {
    let b = usize::from(bits);
    for (group, bytes) in idx.chunks_exact(8).zip(out.chunks_exact_mut(b)) {
        let mut word = 0u64;
        for (i, &v) in group.iter().enumerate() {
            word |= u64::from(v) << (i * b);
        }
        for (j, o) in bytes.iter_mut().enumerate() {
            *o = (word >> (8 * j)) as u8;
        }
    }
}

/// Calls `f(position, code)` for every code of a packed row, in order.
#[inline(always)]
pub(crate) fn for_each_code(packed: &[u8], bits: u8, mut f: impl FnMut(usize, usize)) {
    match bits {
        4 => {
            for (j, &byte) in packed.iter().enumerate() {
                f(2 * j, usize::from(byte & 0x0F));
                f(2 * j + 1, usize::from(byte >> 4));
            }
        }
        2 => {
            for (j, &byte) in packed.iter().enumerate() {
                f(4 * j, usize::from(byte & 3));
                f(4 * j + 1, usize::from((byte >> 2) & 3));
                f(4 * j + 2, usize::from((byte >> 4) & 3));
                f(4 * j + 3, usize::from(byte >> 6));
            }
        }
        _ => {
            let b = usize::from(bits);
            let mask = (1u64 << b) - 1;
            for (g, bytes) in packed.chunks_exact(b).enumerate() {
                let mut word = 0u64;
                for (j, &byte) in bytes.iter().enumerate() {
                    word |= u64::from(byte) << (8 * j);
                }
                for i in 0..8 {
                    f(8 * g + i, ((word >> (i * b)) & mask) as usize);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pack_then_read_round_trips(bits in 2u8..=6, groups in 1usize..16, seed in any::<u64>()) {
            let mut rng = crate::codec::rng::SplitMix64::new(seed);
            let idx: Vec<u8> = (0..groups * 8).map(|_| (rng.next_u64() % (1 << bits)) as u8).collect();
            let mut packed = vec![0u8; idx.len() * usize::from(bits) / 8];
            pack(&idx, bits, &mut packed);
            let mut back = vec![0u8; idx.len()];
            for_each_code(&packed, bits, |i, c| back[i] = c as u8);
            prop_assert_eq!(back, idx);
        }
    }

    #[test]
    fn four_bit_layout_is_low_nibble_first() {
        let mut out = [0u8; 4];
        pack(&[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut out);
        assert_eq!(out, [0x21, 0x43, 0x65, 0x87]);
    }
}
