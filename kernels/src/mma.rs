//! The tensor-core decode kernel (`tq4_decode_mma` + `tq4_combine_items` in `tq4.cu`) emulated
//! on the CPU lane by lane: the same work items, per-lane byte offsets, pair-table lookups,
//! `mma.m16n8k16` fragments (assembled by the PTX fragment layouts), `movmatrix` transposes,
//! f16 roundings, lazy log2-domain softmax and partial layout as the CUDA code. CI checks it
//! against kvcore's dense reference, so the tile formulation (which lane holds which dims and
//! positions), the split and the combine are tested on every commit, not only on a GPU; the GPU
//! check (`engram-gpu-check`) then holds the kernel to the same bound.
//!
//! Emulation differs from the hardware only in the order of f32 sums inside one MMA and in
//! `ex2.approx` (here `f32::exp2`); both are far below the 2e-3 bound.

// Loops over lanes, tiles and k-steps index several arrays at once, as the CUDA code does.
#![allow(clippy::needless_range_loop)]

use engram_kvcore::Codec;
use half::f16;

use crate::reference::{Planes, fwht, norm};
use crate::{ItemPlan, KernelError, PAGE, PageLayout};

/// `LAZY` of the kernel: the running max moves only when a score passes it by more than this
/// (log2 units), so softmax weights stay ≤ 2^8 before the value norm.
pub const LAZY: f32 = 8.0;
/// `VSCALE` of the kernel: value norms are scaled by 2^-6 before `P·‖v‖` is rounded to f16, so
/// norms up to 16,380 stay finite with `P ≤ 2^LAZY`.
pub const VSCALE: f32 = 1.0 / 64.0;
/// Shared memory of the kernels' pair table (`LUT_WORDS`): 256 byte values × 64 words, word
/// `byte · 64 + lane` = the two f16 centroids of that byte, so each lane reads its own copy.
pub const PAIR_TABLE_BYTES: usize = 256 * 64 * 4;

type Warp<T> = [T; 32];

fn pack(lo: f32, hi: f32) -> u32 {
    u32::from(f16::from_f32(lo).to_bits()) | (u32::from(f16::from_f32(hi).to_bits()) << 16)
}

fn lo(x: u32) -> f32 {
    f16::from_bits(x as u16).to_f32()
}

