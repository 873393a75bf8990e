//! The tensor-core prefill kernel (`tq4_prefill_mma` in `tq4.cu`) emulated on the CPU: the same
//! tile order (key positions [`PREFILL_KEYS`] at a time from 0), the same f16 roundings (the
//! rotated, scaled query; the key centroids; the value centroids times norm·[`VSCALE`]; the
//! softmax weights before the value product), key norms applied to the f32 scores, an online
//! softmax in the log2 domain per tile, and the causal mask by position. CI checks it against
//! kvcore's dense reference, so the tile formulation is tested on every commit; the GPU check
//! (`engram-gpu-check`) holds the kernel to it and to the same bound.
//!
//! Emulation differs from the hardware only in the order of f32 sums inside one MMA and in
//! `ex2.approx` (here `f32::exp2`).

use engram_kvcore::{Codec, TurboQuantTables};
use half::f16;

use crate::mma::VSCALE;
use crate::reference::{Planes, fwht, norm};
use crate::{KernelError, PAGE, PageLayout};

/// Key positions per shared-memory tile (`PF_KT`).
pub const PREFILL_KEYS: usize = 64;

/// 16-position query tiles per CTA by default: `8 / group`, at least one, so that each shared
/// tile serves 96–128 query rows (6 to 8 warps).
pub fn default_query_tiles(group: usize) -> usize {
    (8 / group.max(1)).max(1)
}

/// Warps per CTA: one per (query tile, query head of the group).
pub fn prefill_warps(group: usize, query_tiles: usize) -> usize {
    group * query_tiles
}

/// Dynamic shared memory of one CTA: two sets of key and value tiles in f16 (or, aliasing them,
/// each warp's 16 rotated rows, whichever is larger), three sets of norms, two sets of raw codes
/// staged by `cp.async` two tiles ahead, and the 64 KB pair table (as the decode kernel's).
pub fn prefill_shared_bytes(group: usize, query_tiles: usize, head_dim: usize) -> usize {
    let tiles = 2 * 2 * PREFILL_KEYS * head_dim * 2;
    let rot = prefill_warps(group, query_tiles) * 16 * head_dim * 4;
    tiles.max(rot)
        + 3 * 2 * PREFILL_KEYS * 4
        + 2 * 2 * PREFILL_KEYS * head_dim / 2
        + crate::mma::PAIR_TABLE_BYTES
}

fn round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn tables(codec: &Codec) -> Result<TurboQuantTables, KernelError> {
    let t = codec
        .turboquant_tables()
        .ok_or_else(|| KernelError::Unsupported("not a TurboQuant codec".into()))?;
    if t.bits != 4 {
        return Err(KernelError::Unsupported(format!("{}-bit codes", t.bits)));
    }
    Ok(t)
}

