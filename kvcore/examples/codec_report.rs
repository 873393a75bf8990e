//! Codec figures on the SmolLM2-135M KV shape (30 layers, 3 KV heads, head_dim 64, blocks of 16).
//!
//! `cargo run --release -p engram-kvcore --example codec_report` prints one JSON object per codec:
//! - `bits_per_element`: stored bits per K/V element, norms included;
//! - `relative_mse`: mean ‖x − x̂‖²/‖x‖² over every stored row (Gaussian data);
//! - `expected_relative_mse`: the Lloyd–Max solve's figure (TurboQuant only);
//! - `attention_rel_error`: ‖o − o_f32‖/‖o_f32‖ of single-query attention (9 query heads, GQA)
//!   read from the codes, against f32 attention on the same original data, averaged over layers.

use engram_kvcore::{
    AttentionParams, BlockStore, BlockTags, CodecKind, KvShape, Rows, SourceLayer, SplitMix64,
    StoreConfig, TenantId, Tier, TokenRange, attend_dense,
};
use serde::Serialize;

const TOKENS: usize = 1024;
const QUERY_HEADS: usize = 9;

/// One output line; fields print in this order.
#[derive(Serialize)]
struct Line {
    codec: String,
    bits_per_element: f64,
    relative_mse: f64,
    attention_rel_error: f64,
    expected_relative_mse: Option<f64>,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    tokens: usize,
    query_heads: usize,
}

fn main() -> anyhow::Result<()> {
    let shape = KvShape::SMOLLM2_135M;
    let blocks = TOKENS / shape.block_size;
    for kind in [
        CodecKind::F16,
        CodecKind::Q8,
        CodecKind::TurboQuant { bits: 4 },
        CodecKind::TurboQuant { bits: 3 },
        CodecKind::TurboQuant { bits: 2 },
    ] {
        let mut store = BlockStore::new(StoreConfig::new(shape, kind, blocks as u32, 0))?;
        let tags: Vec<BlockTags> = (0..blocks)
            .map(|b| BlockTags {
                source: SourceLayer::UserTurn,
                importance: 0.5,
                tenant: TenantId(1),
                session: None,
                tokens: TokenRange::new((b * 16) as u32, (b * 16 + 16) as u32),
            })
            .collect();
        let ids = store.allocate(Tier::Hot, &tags)?;
        let mut rng = SplitMix64::new(2026);
        let n = TOKENS * shape.token_width();
        let params = AttentionParams::new(QUERY_HEADS, shape.head_dim);
        let (mut mse_sum, mut rows, mut att_err) = (0.0f64, 0usize, 0.0f64);
        let (mut k_back, mut v_back) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut out = vec![0.0f32; QUERY_HEADS * shape.head_dim];
        let mut exact = out.clone();
        for layer in 0..shape.layers {
            let (k, v) = (rng.gaussian_vec(n), rng.gaussian_vec(n));
            store.write(layer, &ids, 0, Rows::F32(&k), Rows::F32(&v))?;
            store.read(layer, &ids, 0, &mut k_back, &mut v_back)?;
            for (x, y) in [(&k, &k_back), (&v, &v_back)] {
                for (a, b) in x
                    .chunks_exact(shape.head_dim)
                    .zip(y.chunks_exact(shape.head_dim))
                {
                    let err: f64 = a.iter().zip(b).map(|(p, q)| f64::from(p - q).powi(2)).sum();
                    let norm: f64 = a.iter().map(|p| f64::from(*p).powi(2)).sum();
                    mse_sum += err / norm;
                    rows += 1;
                }
            }
            let q = rng.gaussian_vec(QUERY_HEADS * shape.head_dim);
            store.attend(layer, &ids, TOKENS, &q, &params, &mut out)?;
            attend_dense(&k, &v, shape.kv_heads, &q, &params, &mut exact)?;
            let num: f64 = out
                .iter()
                .zip(&exact)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let den: f64 = exact.iter().map(|b| f64::from(*b).powi(2)).sum();
            att_err += (num / den).sqrt();
        }
        let line = Line {
            codec: kind.to_string(),
            bits_per_element: kind.bits_per_element(shape.head_dim),
            relative_mse: mse_sum / rows as f64,
            attention_rel_error: att_err / shape.layers as f64,
            expected_relative_mse: store.key_codec(0)?.expected_relative_mse(),
            layers: shape.layers,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            block_size: shape.block_size,
            tokens: TOKENS,
            query_heads: QUERY_HEADS,
        };
        println!("{}", serde_json::to_string(&line)?);
    }
    Ok(())
}
