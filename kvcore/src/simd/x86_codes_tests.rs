//! Tests of the AVX-512 codes kernels: byte lookups against the shift path, and the VBMI
//! kernels against the plain ones.

use super::*;
use crate::simd::KeyRange;

/// Deterministic bytes (SplitMix64).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

/// Code `i` of LSB-first `bits`-bit codes.
fn code_at(codes: &[u8], bits: usize, i: usize) -> usize {
    (0..bits)
        .map(|b| {
            let at = i * bits + b;
            usize::from(codes[at / 8] >> (at % 8) & 1) << b
        })
        .sum()
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn expand_both<const NZ: usize>(codec: &Codec, row: &[u8]) -> [[f32; 16]; 2 * 16] {
    let mut out = [[0.0f32; 16]; 2 * 16];
    for (vbmi, half) in [(false, 0), (true, 16)] {
        let e: [__m512; NZ] = match Expander::new(codec, vbmi, NZ) {
            Expander::Packed { lut: Some(lut), .. } => {
                // SAFETY: this function runs only where the CPU has AVX-512 F, BW, VBMI.
                unsafe { byte_lookup::<NZ>(row, &lut) }
            }
            Expander::Packed {
                bits, cb, packing, ..
            } => {
                // SAFETY: as above.
                unsafe { packed::<NZ>(row, bits, &cb, &packing) }
            }
            _ => [_mm512_setzero_ps(); NZ],
        };
        for (o, r) in out[half..].iter_mut().zip(e) {
            store512(o, r);
        }
    }
    out
}

fn has_vbmi() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
}

#[test]
fn byte_lookups_give_each_coordinate_its_centroid_like_the_shift_path() {
    // Every packed width and head_dim the VBMI kernels take, rows of random codes (every
    // bit pattern is a valid code), the row at the end of its buffer: both expansions give
    // exactly the centroid of each coordinate's code, in natural order.
    assert!(
        !vbmi() || has_vbmi(),
        "the VBMI kernels on a CPU without VBMI"
    );
    if !has_vbmi() {
        // Nothing to compare on this CPU; the kernels never take the path here.
        assert!(!takes_vbmi((&tq(6, 64), &tq(5, 64)), 64));
        return;
    }
    for bits in [2u8, 3, 5, 6] {
        for d in [64usize, 128, 256] {
            let codec = tq(bits, d);
            for seed in 0..8 {
                let row = bytes(seed * 31 + u64::from(bits), codec.code_bytes());
                // SAFETY: the CPU has the features (checked above).
                let out = unsafe {
                    match d {
                        64 => expand_both::<4>(&codec, &row),
                        128 => expand_both::<8>(&codec, &row),
                        _ => expand_both::<16>(&codec, &row),
                    }
                };
                for i in 0..d {
                    let want = codec.codebook()[code_at(&row, usize::from(bits), i)];
                    let (shift, lookup) = (out[i / 16][i % 16], out[16 + i / 16][i % 16]);
                    assert_eq!(shift.to_bits(), want.to_bits(), "tq{bits} d{d} shift {i}");
                    assert_eq!(lookup.to_bits(), want.to_bits(), "tq{bits} d{d} vbmi {i}");
                }
            }
        }
    }
}

fn tq(bits: u8, d: usize) -> Codec {
    Codec::new(CodecKind::TurboQuant { bits }, d, 7).unwrap()
}

/// The plain and the VBMI kernels (decode, and causal over `limits`) on one job.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VBMI; `job.d` is 64, 128 or 256.
unsafe fn both_kernels(
    job: &CodesJob<'_>,
    causal: &CausalCodes<'_>,
) -> ((Partial, Partial), (Partial, Partial)) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let decode = (attend_on(false, job), attend_on(true, job));
        let prefill = match job.d {
            64 => (causal_n::<4>(causal), causal_vbmi::<4>(causal)),
            128 => (causal_n::<8>(causal), causal_vbmi::<8>(causal)),
            _ => (causal_n::<16>(causal), causal_vbmi::<16>(causal)),
        };
        (decode, prefill)
    }
}

#[test]
fn the_vbmi_kernels_give_the_plain_kernels_bits() {
    // Decode and causal kernels over random codes of every head_dim the VBMI kernels take,
    // packed streams with each other and with TQ4 and Q8 (a key range that starts and ends
    // inside a tile, blocks out of order): the VBMI kernels and the plain AVX-512 ones agree
    // to the bit, so the scalar-reference tests of the tier cover both.
    if !has_vbmi() {
        assert!(!takes_vbmi((&tq(6, 64), &tq(5, 64)), 64));
        return;
    }
    let (group, rows) = (3usize, 16 * 37);
    let q8 = |d| Codec::new(CodecKind::Q8, d, 7).unwrap();
    for d in [64usize, 128, 256] {
        for (kc, vc) in [
            (tq(6, d), tq(5, d)),
            (tq(5, d), tq(6, d)),
            (tq(3, d), tq(2, d)),
            (q8(d), tq(5, d)),
            (tq(6, d), tq(4, d)),
        ] {
            let half = |seed| {
                // f16 norms in [0.5, 2): exponent bits fixed, random mantissa.
                bytes(seed, rows)
                    .iter()
                    .flat_map(|&b| (0x3800u16 | u16::from(b) << 2).to_le_bytes())
                    .collect::<Vec<u8>>()
            };
            let (k_codes, v_codes) = (
                bytes(11, rows * kc.code_bytes()),
                bytes(12, rows * vc.code_bytes()),
            );
            let (k_norms, v_norms) = (half(13), half(14));
            let layer = LayerBytes {
                k_codes: &k_codes,
                v_codes: &v_codes,
                k_norms: &k_norms,
                v_norms: &v_norms,
                k_code_row: kc.code_bytes(),
                v_code_row: vc.code_bytes(),
                k_norm_row: kc.norm_bytes(),
                v_norm_row: vc.norm_bytes(),
            };
            let slots: Vec<u32> = (0..37).rev().collect();
            let keys = KeyRange {
                slots: &slots,
                block_size: 16,
                kv_heads: 1,
                g: 0,
                start: 5,
                end: rows - 3,
                trace: false,
            };
            let q: Vec<f32> = bytes(15, 8 * group * d)
                .iter()
                .map(|&b| f32::from(b) / 64.0 - 2.0)
                .collect();
            let job = CodesJob {
                codecs: (&kc, &vc),
                bytes: &layer,
                keys: &keys,
                q: &q[..group * d],
                qp: &q[..group * d],
                scale: 0.125,
                group,
                d,
            };
            let limits = [100, 200, 333, 400, 401, 500, 560, rows - 3];
            let causal = CausalCodes {
                codecs: (&kc, &vc),
                bytes: &layer,
                keys: &keys,
                q: &q,
                q_apart: &[],
                limits: &limits,
                group,
                d,
            };
            let name = format!("{}/{} d{d}", kc.kind(), vc.kind());
            // SAFETY: the CPU has AVX-512 F, BW and VBMI (checked above); d is one the
            // VBMI kernels take.
            let ((plain, fast), (plain_c, fast_c)) = unsafe { both_kernels(&job, &causal) };
            assert_eq!(plain, fast, "decode {name}");
            assert!(plain.sum.iter().all(|s| s.is_finite() && *s > 0.0));
            assert_eq!(plain_c, fast_c, "causal {name}");
            assert!(plain_c.sum.iter().all(|s| s.is_finite() && *s > 0.0));
        }
    }
}