/// Causal attention of `m` queries (`q`: `[m, heads, head_dim]`, model space; query `i` at
/// position `start + i`) over positions `0 ..= start + i` of one sequence's pages
/// (`block_table`, 16-position pages in `layout`); returns `[m, heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn prefill_tiles(
    codec: &Codec,
    group: usize,
    q: &[f32],
    m: usize,
    start: usize,
    planes: &Planes<'_>,
    layout: PageLayout,
    block_table: &[u32],
    scale: f32,
) -> Result<Vec<f32>, KernelError> {
    let t = tables(codec)?;
    let d = codec.head_dim();
    let kv_heads = planes.kv_heads;
    let heads = kv_heads * group;
    let end = start + m;
    if q.len() != m * heads * d || planes.block_size != PAGE || block_table.len() * PAGE < end {
        return Err(KernelError::Invalid(
            "buffer sizes do not match the shape".into(),
        ));
    }
    let (ps, hs) = layout.strides(kv_heads);
    let row_of = |p: usize, g: usize| {
        block_table[p / PAGE] as usize * PAGE * kv_heads + (p % PAGE) * ps + g * hs
    };
    let cbytes = d / 2;
    let code = |codes: &[u8], row: usize, i: usize| -> usize {
        usize::from((codes[row * cbytes + i / 2] >> (4 * (i % 2))) & 15)
    };
    let qscale = t.scale * scale * std::f32::consts::LOG2_E;
    let mut out = vec![0f32; m * heads * d];
    for i in 0..m {
        let qpos = start + i;
        for h in 0..heads {
            let g = h / group;
            let mut qr: Vec<f32> = (0..d)
                .map(|k| q[(i * heads + h) * d + k] * t.signs[k])
                .collect();
            fwht(&mut qr);
            let qf: Vec<f32> = qr.iter().map(|&x| round(x * qscale)).collect();
            let (mut mx, mut l) = (f32::NEG_INFINITY, 0f32);
            let mut o = vec![0f32; d];
            let mut t0 = 0;
            while t0 <= qpos {
                let hi = (t0 + PREFILL_KEYS).min(qpos + 1);
                let scores: Vec<(usize, f32)> = (t0..hi)
                    .map(|p| {
                        let row = row_of(p, g);
                        let dot: f32 = (0..d)
                            .map(|k| qf[k] * round(t.codebook[code(planes.k_codes, row, k)]))
                            .sum();
                        (row, dot * norm(planes.k_norms, row))
                    })
                    .collect();
                let tile_max = scores.iter().map(|s| s.1).fold(f32::NEG_INFINITY, f32::max);
                let new = mx.max(tile_max);
                let f = (mx - new).exp2();
                l *= f;
                o.iter_mut().for_each(|x| *x *= f);
                mx = new;
                for (row, s) in scores {
                    let e = (s - mx).exp2();
                    l += e;
                    let (w, vn) = (round(e), round(norm(planes.v_norms, row) * VSCALE));
                    for (k, x) in o.iter_mut().enumerate() {
                        // f16 centroid times f16 scale: exact in f32, then one rounding.
                        *x += w * round(round(t.codebook[code(planes.v_codes, row, k)]) * vn);
                    }
                }
                t0 += PREFILL_KEYS;
            }
            let inv = 1.0 / (l * VSCALE);
            let mut y: Vec<f32> = o.iter().map(|x| x * inv).collect();
            fwht(&mut y);
            for k in 0..d {
                out[(i * heads + h) * d + k] = y[k] * t.signs[k] * t.scale;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use engram_kvcore::{CodecKind, DEFAULT_ROTATION_SEED, SplitMix64};

    use super::*;
    use crate::reference::{EncodedPlanes, rel_l2};

    /// Dense causal reference: query `i` attends positions `0 ..= start + i` of the decoded rows.
    fn dense(
        data: &EncodedPlanes,
        table: &[u32],
        q: &[f32],
        m: usize,
        start: usize,
        heads: usize,
        d: usize,
    ) -> Vec<f32> {
        (0..m)
            .flat_map(|i| {
                data.attend_dense(
                    table,
                    start + i + 1,
                    &q[i * heads * d..][..heads * d],
                    heads,
                )
                .unwrap()
            })
            .collect()
    }

    /// Head dims 64 and 128, groups 1, 3, 4 and 8; chunks that start at 0, mid-page and
    /// mid-tile, shorter than one tile and crossing several; a shuffled block table; both page
    /// layouts (bitwise equal). The bound is the kernel's (f16 operands): 2e-3 relative L2.
    #[test]
    fn prefill_tiles_match_the_dense_causal_reference() {
        let mut rng = SplitMix64::new(17);
        for (d, group, kv_heads) in [
            (64usize, 3usize, 3usize),
            (128, 4, 2),
            (128, 1, 2),
            (64, 8, 1),
        ] {
            let codec =
                Codec::new(CodecKind::TurboQuant { bits: 4 }, d, DEFAULT_ROTATION_SEED).unwrap();
            let slots = 24;
            let data = EncodedPlanes::random(&codec, slots, kv_heads, PAGE, &mut rng, 1.0).unwrap();
            let [tkc, tkn, tvc, tvn] = data.token_major();
            let token_major = Planes {
                k_codes: &tkc,
                k_norms: &tkn,
                v_codes: &tvc,
                v_norms: &tvn,
                kv_heads,
                block_size: PAGE,
            };
            let table: Vec<u32> = (0..slots as u32)
                .map(|s| (s * 7 + 3) % slots as u32)
                .collect();
            let heads = kv_heads * group;
            let scale = 1.0 / (d as f32).sqrt();
            for (start, m) in [(0usize, 1usize), (0, 70), (37, 100), (130, 9)] {
                // Peaked queries: a softmax that moves across tiles.
                let q: Vec<f32> = rng
                    .gaussian_vec(m * heads * d)
                    .iter()
                    .map(|x| x * 3.0)
                    .collect();
                let got = prefill_tiles(
                    &codec,
                    group,
                    &q,
                    m,
                    start,
                    &data.planes(),
                    PageLayout::HeadMajor,
                    &table,
                    scale,
                )
                .unwrap();
                let want = dense(&data, &table, &q, m, start, heads, d);
                let err = rel_l2(&got, &want);
                assert!(
                    err < 2e-3,
                    "d {d} group {group} start {start} m {m}: {err:.3e}"
                );
                let tgot = prefill_tiles(
                    &codec,
                    group,
                    &q,
                    m,
                    start,
                    &token_major,
                    PageLayout::TokenMajor,
                    &table,
                    scale,
                )
                .unwrap();
                assert_eq!(got, tgot, "layouts differ");
            }
        }
    }

    #[test]
    fn cta_shapes_and_bad_buffers() {
        let shape = |g| {
            (
                default_query_tiles(g),
                prefill_warps(g, default_query_tiles(g)),
            )
        };
        assert_eq!(shape(1), (8, 8));
        assert_eq!(shape(3), (2, 6));
        assert_eq!(shape(4), (2, 8));
        assert_eq!(shape(8), (1, 8));
        // 8 warps × 16 rows × 128 dims × 4 bytes beats the 32 KB of tiles; 6 × 16 × 64 × 4
        // beats 2 × 64 × 64 × 2; 4 × 16 × 128 × 4 equals 2 × 64 × 128 × 2. Then three sets of
        // 128 norms, two sets of 128 raw code rows and the pair table.
        assert_eq!(
            prefill_shared_bytes(8, 1, 128),
            65536 + 1536 + 16384 + 65536
        );
        assert_eq!(prefill_shared_bytes(3, 2, 64), 32768 + 1536 + 8192 + 65536);
        assert_eq!(
            prefill_shared_bytes(4, 1, 128),
            65536 + 1536 + 16384 + 65536
        );
        let codec =
            Codec::new(CodecKind::TurboQuant { bits: 4 }, 64, DEFAULT_ROTATION_SEED).unwrap();
        let planes = Planes::empty(1, PAGE);
        let err = prefill_tiles(
            &codec,
            1,
            &[0.0; 64],
            1,
            20,
            &planes,
            PageLayout::TokenMajor,
            &[0],
            0.125,
        );
        assert!(matches!(err, Err(KernelError::Invalid(_))));
    }
}
