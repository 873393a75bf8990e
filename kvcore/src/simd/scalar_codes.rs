//! The scalar reference of attention over the codes of any codec pair: what every SIMD tier's
//! copy computes ([`super::codes_partial`]), the same arithmetic in the same order.

use super::{KeyRange, Partial, TileMass};
use crate::codec::{Codec, axpy, dot};
use crate::store::host::LayerBytes;

/// One KV head's key range for [`codes_partial`]: the layer's codecs (keys, values) and bytes,
/// the keys, the queries as given (`q`, read for an outlier split's stored-apart coordinates)
/// and prepared (`qp`, both `[group, d]`), and the score scale.
#[derive(Clone, Copy)]
pub(crate) struct CodesJob<'a> {
    pub(crate) codecs: (&'a Codec, &'a Codec),
    pub(crate) bytes: &'a LayerBytes<'a>,
    pub(crate) keys: &'a KeyRange<'a>,
    pub(crate) q: &'a [f32],
    pub(crate) qp: &'a [f32],
    pub(crate) scale: f32,
    pub(crate) group: usize,
    pub(crate) d: usize,
}

/// The reference over one KV head's key range, for every codec: per block, each key's codes
/// expanded once for every query head of the group, one softmax rescale per block. Inlined into
/// each SIMD tier's copy ([`super::codes_partial`]), which the compiler vectorizes for that
/// tier; the arithmetic and its order are the same in every copy, so every tier gives the same
/// bits.
#[inline(always)]
pub(crate) fn codes_partial(job: &CodesJob<'_>) -> Partial {
    let &CodesJob {
        codecs: (kc, vc),
        bytes,
        keys,
        q,
        qp,
        scale,
        group,
        d,
    } = job;
    let bs = keys.block_size;
    let split = kc.outliers() > 0;
    let (kcr, knr) = (bytes.k_code_row, bytes.k_norm_row);
    let (vcr, vnr) = (bytes.v_code_row, bytes.v_norm_row);
    let mut part = Partial::empty(group, d);
    let mut w = vec![0.0f32; group * bs];
    let mut row = vec![0.0f32; d];
    let mut t0 = keys.start;
    while t0 < keys.end {
        let n = (bs - t0 % bs).min(keys.end - t0);
        for p in 0..n {
            let r = keys.row(t0 + p);
            // Expand the key's codes once; every query head of the group reads them.
            let code = &bytes.k_codes[r * kcr..][..kcr];
            kc.expand(code, &mut row);
            let k_scale = scale * kc.row_scale(&bytes.k_norms[r * knr..][..knr]);
            for j in 0..group {
                w[j * bs + p] = k_scale * dot(&qp[j * d..][..d], &row);
                if split {
                    w[j * bs + p] += scale * kc.apart_dot(code, &q[j * d..][..d]);
                }
            }
        }
        for j in 0..group {
            let ws = &mut w[j * bs..j * bs + n];
            let block_max = ws.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = part.max[j].max(block_max);
            let correction = (part.max[j] - new_max).exp();
            if correction != 1.0 {
                part.sum[j] *= correction;
                part.acc[j * d..][..d]
                    .iter_mut()
                    .for_each(|a| *a *= correction);
            }
            let mut added = 0.0f32;
            for x in ws.iter_mut() {
                *x = (*x - new_max).exp();
                part.sum[j] += *x;
                added += *x;
            }
            part.max[j] = new_max;
            if keys.trace {
                part.tiles.push(TileMass {
                    start: t0 as u32,
                    max: new_max,
                    added,
                });
            }
        }
        for p in 0..n {
            let r = keys.row(t0 + p);
            vc.expand(&bytes.v_codes[r * vcr..][..vcr], &mut row);
            let v_scale = vc.row_scale(&bytes.v_norms[r * vnr..][..vnr]);
            for j in 0..group {
                axpy(&mut part.acc[j * d..][..d], w[j * bs + p] * v_scale, &row);
            }
        }
        t0 += n;
    }
    part
}
