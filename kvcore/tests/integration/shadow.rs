//! Shadow segments: blocks survive a trip through a safetensors file byte for byte, in the
//! tiers' layout, and a file of another layout or a damaged one is refused.

use engram_kvcore::shadow::{
    SegmentReader, checksum, decode_segment, encode_segment, segment_data_len, segment_header,
};
use engram_kvcore::{BlockStream, CodecKind, KvError, LayerCodecs, SourceLayer, StoreConfig, Tier};

use crate::common::{filled, small_store, stream_store, tags};

#[test]
fn blocks_round_trip_through_a_segment_into_cold_blocks_byte_for_byte() {
    // One codec for both streams, and keys and values apart (Q8 keys, TQ3 values; outlier-split
    // TQ6 keys, TQ5 values).
    let tq4 = CodecKind::TurboQuant { bits: 4 };
    let tq3 = CodecKind::TurboQuant { bits: 3 };
    let split = CodecKind::TurboQuantSplit {
        bits: 6,
        outliers: 1,
    };
    let tq5 = CodecKind::TurboQuant { bits: 5 };
    for (key, value) in [(tq4, tq4), (CodecKind::Q8, tq3), (split, tq5)] {
        let mut a = stream_store(key, value, 8, 8);
        let ids = filled(&mut a, 3, SourceLayer::UserTurn, 42);
        let parts = a.block_parts();
        // K codes, V codes, K norms, V norms, each for both layers, tiling the block's bytes.
        assert_eq!(parts.len(), 8);
        assert_eq!(parts[0].stream, BlockStream::KCodes);
        assert_eq!(parts[7].stream, BlockStream::VNorms);
        assert_eq!(parts[0].shape[2], key.code_bytes(64));
        assert_eq!(parts[2].shape[2], value.code_bytes(64));
        assert_eq!(
            parts.iter().map(|p| p.len()).sum::<usize>(),
            a.block_bytes()
        );
        for w in parts.windows(2) {
            assert_eq!(w[0].offset + w[0].len(), w[1].offset);
        }
        let bytes: Vec<Vec<u8>> = ids
            .iter()
            .map(|&id| a.block_bytes_of(id).unwrap())
            .collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        let meta = std::collections::HashMap::from([("k".to_string(), "v".to_string())]);
        let file = encode_segment(&parts, &refs, Some(meta.clone())).unwrap();
        let seg = decode_segment(&parts, &file).unwrap();
        assert_eq!(seg.blocks, bytes);
        assert_eq!(seg.metadata, meta);

        // Into another store's cold tier, then warmed: the same bytes in every tier.
        let mut b = stream_store(key, value, 8, 8);
        let cold = b
            .allocate(Tier::Cold, &[tags(SourceLayer::UserTurn); 3])
            .unwrap();
        for (&id, block) in cold.iter().zip(&seg.blocks) {
            b.write_block_bytes(id, block).unwrap();
        }
        b.warm(&cold).unwrap();
        for (&id, block) in cold.iter().zip(&bytes) {
            assert_eq!(&b.block_bytes_of(id).unwrap(), block);
            assert_eq!(checksum(&b.block_bytes_of(id).unwrap()), checksum(block));
        }
        // A store with the streams' codecs swapped has another layout: the file is refused (a
        // split cannot be a value codec).
        if key != value && key.outliers() == 0 {
            let swapped = stream_store(value, key, 8, 8);
            assert!(decode_segment(&swapped.block_parts(), &file).is_err());
        }
    }
}