fn hi(x: u32) -> f32 {
    f16::from_bits((x >> 16) as u16).to_f32()
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`, `d += a·b`, by the PTX fragment
/// layouts: lane `(g, c) = (lane / 4, lane % 4)` holds A rows g, g+8 × columns 2c, 2c+1,
/// 2c+8, 2c+9 (`a[0..4]` = (g, 2c..), (g+8, 2c..), (g, 2c+8..), (g+8, 2c+8..)), B rows 2c, 2c+1
/// (`b[0]`) and 2c+8, 2c+9 (`b[1]`) of column g, and D (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1).
pub fn mma16816(d: &mut Warp<[f32; 4]>, a: &Warp<[u32; 4]>, b: &Warp<[u32; 2]>) {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    for lane in 0..32 {
        let (g, c) = (lane / 4, lane % 4);
        let a = a[lane];
        for (k, (row, col)) in [
            (g, 2 * c),
            (g + 8, 2 * c),
            (g, 2 * c + 8),
            (g + 8, 2 * c + 8),
        ]
        .into_iter()
        .enumerate()
        {
            am[row][col] = lo(a[k]);
            am[row][col + 1] = hi(a[k]);
        }
        let b = b[lane];
        bm[2 * c][g] = lo(b[0]);
        bm[2 * c + 1][g] = hi(b[0]);
        bm[2 * c + 8][g] = lo(b[1]);
        bm[2 * c + 9][g] = hi(b[1]);
    }
    for (lane, d) in d.iter_mut().enumerate() {
        let (g, c) = (lane / 4, lane % 4);
        for (k, (row, col)) in [
            (g, 2 * c),
            (g, 2 * c + 1),
            (g + 8, 2 * c),
            (g + 8, 2 * c + 1),
        ]
        .into_iter()
        .enumerate()
        {
            d[k] += (0..16).map(|i| am[row][i] * bm[i][col]).sum::<f32>();
        }
    }
}

/// `movmatrix.sync.aligned.m8n8.trans.b16`: lane `(g, c)` holds row g, columns 2c, 2c+1 of an
/// 8×8 matrix of 16-bit values before and of its transpose after.
pub fn movmatrix_t(x: &Warp<u32>) -> Warp<u32> {
    let mut m = [[0u16; 8]; 8];
    for (lane, &v) in x.iter().enumerate() {
        let (g, c) = (lane / 4, lane % 4);
        m[g][2 * c] = v as u16;
        m[g][2 * c + 1] = (v >> 16) as u16;
    }
    std::array::from_fn(|lane| {
        let (g, c) = (lane / 4, lane % 4);
        u32::from(m[2 * c][g]) | (u32::from(m[2 * c + 1][g]) << 16)
    })
}

/// The pair table: entry `byte` = half2(codebook[byte & 15], codebook[byte >> 4]).
pub fn pair_table(codebook: &[f32]) -> [u32; 256] {
    std::array::from_fn(|i| pack(codebook[i & 15], codebook[i >> 4]))
}

fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn byte(w: u32, k: usize) -> usize {
    ((w >> (8 * k)) & 0xFF) as usize
}

/// One item's partial for one KV head: per query head of the group, the max (log2 domain), the
/// normalizer and the accumulator (rotated space, true dim order); and per query head and page
/// of the item, the mass variant's records: the running max after the page and what the page
/// added to the normalizer (`tq4_decode_mma_mass`).
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    tile_m: Vec<Vec<f32>>,
    tile_a: Vec<Vec<f32>>,
}

/// Warps of one tensor-core CTA at most (`__launch_bounds__(256, 2)`): `ipc` items of
/// `min(kv_heads, 8)` warps; two CTAs per SM.
pub const MMA_WARPS: usize = 8;
/// CTAs of the tensor-core kernel resident per SM.
pub const MMA_CTAS_PER_SM: usize = 2;
/// Warps of one CTA of the wide head-major form (`__launch_bounds__(512, 1)`, one CTA an SM,
/// one pair table for 16 warps), taken when its CTAs fill the card.
pub const MMA_WIDE_WARPS: usize = 16;
/// Pages each warp of the head-major forms keeps in flight through shared memory (the kernel's
/// `MMA_TMA`).
pub const MMA_STAGES: usize = 2;

/// How the tensor-core kernel's CTAs of `warps` warps are cut for `kv_heads` KV heads: `(items
/// per CTA, warps per item)`.
pub fn mma_cta(kv_heads: usize, warps: usize) -> (usize, usize) {
    let wpi = kv_heads.clamp(1, warps);
    ((warps / wpi).max(1), wpi)
}

/// Dynamic shared memory of one tensor-core CTA: the 64 KB pair table and each warp's rotated
/// queries, or with `stages` > 0 (the head-major forms) each warp's ring of staged pages (keys,
/// values and both norm runs of its head: `head_dim` · 16 + 64 bytes a page) and their
/// mbarriers, the rotated queries inside the ring.
pub fn mma_shared_bytes(warps: usize, group: usize, head_dim: usize, stages: usize) -> usize {
    if stages > 0 {
        PAIR_TABLE_BYTES + warps * stages * (PAGE * head_dim + 4 * PAGE + 8)
    } else {
        PAIR_TABLE_BYTES + warps * group * head_dim * 4
    }
}

/// The CTA form of a tensor-core decode launch ([`mma_shape`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmaShape {
    /// The wide head-major form (16-warp CTAs, one an SM).
    pub wide: bool,
    /// Items per CTA.
    pub ipc: usize,
    /// Warps per item.
    pub wpi: usize,
}

/// How a launch over `items` items of `chunk` positions is cut on a card of `sms` SMs. On
/// head-major pages the wide form (16-warp CTAs, one pair table an SM) for long items (≥ 1024
/// positions) when its CTAs cover at least 90 % of the SMs (measured on an H200: 32K batch 16,
/// 165 against 173 µs; 128K batch 16, 638 against 646); otherwise 8-warp CTAs, two an SM (short
/// items: 4K batch 16, 37.0 against 38.5 µs; and few items, which the narrow form spreads over
/// twice the SMs: 4K batch 1, 16 against 22 µs).
pub fn mma_shape(
    items: usize,
    chunk: usize,
    kv_heads: usize,
    sms: usize,
    layout: PageLayout,
) -> MmaShape {
    if layout == PageLayout::HeadMajor && chunk >= 1024 {
        let (ipc, wpi) = mma_cta(kv_heads, MMA_WIDE_WARPS);
        let ctas = items.div_ceil(ipc) * kv_heads.div_ceil(wpi);
        if ctas * 10 >= sms * 9 {
            return MmaShape {
                wide: true,
                ipc,
                wpi,
            };
        }
    }
    let (ipc, wpi) = mma_cta(kv_heads, MMA_WARPS);
    MmaShape {
        wide: false,
        ipc,
        wpi,
    }
}

/// The position inside a page that MMA row (score row, value k-index) `m` holds: rows 2, 3
/// (and 6, 7, …) trade places, so that the four positions one value load of a warp reads from a
/// page in shared memory (k-indices 2c for c = 0..3) alternate between the two halves of the
/// banks (`tq4_decode_mma`'s staged pages).
pub fn perm(m: usize) -> usize {
    m ^ ((m >> 1) & 1)
}

#[allow(clippy::too_many_arguments)]
fn warp_item(
    lut: &[u32; 256],
    d: usize,
    group: usize,
    qrot: &[f32],
    planes: &Planes<'_>,
    (pos_stride, head_stride): (usize, usize),
    table: &[u32],
    g: usize,
    start: usize,
    end: usize,
    qscale: f32,
) -> Partial {
    let (bpl, ksteps, vb, cb) = (d / 8, d / 16, d / 16, d / 2);
    let kv_heads = planes.kv_heads;
    // Q fragments: lane (r, c), k-step j: head r, dims (d/4)·c + 4j + {0, 1} and {2, 3}.
    let qf: Warp<Vec<[u32; 2]>> = std::array::from_fn(|lane| {
        let (r, c) = (lane / 4, lane % 4);
        (0..ksteps)
            .map(|j| {
                if r >= group {
                    return [0, 0];
                }
                let q = &qrot[r * d + (d / 4) * c + 4 * j..];
                [
                    pack(q[0] * qscale, q[1] * qscale),
                    pack(q[2] * qscale, q[3] * qscale),
                ]
            })
            .collect()
    });
    let mut o: Vec<Warp<[f32; 4]>> = vec![[[0.0; 4]; 32]; ksteps];
    let (mut m, mut l) = ([[f32::NEG_INFINITY; 2]; 32], [[0.0f32; 2]; 32]);
    let (mut tile_m, mut tile_a) = (vec![Vec::new(); group], vec![Vec::new(); group]);
    for tile in start / PAGE..end.div_ceil(PAGE) {
        let page_row = table[tile] as usize * PAGE * kv_heads;
        let row = |p: usize| page_row + p * pos_stride + g * head_stride;
        // Scores: S^T = K · Q^T over `ksteps` MMAs (one accumulator: the kernel's two chains
        // only reorder the f32 sum).
        let mut s: Warp<[f32; 4]> = [[0.0; 4]; 32];
        for j in 0..ksteps {
            let a: Warp<[u32; 4]> = std::array::from_fn(|lane| {
                let (r, c) = (lane / 4, lane % 4);
                let at = |p: usize| row(p) * cb + bpl * c + 4 * (j >> 1);
                let (w0, w1) = (
                    word(planes.k_codes, at(perm(r))),
                    word(planes.k_codes, at(perm(r + 8))),
                );
                let kb = (2 * j) & 3;
                [
                    lut[byte(w0, kb)],
                    lut[byte(w1, kb)],
                    lut[byte(w0, kb + 1)],
                    lut[byte(w1, kb + 1)],
                ]
            });
            let b: Warp<[u32; 2]> = std::array::from_fn(|lane| qf[lane][j]);
            mma16816(&mut s, &a, &b);
        }
        // Softmax, lazily: each lane holds positions r, r+8 of heads 2c, 2c+1.
        let mut sc = [[0f32; 4]; 32];
        let mut need = false;
        for lane in 0..32 {
            let r = lane / 4;
            let (p0, p1) = (tile * PAGE + perm(r), tile * PAGE + perm(r + 8));
            let (ok0, ok1) = (p0 >= start && p0 < end, p1 >= start && p1 < end);
            let (kn0, kn1) = (
                norm(planes.k_norms, row(perm(r))),
                norm(planes.k_norms, row(perm(r + 8))),
            );
            let v = s[lane];
            sc[lane] = [
                if ok0 { v[0] * kn0 } else { f32::NEG_INFINITY },
                if ok0 { v[1] * kn0 } else { f32::NEG_INFINITY },
                if ok1 { v[2] * kn1 } else { f32::NEG_INFINITY },
                if ok1 { v[3] * kn1 } else { f32::NEG_INFINITY },
            ];
            let x = [sc[lane][0].max(sc[lane][2]), sc[lane][1].max(sc[lane][3])];
            need |= x[0] > m[lane][0] + LAZY || x[1] > m[lane][1] + LAZY;
        }
        if need {
            for c in 0..4 {
                for hh in 0..2 {
                    let x = (0..8)
                        .map(|r| sc[4 * r + c][hh].max(sc[4 * r + c][hh + 2]))
                        .fold(f32::NEG_INFINITY, f32::max);
                    for r in 0..8 {
                        let lane = 4 * r + c;
                        let n = m[lane][hh].max(x);
                        let f = (m[lane][hh] - n).exp2();
                        m[lane][hh] = n;
                        l[lane][hh] *= f;
                        for oi in o.iter_mut() {
                            oi[lane][hh] *= f;
                            oi[lane][hh + 2] *= f;
                        }
                    }
                }
            }
        }
        let mut x0 = [0u32; 32];
        let mut x1 = [0u32; 32];
        for lane in 0..32 {
            let r = lane / 4;
            let (p0, p1) = (tile * PAGE + perm(r), tile * PAGE + perm(r + 8));
            let (ok0, ok1) = (p0 >= start && p0 < end, p1 >= start && p1 < end);
            let e = [
                (sc[lane][0] - m[lane][0]).exp2(),
                (sc[lane][1] - m[lane][1]).exp2(),
                (sc[lane][2] - m[lane][0]).exp2(),
                (sc[lane][3] - m[lane][1]).exp2(),
            ];
            l[lane][0] += e[0] + e[2];
            l[lane][1] += e[1] + e[3];
            for (hh, h) in [2 * (lane % 4), 2 * (lane % 4) + 1].into_iter().enumerate() {
                if h < group {
                    if r == 0 {
                        tile_m[h].push(m[lane][hh]);
                        tile_a[h].push(0.0);
                    }
                    if let Some(a) = tile_a[h].last_mut() {
                        *a += e[hh] + e[hh + 2];
                    }
                }
            }
            let vn0 = if ok0 {
                norm(planes.v_norms, row(perm(r))) * VSCALE
            } else {
                0.0
            };
            let vn1 = if ok1 {
                norm(planes.v_norms, row(perm(r + 8))) * VSCALE
            } else {
                0.0
            };
            x0[lane] = pack(e[0] * vn0, e[1] * vn0);
            x1[lane] = pack(e[2] * vn1, e[3] * vn1);
        }
        let (pb0, pb1) = (movmatrix_t(&x0), movmatrix_t(&x1));
        let b: Warp<[u32; 2]> = std::array::from_fn(|lane| [pb0[lane], pb1[lane]]);
        // Values: O^T += V^T · P^T, m-tile i = 4w + k.
        for w in 0..vb / 4 {
            let idx: Warp<[u32; 4]> = std::array::from_fn(|lane| {
                let (r, c) = (lane / 4, lane % 4);
                let at = |p: usize| word(planes.v_codes, row(p) * cb + vb * r + 4 * w);
                let (a, b, cc, dd) = (
                    at(perm(2 * c)),
                    at(perm(2 * c + 1)),
                    at(perm(2 * c + 8)),
                    at(perm(2 * c + 9)),
                );
                [
                    (a & 0x0F0F_0F0F) | ((b << 4) & 0xF0F0_F0F0),
                    ((a >> 4) & 0x0F0F_0F0F) | (b & 0xF0F0_F0F0),
                    (cc & 0x0F0F_0F0F) | ((dd << 4) & 0xF0F0_F0F0),
                    ((cc >> 4) & 0x0F0F_0F0F) | (dd & 0xF0F0_F0F0),
                ]
            });
            for k in 0..4 {
                let a: Warp<[u32; 4]> =
                    std::array::from_fn(|lane| idx[lane].map(|wd| lut[byte(wd, k)]));
                mma16816(&mut o[4 * w + k], &a, &b);
            }
        }
    }
    // The kernel's epilogue: normalizers summed over the 8 lanes of a column pair, the
    // accumulator written at dims 2·vb·r + 2i (+1) for heads 2c, 2c+1.
    let mut out = Partial {
        m: vec![f32::NEG_INFINITY; group],
        l: vec![0.0; group],
        acc: vec![0.0; group * d],
        tile_m,
        tile_a,
    };
    for lane in 0..32 {
        let (r, c) = (lane / 4, lane % 4);
        for (hh, h) in [2 * c, 2 * c + 1].into_iter().enumerate() {
            if h >= group {
                continue;
            }
            out.m[h] = m[lane][hh];
            out.l[h] = (0..8).map(|rr| l[4 * rr + c][hh]).sum();
            for (i, oi) in o.iter().enumerate() {
                let dim = 2 * vb * r + 2 * i;
                out.acc[h * d + dim] = oi[lane][hh] / VSCALE;
                out.acc[h * d + dim + 1] = oi[lane][hh + 2] / VSCALE;
            }
        }
    }
    out
}

/// Decode attention of a ragged batch (`q`: `[batch, heads, head_dim]`, model space) as the
/// tensor-core kernel computes it: items of `plan`, one emulated warp per (item, KV head), then
/// the combine. `block_tables` is `[batch, max_blocks]`; writes `out` (`[batch, heads,
/// head_dim]`).
#[allow(clippy::too_many_arguments)]
pub fn mma_decode(
    codec: &Codec,
    group: usize,
    plan: &ItemPlan,
    layout: PageLayout,
    q: &[f32],
    planes: &Planes<'_>,
    block_tables: &[u32],
    max_blocks: usize,
    lens: &[usize],
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (planes_, tables) = ((planes, block_tables), (max_blocks, lens));
    decode(
        codec, group, plan, layout, q, planes_, tables, scale, out, None,
    )
}

/// [`mma_decode`] that also returns what `tq4_decode_mma_mass` + `tq4_block_mass` compute: the
/// attention mass each page of every sequence receives from its query, averaged over the query
/// heads, `[batch, max_blocks]` (a sequence's first `⌈len/16⌉` entries, the rest zero), from
/// the pages' records carried to the merged max and normalizer.
#[allow(clippy::too_many_arguments)]
pub fn mma_decode_mass(
    codec: &Codec,
    group: usize,
    plan: &ItemPlan,
    layout: PageLayout,
    q: &[f32],
    planes: &Planes<'_>,
    block_tables: &[u32],
    max_blocks: usize,
    lens: &[usize],
    scale: f32,
    out: &mut [f32],
) -> Result<Vec<f32>, KernelError> {
    let mut mass = vec![0f32; lens.len() * max_blocks];
    let (planes_, tables) = ((planes, block_tables), (max_blocks, lens));
    decode(
        codec,
        group,
        plan,
        layout,
        q,
        planes_,
        tables,
        scale,
        out,
        Some(&mut mass),
    )?;
    Ok(mass)
}

#[allow(clippy::too_many_arguments)]
fn decode(
    codec: &Codec,
    group: usize,
    plan: &ItemPlan,
    layout: PageLayout,
    q: &[f32],
    (planes, block_tables): (&Planes<'_>, &[u32]),
    (max_blocks, lens): (usize, &[usize]),
    scale: f32,
    out: &mut [f32],
    mass: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    let t = codec
        .turboquant_tables()
        .filter(|t| t.bits == 4)
        .ok_or_else(|| KernelError::Unsupported("not a TurboQuant 4-bit codec".into()))?;
    let d = codec.head_dim();
    let kv_heads = planes.kv_heads;
    let heads = kv_heads * group;
    let batch = lens.len();
    if planes.block_size != PAGE || !(1..=8).contains(&group) || (d != 64 && d != 128) {
        return Err(KernelError::Unsupported(format!(
            "block size {}, group {group}, head_dim {d}",
            planes.block_size
        )));
    }
    if q.len() != batch * heads * d
        || out.len() != batch * heads * d
        || block_tables.len() < batch * max_blocks
        || plan.seq_first.len() != batch + 1
        || lens.iter().any(|&l| l > max_blocks * PAGE)
    {
        return Err(KernelError::Invalid(
            "buffer sizes do not match the shape".into(),
        ));
    }
    let lut = pair_table(&t.codebook);
    let qscale = t.scale * scale * std::f32::consts::LOG2_E;
    let strides = layout.strides(kv_heads);
    // Partials [item][kv_head].
    let mut parts: Vec<Partial> = Vec::with_capacity(plan.len() * kv_heads);
    for it in 0..plan.len() {
        let (b, start, end) = plan.item(it);
        if b >= batch || end > lens[b] || start >= end {
            return Err(KernelError::Invalid(format!(
                "item {it} ({b}, {start}..{end}) is outside the batch"
            )));
        }
        let table = &block_tables[b * max_blocks..][..max_blocks];
        for g in 0..kv_heads {
            let mut qrot = vec![0f32; group * d];
            for (h, qr) in qrot.chunks_exact_mut(d).enumerate() {
                let src = &q[(b * heads + g * group + h) * d..][..d];
                qr.iter_mut()
                    .zip(src.iter().zip(&t.signs))
                    .for_each(|(x, (v, s))| *x = v * s);
                fwht(qr);
            }
            parts.push(warp_item(
                &lut, d, group, &qrot, planes, strides, table, g, start, end, qscale,
            ));
        }
    }
    // The combine: merge a sequence's items in the log2 domain, normalize, rotate back.
    for b in 0..batch {
        let (first, last) = (plan.seq_first[b] as usize, plan.seq_first[b + 1] as usize);
        for h in 0..heads {
            let (g, gh) = (h / group, h % group);
            let ps = (first..last).map(|it| &parts[it * kv_heads + g]);
            let mx = ps
                .clone()
                .map(|p| p.m[gh])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut y = vec![0f32; d];
            let mut total = 0.0f32;
            for p in ps {
                if p.l[gh] == 0.0 {
                    continue;
                }
                let f = (p.m[gh] - mx).exp2();
                total += p.l[gh] * f;
                y.iter_mut()
                    .zip(&p.acc[gh * d..][..d])
                    .for_each(|(y, a)| *y += a * f);
            }
            let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
            y.iter_mut().for_each(|v| *v *= inv);
            fwht(&mut y);
            for i in 0..d {
                out[(b * heads + h) * d + i] = y[i] * t.signs[i] * t.scale;
            }
        }
    }
    // tq4_block_mass: page j of item i gets (1/heads) Σ_h a·2^(m − M_h)/L_h.
    if let Some(mass) = mass {
        let tiles = plan.chunk / PAGE;
        for b in 0..batch {
            let (first, last) = (plan.seq_first[b] as usize, plan.seq_first[b + 1] as usize);
            let merged: Vec<(f32, f32)> = (0..heads)
                .map(|h| {
                    let (g, gh) = (h / group, h % group);
                    let ps = (first..last).map(|it| &parts[it * kv_heads + g]);
                    let mx = ps
                        .clone()
                        .map(|p| p.m[gh])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let total: f32 = ps
                        .filter(|p| p.l[gh] > 0.0)
                        .map(|p| p.l[gh] * (p.m[gh] - mx).exp2())
                        .sum();
                    (mx, if total > 0.0 { 1.0 / total } else { 0.0 })
                })
                .collect();
            for j in 0..lens[b].div_ceil(PAGE) {
                let (it, k) = (first + j / tiles, j % tiles);
                let sum: f32 = (0..heads)
                    .map(|h| {
                        let p = &parts[it * kv_heads + h / group];
                        let a = p.tile_a[h % group][k];
                        if a > 0.0 {
                            a * (p.tile_m[h % group][k] - merged[h].0).exp2() * merged[h].1
                        } else {
                            0.0
                        }
                    })
                    .sum();
                mass[b * max_blocks + j] = sum / heads as f32;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use engram_kvcore::{CodecKind, DEFAULT_ROTATION_SEED, SplitMix64};

    use super::*;
    use crate::reference::{EncodedPlanes, rel_l2};

    #[test]
    fn mma_fragments_follow_the_ptx_layouts() {
        // A = row index + column/16 as f16, B = identity-like: D = A·B picks known sums.
        let mut rng = SplitMix64::new(3);
        let am: Vec<f32> = (0..256)
            .map(|_| (rng.next_u64() % 9) as f32 - 4.0)
            .collect();
        let bm: Vec<f32> = (0..128)
            .map(|_| (rng.next_u64() % 7) as f32 - 3.0)
            .collect();
        let a: Warp<[u32; 4]> = std::array::from_fn(|lane| {
            let (g, c) = (lane / 4, lane % 4);
            let at = |r: usize, k: usize| pack(am[r * 16 + k], am[r * 16 + k + 1]);
            [
                at(g, 2 * c),
                at(g + 8, 2 * c),
                at(g, 2 * c + 8),
                at(g + 8, 2 * c + 8),
            ]
        });
        let b: Warp<[u32; 2]> = std::array::from_fn(|lane| {
            let (g, c) = (lane / 4, lane % 4);
            let at = |k: usize| pack(bm[k * 8 + g], bm[(k + 1) * 8 + g]);
            [at(2 * c), at(2 * c + 8)]
        });
        let mut d = [[1.0f32; 4]; 32];
        mma16816(&mut d, &a, &b);
        for lane in 0..32 {
            let (g, c) = (lane / 4, lane % 4);
            let want = |r: usize, n: usize| {
                1.0 + (0..16).map(|k| am[r * 16 + k] * bm[k * 8 + n]).sum::<f32>()
            };
            assert_eq!(d[lane][0], want(g, 2 * c));
            assert_eq!(d[lane][1], want(g, 2 * c + 1));
            assert_eq!(d[lane][2], want(g + 8, 2 * c));
            assert_eq!(d[lane][3], want(g + 8, 2 * c + 1));
        }
        // movmatrix twice is the identity, once moves (g, 2c) to (2c, g).
        let x: Warp<u32> = std::array::from_fn(|l| (l as u32) * 0x0002_0002 + 0x0001_0000);
        assert_eq!(movmatrix_t(&movmatrix_t(&x)), x);
        let t = movmatrix_t(&x);
        // Element (row 3, col 5) of the transpose = element (5, 3): lane 5·4 + 1, high half.
        assert_eq!(t[3 * 4 + 2] >> 16, x[5 * 4 + 1] >> 16);
    }

    #[test]
    fn the_row_order_trades_rows_within_a_page_and_spreads_value_loads_over_both_bank_halves() {
        let rows: Vec<usize> = (0..PAGE).map(perm).collect();
        let mut sorted = rows.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..PAGE).collect::<Vec<_>>(),
            "a permutation of the page"
        );
        for m in 0..PAGE {
            assert_eq!(perm(perm(m)), m, "an involution");
        }
        for m in 0..8 {
            assert_eq!(
                perm(m + 8),
                perm(m) + 8,
                "a lane's rows r and r + 8 stay 8 apart"
            );
        }
        assert_eq!(&rows[..8], &[0, 1, 3, 2, 4, 5, 7, 6]);
        // A value load of a warp reads, for c = 0..3, the rows of k-indices 2c + o (o = 0, 1,
        // 8, 9): two even and two odd, so that with 64-byte rows (head_dim 128) they start on
        // banks 0 and 16 alike (two-way conflicts instead of four-way).
        for o in [0, 1, 8, 9] {
            let odd = (0..4).filter(|c| perm(2 * c + o) % 2 == 1).count();
            assert_eq!(odd, 2, "k-indices 2c + {o}");
        }
    }

    #[test]
    fn long_items_over_the_whole_card_take_the_wide_form_on_head_major_pages_only() {
        let hm = PageLayout::HeadMajor;
        // 8B shape on 132 SMs: 32K batch 16 plans 256 items of 2048, 128K batch 16 1024.
        let wide = mma_shape(256, 2048, 8, 132, hm);
        assert_eq!(
            wide,
            MmaShape {
                wide: true,
                ipc: 2,
                wpi: 8
            }
        );
        assert!(mma_shape(1024, 2048, 8, 132, hm).wide);
        // Short items (4K batch 16: 256 of 256), few items (32K batch 1: 128 of 256; 2 CTAs of
        // 16 warps would leave most SMs idle), token-major pages: 8-warp CTAs.
        for (items, chunk, layout) in [
            (256, 256, hm),
            (128, 256, hm),
            (64, 2048, hm),
            (256, 2048, PageLayout::TokenMajor),
        ] {
            let s = mma_shape(items, chunk, 8, 132, layout);
            assert_eq!((s.wide, s.ipc, s.wpi), (false, 1, 8), "{items} × {chunk}");
        }
        // SmolLM2's 3 KV heads: 5 items of 3 warps a wide CTA, 2 a narrow one.
        assert_eq!(
            mma_shape(1000, 1024, 3, 132, hm),
            MmaShape {
                wide: true,
                ipc: 5,
                wpi: 3
            }
        );
        assert_eq!(mma_shape(1000, 512, 3, 132, hm).ipc, 2);
    }

    #[test]
    fn every_form_fits_the_shared_memory_of_a_hopper_sm() {
        // Opt-in maximum a block (227 KB) and 228 KB an SM, 1 KB of which each block reserves.
        let (per_block, per_sm) = (232_448usize, 233_472usize);
        // The kernel's default ring depth is the host's (which sizes the shared memory).
        assert!(crate::TQ4_SOURCE.contains(&format!("#define MMA_TMA {MMA_STAGES} ")));
        for d in [64usize, 128] {
            // The rotated queries live inside a warp's ring (the kernel's static_assert).
            assert!(8 * d * 4 <= MMA_STAGES * (PAGE * d + 4 * PAGE));
            for group in 1..=8 {
                for kv_heads in 1..=8 {
                    let (ipc, wpi) = mma_cta(kv_heads, MMA_WARPS);
                    for stages in [0, MMA_STAGES] {
                        let b = mma_shared_bytes(ipc * wpi, group, d, stages);
                        assert!(
                            MMA_CTAS_PER_SM * (b + 1024) <= per_sm,
                            "{d} {group} {kv_heads}"
                        );
                    }
                    let (ipc, wpi) = mma_cta(kv_heads, MMA_WIDE_WARPS);
                    let wide = mma_shared_bytes(ipc * wpi, group, d, MMA_STAGES);
                    assert!(wide <= per_block, "wide {d} {group} {kv_heads}: {wide}");
                }
            }
        }
    }

    #[test]
    fn the_pair_table_holds_both_nibbles_low_first() {
        let cb: Vec<f32> = (0..16).map(|i| i as f32 * 0.125 - 1.0).collect();
        let lut = pair_table(&cb);
        for b in 0..256 {
            assert_eq!(lo(lut[b]), cb[b & 15]);
            assert_eq!(hi(lut[b]), cb[b >> 4]);
        }
    }

    /// The emulated kernel against the dense f32 reference over the CPU-decoded rows, for head
    /// dims 64 and 128, groups 1, 3, 4 and 8, ragged lengths (one position, a page plus one, a
    /// tail), the automatic and forced chunks, both page layouts (identical results), a
    /// shuffled block table, and peaked attention (queries ×8) that moves the lazy max.
    #[test]
    fn the_tensor_core_formulation_matches_the_dense_reference() {
        let mut rng = SplitMix64::new(9);
        for (d, group, kv_heads, qmul) in [
            (64usize, 3usize, 3usize, 1.0f32),
            (128, 4, 2, 1.0),
            (128, 8, 1, 8.0),
            (64, 1, 2, 8.0),
        ] {
            let codec =
                Codec::new(CodecKind::TurboQuant { bits: 4 }, d, DEFAULT_ROTATION_SEED).unwrap();
            let lens = [1usize, 17, 300, 1061];
            let max_blocks = 1061usize.div_ceil(PAGE);
            let slots = lens.len() * max_blocks;
            let data = EncodedPlanes::random(&codec, slots, kv_heads, PAGE, &mut rng, 1.0).unwrap();
            let mut order: Vec<u32> = (0..slots as u32).collect();
            for i in (1..slots).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let heads = kv_heads * group;
            let mut q = rng.gaussian_vec(lens.len() * heads * d);
            q.iter_mut().for_each(|v| *v *= qmul);
            let scale = 1.0 / (d as f32).sqrt();
            let [tk, tn, tv, tvn] = data.token_major();
            let tplanes = Planes {
                k_codes: &tk,
                k_norms: &tn,
                v_codes: &tv,
                v_norms: &tvn,
                ..data.planes()
            };
            for chunk in [None, Some(64), Some(256)] {
                let plan = ItemPlan::new(&lens, 8, chunk).unwrap();
                let run = |layout, planes: &Planes<'_>| {
                    let mut out = vec![0f32; q.len()];
                    mma_decode(
                        &codec, group, &plan, layout, &q, planes, &order, max_blocks, &lens, scale,
                        &mut out,
                    )
                    .unwrap();
                    out
                };
                let got = run(PageLayout::HeadMajor, &data.planes());
                let tgot = run(PageLayout::TokenMajor, &tplanes);
                assert_eq!(got, tgot, "d {d} group {group}: layouts differ");
                for (b, &len) in lens.iter().enumerate() {
                    let n = heads * d;
                    let table = &order[b * max_blocks..][..max_blocks];
                    let want = data
                        .attend_dense(table, len, &q[b * n..][..n], heads)
                        .unwrap();
                    let err = rel_l2(&got[b * n..][..n], &want);
                    assert!(
                        err < 2e-3,
                        "d {d} group {group} len {len} chunk {chunk:?}: rel L2 {err:.3e}"
                    );
                }
            }
        }
    }

    /// The mass variant's records, merged as `tq4_block_mass` merges them, against the dense
    /// softmax weights (f64, decoded keys): each sequence's page masses within 1e-3 relative
    /// L2 and summing to 1, for several items a sequence, a lazy max that moves (peaked
    /// queries); the attention output is `mma_decode`'s bit for bit.
    #[test]
    fn the_exported_mass_matches_the_dense_weights() {
        let mut rng = SplitMix64::new(41);
        for (d, group, kv_heads, qmul) in [(128usize, 4usize, 2usize, 1.0f32), (64, 3, 3, 8.0)] {
            let codec =
                Codec::new(CodecKind::TurboQuant { bits: 4 }, d, DEFAULT_ROTATION_SEED).unwrap();
            let lens = [1usize, 40, 700];
            let max_blocks = 700usize.div_ceil(PAGE);
            let slots = lens.len() * max_blocks;
            let data = EncodedPlanes::random(&codec, slots, kv_heads, PAGE, &mut rng, 1.0).unwrap();
            let mut order: Vec<u32> = (0..slots as u32).collect();
            for i in (1..slots).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let heads = kv_heads * group;
            let mut q = rng.gaussian_vec(lens.len() * heads * d);
            q.iter_mut().for_each(|v| *v *= qmul);
            let scale = 1.0 / (d as f32).sqrt();
            for chunk in [Some(64), Some(256)] {
                let plan = ItemPlan::new(&lens, 8, chunk).unwrap();
                let (mut out, mut plain) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                let args = (&codec, group, &plan, PageLayout::HeadMajor, &q);
                let mass = mma_decode_mass(
                    args.0,
                    args.1,
                    args.2,
                    args.3,
                    args.4,
                    &data.planes(),
                    &order,
                    max_blocks,
                    &lens,
                    scale,
                    &mut out,
                )
                .unwrap();
                mma_decode(
                    args.0,
                    args.1,
                    args.2,
                    args.3,
                    args.4,
                    &data.planes(),
                    &order,
                    max_blocks,
                    &lens,
                    scale,
                    &mut plain,
                )
                .unwrap();
                assert_eq!(out, plain, "the mass variant changed the attention");
                for (b, &len) in lens.iter().enumerate() {
                    let n = heads * d;
                    let table = &order[b * max_blocks..][..max_blocks];
                    let want = data.mass_dense(table, len, &q[b * n..][..n], heads);
                    let pages = len.div_ceil(PAGE);
                    let got = &mass[b * max_blocks..][..max_blocks];
                    assert!(got[pages..].iter().all(|&x| x == 0.0));
                    let sum: f64 = got[..pages].iter().map(|&x| f64::from(x)).sum();
                    assert!((sum - 1.0).abs() < 1e-5, "masses sum to {sum}");
                    let (mut num, mut den) = (0.0f64, 0.0f64);
                    for (g, w) in got[..pages].iter().zip(&want) {
                        num += (f64::from(*g) - w).powi(2);
                        den += w * w;
                    }
                    let err = (num / den).sqrt();
                    assert!(
                        err < 1e-3,
                        "d {d} group {group} len {len} chunk {chunk:?}: mass rel L2 {err:.3e}"
                    );
                }
            }
        }
    }

    /// Value norms in the thousands (P·‖v‖ would overflow f16 without VSCALE) stay finite and
    /// within the bound.
    #[test]
    fn large_value_norms_stay_finite() {
        let mut rng = SplitMix64::new(4);
        let (d, group, kv_heads) = (128usize, 4usize, 1usize);
        let codec =
            Codec::new(CodecKind::TurboQuant { bits: 4 }, d, DEFAULT_ROTATION_SEED).unwrap();
        let len = 200usize;
        let blocks = len.div_ceil(PAGE);
        let data = EncodedPlanes::random(&codec, blocks, kv_heads, PAGE, &mut rng, 300.0).unwrap();
        let table: Vec<u32> = (0..blocks as u32).collect();
        let q = rng.gaussian_vec(group * d);
        let plan = ItemPlan::new(&[len], 8, None).unwrap();
        let mut got = vec![0f32; group * d];
        let scale = 1.0 / (d as f32).sqrt();
        mma_decode(
            &codec,
            group,
            &plan,
            PageLayout::HeadMajor,
            &q,
            &data.planes(),
            &table,
            blocks,
            &[len],
            scale,
            &mut got,
        )
        .unwrap();
        assert!(got.iter().all(|v| v.is_finite()));
        let want = data.attend_dense(&table, len, &q, group).unwrap();
        let err = rel_l2(&got, &want);
        assert!(err < 2e-3, "rel L2 {err:.3e}");
    }

    #[test]
    fn unsupported_shapes_are_refused() {
        let codec =
            Codec::new(CodecKind::TurboQuant { bits: 4 }, 64, DEFAULT_ROTATION_SEED).unwrap();
        let planes = Planes::empty(1, 32);
        let plan = ItemPlan::new(&[1], 8, None).unwrap();
        let mut out = vec![0f32; 64];
        let r = mma_decode(
            &codec,
            1,
            &plan,
            PageLayout::TokenMajor,
            &[0.0; 64],
            &planes,
            &[0],
            1,
            &[1],
            0.125,
            &mut out,
        );
        assert!(matches!(r, Err(KernelError::Unsupported(_))));
    }
}
