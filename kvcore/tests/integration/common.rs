//! Helpers shared by the integration tests.

use engram_kvcore::{
    BlockId, BlockStore, BlockTags, CodecKind, KvShape, LayerCodecs, Rows, SessionId, SourceLayer,
    SplitMix64, StoreConfig, TenantId, Tier, TokenRange,
};

/// Deterministic Gaussian data.
pub fn gauss(seed: u64) -> SplitMix64 {
    SplitMix64::new(seed)
}

/// Every codec the crate offers.
pub const ALL_CODECS: [CodecKind; 11] = [
    CodecKind::F32,
    CodecKind::F16,
    CodecKind::Q8,
    CodecKind::TurboQuant { bits: 2 },
    CodecKind::TurboQuant { bits: 3 },
    CodecKind::TurboQuant { bits: 4 },
    CodecKind::TurboQuant { bits: 5 },
    CodecKind::TurboQuant { bits: 6 },
    CodecKind::TurboQuantSplit {
        bits: 6,
        outliers: 1,
    },
    CodecKind::TurboQuantSplit {
        bits: 4,
        outliers: 4,
    },
    CodecKind::TurboQuantSplit {
        bits: 2,
        outliers: 2,
    },
];

/// Every codec a value stream takes: [`ALL_CODECS`] without the outlier splits (key codecs).
pub const VALUE_CODECS: &[CodecKind] = ALL_CODECS.split_at(8).0;

/// The value codec at `index` of [`VALUE_CODECS`], or past its end the key's own (TurboQuant at
/// the split's width for an outlier split).
pub fn value_for(key: CodecKind, index: usize) -> CodecKind {
    VALUE_CODECS.get(index).copied().unwrap_or(match key {
        CodecKind::TurboQuantSplit { bits, .. } => CodecKind::TurboQuant { bits },
        other => other,
    })
}

pub fn tags(source: SourceLayer) -> BlockTags {
    BlockTags {
        source,
        importance: 0.5,
        tenant: TenantId(1),
        session: Some(SessionId(7)),
        tokens: TokenRange::new(0, 16),
    }
}

/// A small store: 2 layers, 2 KV heads, head_dim 64, blocks of 16.
pub fn small_store(codec: CodecKind, hot: u32, cold: u32) -> BlockStore {
    let shape = KvShape::new(2, 2, 64).unwrap();
    BlockStore::new(StoreConfig::new(shape, codec, hot, cold)).unwrap()
}

/// A small store whose keys and values use different codecs.
pub fn stream_store(key: CodecKind, value: CodecKind, hot: u32, cold: u32) -> BlockStore {
    let shape = KvShape::new(2, 2, 64).unwrap();
    BlockStore::new(StoreConfig {
        codecs: LayerCodecs::streams(&shape, key, value),
        ..StoreConfig::new(shape, key, hot, cold)
    })
    .unwrap()
}

/// Allocates `n` hot blocks of `source` and fills every layer with Gaussian rows.
pub fn filled(store: &mut BlockStore, n: usize, source: SourceLayer, seed: u64) -> Vec<BlockId> {
    let ids = store.allocate(Tier::Hot, &vec![tags(source); n]).unwrap();
    fill(store, &ids, seed);
    ids
}

/// Writes Gaussian K and V rows into every position of every layer of `ids`.
pub fn fill(store: &mut BlockStore, ids: &[BlockId], seed: u64) {
    if ids.is_empty() {
        return;
    }
    let shape = *store.shape();
    let mut g = gauss(seed);
    let n = ids.len() * shape.block_size * shape.token_width();
    for layer in 0..shape.layers {
        let (k, v) = (g.gaussian_vec(n), g.gaussian_vec(n));
        store
            .write(layer, ids, 0, Rows::F32(&k), Rows::F32(&v))
            .unwrap();
    }
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}