#[test]
fn a_streamed_segment_is_the_encoded_one_and_reads_back_a_block_at_a_time() {
    let split = CodecKind::TurboQuantSplit {
        bits: 6,
        outliers: 1,
    };
    let mut a = stream_store(split, CodecKind::TurboQuant { bits: 5 }, 8, 8);
    let ids = filled(&mut a, 5, SourceLayer::UserTurn, 9);
    let parts = a.block_parts();
    let bytes: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| a.block_bytes_of(id).unwrap())
        .collect();
    let meta = std::collections::HashMap::from([("engram".to_string(), "x".repeat(13))]);
    // Header, then each part of every block in turn: what a streaming writer sends.
    let mut streamed = segment_header(&parts, bytes.len(), Some(meta.clone())).unwrap();
    let head = streamed.len();
    for p in &parts {
        for b in &bytes {
            streamed.extend_from_slice(&b[p.offset..p.offset + p.len()]);
        }
    }
    assert_eq!(
        (streamed.len() - head) as u64,
        segment_data_len(&parts, bytes.len())
    );
    let seg = decode_segment(&parts, &streamed).unwrap();
    assert_eq!((seg.blocks, seg.metadata), (bytes.clone(), meta.clone()));
    // The encoder's own file reads back block by block, in any order.
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let file = encode_segment(&parts, &refs, Some(meta.clone())).unwrap();
    for f in [&file, &streamed] {
        let mut r = SegmentReader::open(&parts, std::io::Cursor::new(f.as_slice()), f.len() as u64)
            .unwrap();
        assert_eq!((r.len(), r.metadata()), (5, &meta));
        for i in [4, 0, 2, 1, 3] {
            assert_eq!(r.block(i).unwrap(), bytes[i]);
        }
        assert!(r.block(5).is_err());
        // Truncated, or of another layout: refused at open.
        let cut = &f[..f.len() - 1];
        assert!(SegmentReader::open(&parts, std::io::Cursor::new(cut), cut.len() as u64).is_err());
        let other = small_store(CodecKind::TurboQuant { bits: 3 }, 8, 8).block_parts();
        assert!(
            SegmentReader::open(&other, std::io::Cursor::new(f.as_slice()), f.len() as u64)
                .is_err()
        );
    }
    // A header length past the file is refused without allocating it.
    let mut huge = streamed.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(
        SegmentReader::open(
            &parts,
            std::io::Cursor::new(huge.as_slice()),
            huge.len() as u64
        )
        .is_err()
    );
}

#[test]
fn a_segment_of_another_layout_or_a_damaged_one_is_refused() {
    let mut a = small_store(CodecKind::TurboQuant { bits: 4 }, 8, 8);
    let ids = filled(&mut a, 2, SourceLayer::UserTurn, 7);
    let bytes: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| a.block_bytes_of(id).unwrap())
        .collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let file = encode_segment(&a.block_parts(), &refs, None).unwrap();
    // Another codec: different row widths.
    let b = small_store(CodecKind::TurboQuant { bits: 3 }, 8, 8);
    assert!(matches!(
        decode_segment(&b.block_parts(), &file),
        Err(KvError::Segment { .. })
    ));
    // Per-layer codecs: layer 1 differs.
    let shape = *a.shape();
    let mixed = engram_kvcore::BlockStore::new(StoreConfig {
        codecs: LayerCodecs::per_layer(
            &shape,
            vec![CodecKind::TurboQuant { bits: 4 }, CodecKind::Q8],
        )
        .unwrap(),
        ..StoreConfig::new(shape, CodecKind::TurboQuant { bits: 4 }, 8, 8)
    })
    .unwrap();
    assert!(decode_segment(&mixed.block_parts(), &file).is_err());
    // A truncated file, a broken header.
    assert!(decode_segment(&a.block_parts(), &file[..file.len() - 1]).is_err());
    let mut bad = file.clone();
    bad[10] = b'}';
    assert!(decode_segment(&a.block_parts(), &bad).is_err());
    // A flipped data byte decodes, and the block's checksum tells.
    let mut flipped = file.clone();
    let at = flipped.len() - 5;
    flipped[at] ^= 1;
    let seg = decode_segment(&a.block_parts(), &flipped).unwrap();
    assert_ne!(
        seg.blocks.iter().map(|b| checksum(b)).collect::<Vec<_>>(),
        bytes.iter().map(|b| checksum(b)).collect::<Vec<_>>()
    );
    // Wrong lengths are refused on both sides.
    assert!(matches!(
        encode_segment(&a.block_parts(), &[&bytes[0][1..]], None),
        Err(KvError::BlockBytesLength { .. })
    ));
    let mut c = small_store(CodecKind::TurboQuant { bits: 4 }, 8, 8);
    let id = c
        .allocate(Tier::Cold, &[tags(SourceLayer::UserTurn)])
        .unwrap()[0];
    assert!(c.write_block_bytes(id, &bytes[0][1..]).is_err());
    let hot = c
        .allocate(Tier::Hot, &[tags(SourceLayer::UserTurn)])
        .unwrap()[0];
    assert!(matches!(
        c.write_block_bytes(hot, &bytes[0]),
        Err(KvError::WrongTier { .. })
    ));
}
