//! The shadow's writer: per collected chain, the prefix and session entries (new blocks as one
//! segment, then the manifest, then unreferenced segments dropped), then the index; and the
//! deletion of entries when their sessions are deleted. An entry whose segments hold more dead
//! bytes (blocks that left its chain) than live ones is compacted: all its blocks go into the
//! new segment, and the old segments are dropped after the manifest.

use std::collections::{HashMap, HashSet};

use engram_engine::{ChainKey, CollectedBytes, ShadowChain};
use engram_kvcore::shadow::{checksum, decode_segment, encode_segment};
use engram_kvcore::{BlockPart, TenantId};
use serde::{Deserialize, Serialize};

use crate::error::{Result, invalid};
use crate::manifest::{
    EntryKind, FORMAT, FormatInfo, Index, IndexEntry, Manifest, ManifestBlock, PrefixRef,
    entry_key, now_ms, prefix_entry_id, session_entry_id, write_checked_json,
};
use crate::storage::Storage;
use crate::{Shadow, totals};

/// What one flush wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FlushReport {
    /// Chains the engine reported changed.
    pub chains: usize,
    /// Entries whose manifest was rewritten.
    pub entries: usize,
    /// New blocks written.
    pub blocks: usize,
    /// Bytes of new segment files.
    pub bytes: u64,
    /// Entries compacted: their segments held more bytes of blocks that left the chain than
    /// of blocks in it, so every block was rewritten into one new segment and the old ones
    /// deleted.
    #[serde(default)]
    pub compacted: usize,
    /// Wall time, ms.
    pub ms: f64,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) manifests: HashMap<String, Manifest>,
    pub(crate) written: HashMap<ChainKey, u64>,
    pub(crate) segment_seq: u64,
    /// Write rate limit, bytes/s (0: unlimited).
    pub(crate) throttle: u64,
    /// Size of each segment the shadow holds, by key.
    pub(crate) sizes: HashMap<String, u64>,
}

/// Where each block the shadow holds is: entry, segment, row, CRC.
type Located = HashMap<[u8; 32], (String, String, usize, u32)>;

/// Records a written entry: in the state, and where its blocks are.
fn keep(st: &mut State, located: &mut Located, m: Manifest) {
    locate(located, &m);
    st.manifests.insert(m.id.clone(), m);
}

fn locate(located: &mut Located, m: &Manifest) {
    for b in &m.blocks {
        located.insert(
            b.block.hash.0,
            (m.id.clone(), b.segment.clone(), b.row, b.crc32c),
        );
    }
}

/// Writes the entries of the collected chains, then the index (runs on a blocking thread).
pub(super) fn write_chains(
    store: &dyn Storage,
    kv: &FormatInfo,
    st: &mut State,
    chains: Vec<ShadowChain>,
) -> Result<FlushReport> {
    let report = FlushReport {
        chains: chains.len(),
        ..FlushReport::default()
    };
    // Where every block the shadow holds is, for blocks another entry already wrote.
    let mut located: Located = HashMap::new();
    for m in st.manifests.values() {
        locate(&mut located, m);
    }
    let mut w = Flush {
        store,
        kv,
        parts: kv.parts(),
        located,
        decoded: HashMap::new(),
        report,
    };
    for chain in chains {
        let key = (chain.tenant, chain.session);
        // The usable chain ends at the first block with no bytes anywhere.
        let usable = chain
            .bytes
            .iter()
            .position(|b| matches!(b, CollectedBytes::Missing))
            .unwrap_or(chain.blocks.len());
        let p = chain.stable_blocks.min(usable);
        let mut prefix_ref = None;
        if p > 0 {
            let id = prefix_entry_id(&chain.blocks[p - 1].hash);
            if !st.manifests.contains_key(&id) {
                w.entry(
                    st,
                    EntrySpec {
                        id: id.clone(),
                        kind: EntryKind::Prefix,
                        chain: &chain,
                        range: 0..p,
                        prefix: None,
                    },
                )?;
            }
            prefix_ref = Some(PrefixRef { id, blocks: p });
        }
        let id = session_entry_id(chain.tenant, chain.session);
        w.entry(
            st,
            EntrySpec {
                id: id.clone(),
                kind: EntryKind::Session,
                chain: &chain,
                range: p..usable,
                prefix: prefix_ref,
            },
        )?;
        st.written.insert(key, chain.generation);
    }
    // Prefix entries no session names any more.
    let used: HashSet<String> = st
        .manifests
        .values()
        .filter_map(|m| m.prefix.as_ref().map(|p| p.id.clone()))
        .collect();
    let unused: Vec<String> = st
        .manifests
        .values()
        .filter(|m| m.kind == EntryKind::Prefix && !used.contains(&m.id))
        .map(|m| m.id.clone())
        .collect();
    let report = w.report;
    write_index(store, st, &unused)?;
    for id in unused {
        st.manifests.remove(&id);
        let dir = entry_key(&id, "");
        st.sizes.retain(|k, _| !k.starts_with(&dir));
        // A leftover is harmless: recovery removes entries nobody names.
        let _ = store.delete_prefix(&dir);
    }
    Ok(report)
}

/// Deletes `tenant`'s session entries that `gone` selects and then its prefix entries no
/// session names any more (runs on a blocking thread). Each entry's manifest goes first, so a
/// crash half-way leaves segments without a manifest, which recovery removes: a deleted session
/// never comes back. Returns the entries deleted.
pub(super) fn forget_entries(
    store: &dyn Storage,
    st: &mut State,
    tenant: u64,
    gone: &dyn Fn(&Manifest) -> bool,
) -> Result<usize> {
    let mut ids: Vec<String> = st
        .manifests
        .values()
        .filter(|m| m.kind == EntryKind::Session && m.tenant == tenant && gone(m))
        .map(|m| m.id.clone())
        .collect();
    let remaining: HashSet<String> = st
        .manifests
        .values()
        .filter(|m| !ids.contains(&m.id))
        .filter_map(|m| m.prefix.as_ref().map(|p| p.id.clone()))
        .collect();
    ids.extend(
        st.manifests
            .values()
            .filter(|m| {
                m.kind == EntryKind::Prefix
                    && m.tenant == tenant
                    && m.tenant != 0
                    && !remaining.contains(&m.id)
            })
            .map(|m| m.id.clone()),
    );
    for id in &ids {
        store.delete(&entry_key(id, "manifest.json"))?;
        if let Some(m) = st.manifests.remove(id)
            && let Some(s) = m.session
        {
            st.written.retain(|k, _| !(k.0.0 == m.tenant && k.1.0 == s));
        }
        let dir = entry_key(id, "");
        st.sizes.retain(|k, _| !k.starts_with(&dir));
        store.delete_prefix(&dir)?;
    }
    if !ids.is_empty() {
        write_index(store, st, &[])?;
    }
    Ok(ids.len())
}

fn write_index(store: &dyn Storage, st: &State, leaving: &[String]) -> Result<()> {
    let mut entries: Vec<IndexEntry> = st
        .manifests
        .values()
        .filter(|m| !leaving.contains(&m.id))
        .map(|m| IndexEntry {
            id: m.id.clone(),
            kind: m.kind,
            tenant: m.tenant,
            session: m.session,
            blocks: m.blocks.len(),
            bytes: (m.blocks.len() * m.kv.block_bytes) as u64,
            updated_unix_ms: m.updated_unix_ms,
        })
        .collect();
    entries.sort_by(|a, b| a.id.cmp(&b.id));
    write_checked_json(
        store,
        "index.json",
        &Index {
            format: FORMAT,
            entries,
        },
        st.throttle,
    )
}

struct EntrySpec<'a> {
    id: String,
    kind: EntryKind,
    chain: &'a ShadowChain,
    range: std::ops::Range<usize>,
    prefix: Option<PrefixRef>,
}

/// One flush's writer: the store, the format, where every held block is, segments decoded so
/// far (for blocks another entry wrote) and the running report.
struct Flush<'a> {
    store: &'a dyn Storage,
    kv: &'a FormatInfo,
    parts: Vec<BlockPart>,
    located: Located,
    decoded: HashMap<(String, String), Vec<Vec<u8>>>,
    report: FlushReport,
}

impl Flush<'_> {
    /// Whether the segments the entry's `blocks` name (other than the new one) hold more bytes
    /// the entry no longer names (blocks that left its chain) than bytes it names.
    fn dead_exceeds_live(
        &self,
        st: &State,
        id: &str,
        blocks: &[ManifestBlock],
        seg_name: &str,
    ) -> bool {
        let named: HashSet<&str> = blocks
            .iter()
            .map(|b| b.segment.as_str())
            .filter(|s| *s != seg_name)
            .collect();
        let stored: u64 = named
            .iter()
            .map(|s| st.sizes.get(&entry_key(id, s)).copied().unwrap_or(0))
            .sum();
        let live =
            (blocks.iter().filter(|b| b.segment != seg_name).count() * self.kv.block_bytes) as u64;
        // A segment's header is small beside one block; only whole blocks count as dead.
        let dead = stored.saturating_sub(live);
        dead >= self.kv.block_bytes as u64 && dead > live
    }

    /// Compaction: every block of the entry into the new segment (the old bytes read and
    /// checked against their CRC), so that the old segments — no longer named — are deleted
    /// once the manifest is written. Returns the entry's blocks and the new segment's bytes.
    fn compact(
        &mut self,
        id: &str,
        blocks: &[ManifestBlock],
        fresh: &[Vec<u8>],
        seg_name: &str,
    ) -> Result<(Vec<ManifestBlock>, Vec<Vec<u8>>)> {
        let mut blocks = blocks.to_vec();
        let mut all = Vec::with_capacity(blocks.len());
        for b in blocks.iter_mut() {
            let bytes = if b.segment == seg_name {
                fresh
                    .get(b.row)
                    .cloned()
                    .ok_or_else(|| invalid(id, "a new block is missing"))?
            } else {
                let k = (id.to_string(), b.segment.clone());
                if !self.decoded.contains_key(&k) {
                    let raw = self
                        .store
                        .get(&entry_key(id, &b.segment))?
                        .ok_or_else(|| invalid(id, "missing_segment: compaction"))?;
                    self.decoded
                        .insert(k.clone(), decode_segment(&self.parts, &raw)?.blocks);
                }
                let bytes = self
                    .decoded
                    .get(&k)
                    .and_then(|s| s.get(b.row))
                    .cloned()
                    .ok_or_else(|| invalid(id, "missing_segment: compaction"))?;
                if checksum(&bytes) != b.crc32c {
                    return Err(invalid(id, "checksum: a block to compact is damaged"));
                }
                bytes
            };
            b.segment = seg_name.to_string();
            b.row = all.len();
            all.push(bytes);
        }
        Ok((blocks, all))
    }

    /// Writes an entry and records it (in the state, and where its blocks are).
    fn entry(&mut self, st: &mut State, spec: EntrySpec<'_>) -> Result<()> {
        let m = self.write(st, spec)?;
        keep(st, &mut self.located, m);
        Ok(())
    }

    /// Writes one entry: new blocks as one segment, then the manifest, then drops old
    /// segments.
    fn write(&mut self, st: &mut State, spec: EntrySpec<'_>) -> Result<Manifest> {
        st.segment_seq += 1;
        let seg_name = format!("seg-{:013}-{:06}.safetensors", now_ms(), st.segment_seq);
        let old = st.manifests.get(&spec.id);
        let own: HashMap<[u8; 32], &ManifestBlock> = old
            .map(|m| m.blocks.iter().map(|b| (b.block.hash.0, b)).collect())
            .unwrap_or_default();
        let mut fresh: Vec<Vec<u8>> = Vec::new();
        let mut blocks = Vec::with_capacity(spec.range.len());
        for i in spec.range.clone() {
            let mut block = spec.chain.blocks[i].clone();
            let hash = block.hash.0;
            if let Some(b) = own.get(&hash) {
                // Keep what the entry recorded (the engine's view of an evicted block is partial).
                block = b.block.clone();
                blocks.push(ManifestBlock {
                    block,
                    segment: b.segment.clone(),
                    row: b.row,
                    crc32c: b.crc32c,
                });
                continue;
            }
            let bytes = match &spec.chain.bytes[i] {
                CollectedBytes::New(bytes) => bytes.clone(),
                CollectedBytes::Known => {
                    let (entry, seg, row, crc) = self
                        .located
                        .get(&hash)
                        .cloned()
                        .ok_or_else(|| invalid(&spec.id, "a known block has no location"))?;
                    let k = (entry.clone(), seg.clone());
                    if !self.decoded.contains_key(&k) {
                        let raw = self.store.get(&entry_key(&entry, &seg))?.ok_or_else(|| {
                            invalid(&spec.id, "a known block's segment is missing")
                        })?;
                        self.decoded
                            .insert(k.clone(), decode_segment(&self.parts, &raw)?.blocks);
                    }
                    let bytes = self
                        .decoded
                        .get(&k)
                        .and_then(|s| s.get(row))
                        .cloned()
                        .ok_or_else(|| invalid(&spec.id, "a known block is missing"))?;
                    if checksum(&bytes) != crc {
                        return Err(invalid(&spec.id, "checksum: a known block is damaged"));
                    }
                    bytes
                }
                CollectedBytes::Missing => break,
            };
            blocks.push(ManifestBlock {
                block,
                segment: seg_name.clone(),
                row: fresh.len(),
                crc32c: checksum(&bytes),
            });
            fresh.push(bytes);
        }
        if self.dead_exceeds_live(st, &spec.id, &blocks, &seg_name) {
            // Best effort: a block that cannot be read back stays where it is (a read on a
            // miss or a recovery detects it), and the flush goes on.
            match self.compact(&spec.id, &blocks, &fresh, &seg_name) {
                Ok((b, f)) => {
                    blocks = b;
                    fresh = f;
                    self.report.compacted += 1;
                }
                Err(e) => tracing::warn!("shadow: compaction of {} skipped: {e}", spec.id),
            }
        }
        if !fresh.is_empty() {
            let refs: Vec<&[u8]> = fresh.iter().map(Vec::as_slice).collect();
            let data = encode_segment(&self.parts, &refs, None)?;
            let key = entry_key(&spec.id, &seg_name);
            self.store.put(&key, &data, st.throttle)?;
            st.sizes.insert(key, data.len() as u64);
            self.report.blocks += fresh.len();
            self.report.bytes += data.len() as u64;
        }
        let chain = spec.chain;
        let manifest = Manifest {
            format: FORMAT,
            id: spec.id.clone(),
            kind: spec.kind,
            tenant: chain.tenant.0,
            session: (spec.kind == EntryKind::Session).then_some(chain.session.0),
            kv: self.kv.clone(),
            prefix: spec.prefix,
            stable_blocks: chain.stable_blocks,
            pin_key: chain.pin_key,
            public_pin_key: chain.public_pin_key,
            updated_unix_ms: now_ms(),
            blocks,
        };
        if let Some(o) = old
            && o.blocks == manifest.blocks
            && o.prefix == manifest.prefix
            && o.stable_blocks == manifest.stable_blocks
            && o.kv == manifest.kv
        {
            // Nothing changed: keep the file (and its timestamp) as it is.
            return Ok(o.clone());
        }
        let throttle = st.throttle;
        write_checked_json(
            self.store,
            &entry_key(&spec.id, "manifest.json"),
            &manifest,
            throttle,
        )?;
        self.report.entries += 1;
        // Segments the new manifest does not name (a failed delete is left to recovery).
        let keep = manifest.segments();
        let dir = entry_key(&spec.id, "");
        let stale: Vec<String> = st
            .sizes
            .keys()
            .filter(|k| {
                k.strip_prefix(&dir)
                    .is_some_and(|name| name.starts_with("seg-") && !keep.contains(name))
            })
            .cloned()
            .collect();
        for key in stale {
            if self.store.delete(&key).is_ok() {
                st.sizes.remove(&key);
            }
        }
        Ok(manifest)
    }
}

impl Shadow {
    /// Deletes the session entries whose tenant salt is `tenant` and whose session key matches
    /// `session & mask == value` (a mask of 0: all of the tenant's), and the tenant's prefix
    /// entries no session names any more. Call it after the engine forgot the sessions, so
    /// that no later flush writes them again. Returns the entries deleted.
    pub async fn forget(&self, tenant: TenantId, mask: u64, value: u64) -> Result<usize> {
        let mut state = self.state.lock().await;
        let store = self.store.clone();
        let mut taken = std::mem::take(&mut *state);
        let (taken, result) = tokio::task::spawn_blocking(move || {
            let gone = move |m: &Manifest| m.session.is_some_and(|s| s & mask == value);
            let r = forget_entries(store.as_ref(), &mut taken, tenant.0, &gone);
            (taken, r)
        })
        .await
        .map_err(|e| invalid("forget", e.to_string()))?;
        *state = taken;
        // Archived sessions of the tenant that match go too.
        let gone: Vec<ChainKey> = self
            .archived
            .lock()
            .map(|a| {
                a.iter()
                    .filter(|k| k.0 == tenant && k.1.0 & mask == value)
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        for key in gone {
            self.store.delete(&crate::archive::marker_key(key))?;
            if let Ok(mut a) = self.archived.lock() {
                a.remove(&key);
            }
        }
        let (sessions, prefixes, bytes) = totals(&state);
        self.update_status(|s| {
            s.sessions = sessions;
            s.prefixes = prefixes;
            s.bytes_on_disk = bytes;
            s.recovery.retain(|r| {
                !(r.tenant == tenant.0
                    && (mask == 0 || r.session.is_some_and(|x| x & mask == value)))
            });
        });
        result
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use engram_engine::{Hex32, ShadowBlock};
    use engram_kvcore::{BlockStream, CodecKind, KvShape, LayerCodecs, SessionId, SourceLayer};

    use super::*;
    use crate::manifest::PartInfo;
    use crate::storage::LocalStorage;

    /// A one-layer format of 64-byte blocks (the writer never looks inside the bytes).
    fn format() -> FormatInfo {
        let shape = KvShape::new(1, 1, 8).unwrap();
        FormatInfo {
            fingerprint: Hex32([7; 32]),
            shape: [1, 1, 8, 16],
            codecs: LayerCodecs::uniform(&shape, CodecKind::F16),
            block_bytes: 64,
            parts: vec![PartInfo {
                stream: BlockStream::KCodes,
                layer: 0,
                offset: 0,
                shape: [16, 1, 4],
            }],
        }
    }

    /// A chain of blocks `ids` (each block's hash and bytes follow from its id), none stable.
    fn chain(ids: &[u8], generation: u64) -> ShadowChain {
        ShadowChain {
            tenant: TenantId(5),
            session: SessionId(9),
            generation,
            stable_blocks: 0,
            pin_key: None,
            public_pin_key: None,
            blocks: ids
                .iter()
                .map(|&i| ShadowBlock {
                    hash: Hex32([i; 32]),
                    public: false,
                    tokens: vec![u32::from(i); 16],
                    source: SourceLayer::UserTurn,
                    importance: 0.5,
                    pinned: false,
                })
                .collect(),
            bytes: ids
                .iter()
                .map(|&i| CollectedBytes::New(vec![i; 64]))
                .collect(),
        }
    }

    fn segments(store: &LocalStorage) -> Vec<String> {
        let mut v: Vec<String> = store
            .list("entries/")
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .filter(|k| k.starts_with("entries/s-") && k.contains("/seg-"))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn an_entry_holding_more_dead_than_live_bytes_is_compacted_into_one_segment() {
        let dir =
            std::env::temp_dir().join(format!("engram-shadow-compact-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = LocalStorage::open(&dir).unwrap();
        let kv = format();
        let mut st = State::default();
        // Eight blocks in one segment; then a chain that keeps the first three and adds two:
        // five dead blocks against three live ones in the old segment.
        let r = write_chains(
            &store,
            &kv,
            &mut st,
            vec![chain(&[1, 2, 3, 4, 5, 6, 7, 8], 1)],
        )
        .unwrap();
        assert_eq!((r.blocks, r.compacted), (8, 0));
        assert_eq!(segments(&store).len(), 1);
        // Keeping six of eight is not compaction's business (2 dead, 6 live).
        let r = write_chains(
            &store,
            &kv,
            &mut st,
            vec![chain(&[1, 2, 3, 4, 5, 6, 20], 2)],
        )
        .unwrap();
        assert_eq!((r.blocks, r.compacted), (1, 0));
        assert_eq!(segments(&store).len(), 2);
        let r = write_chains(&store, &kv, &mut st, vec![chain(&[1, 2, 3, 30, 31], 3)]).unwrap();
        assert_eq!(r.compacted, 1, "{r:?}");
        assert_eq!(r.blocks, 5, "every block rewritten: {r:?}");
        let segs = segments(&store);
        assert_eq!(segs.len(), 1, "old segments deleted: {segs:?}");
        // The entry reads back whole, in order, CRC checked.
        let m = &st.manifests[&session_entry_id(TenantId(5), SessionId(9))];
        let raw = store.get(&segs[0]).unwrap().unwrap();
        let decoded = decode_segment(&kv.parts(), &raw).unwrap().blocks;
        assert_eq!(decoded.len(), 5);
        for (b, want) in m.blocks.iter().zip([1u8, 2, 3, 30, 31]) {
            assert_eq!(decoded[b.row], vec![want; 64]);
            assert_eq!(checksum(&decoded[b.row]), b.crc32c);
        }
        // A damaged block is never carried into a compacted segment: the compaction is
        // skipped, the flush still writes the new blocks, and the damage stays detectable.
        let mut bad = raw.clone();
        // Block 1's first byte: the first byte after the header.
        let at = 8 + u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
        bad[at] ^= 1;
        store.put(&segs[0], &bad, 0).unwrap();
        let r = write_chains(&store, &kv, &mut st, vec![chain(&[1, 40, 41], 4)]).unwrap();
        assert_eq!((r.blocks, r.compacted), (2, 0), "{r:?}");
        assert!(segments(&store).contains(&segs[0]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_archived_session_keeps_only_a_marker_and_the_oldest_go_first_over_a_budget() {
        let dir =
            std::env::temp_dir().join(format!("engram-shadow-archive-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = std::sync::Arc::new(LocalStorage::open(&dir).unwrap());
        let shadow = Shadow::open(store.clone(), 1000, 0).unwrap();
        let kv = format();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let with = |session: u64, ids: &[u8], generation: u64| ShadowChain {
            session: SessionId(session),
            ..chain(ids, generation)
        };
        {
            let mut st = shadow.state.blocking_lock();
            write_chains(store.as_ref(), &kv, &mut st, vec![with(1, &[1, 2, 3], 1)]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(5));
            write_chains(store.as_ref(), &kv, &mut st, vec![with(2, &[4, 5], 2)]).unwrap();
        }
        let (a, b) = ((TenantId(5), SessionId(1)), (TenantId(5), SessionId(2)));
        let (a_id, b_id) = (session_entry_id(a.0, a.1), session_entry_id(b.0, b.1));
        let size_of = |id: &str| -> u64 {
            store
                .list("entries/")
                .unwrap()
                .iter()
                .filter(|o| o.key.contains(id) && o.key.contains("/seg-"))
                .map(|o| o.size)
                .sum()
        };
        let (a_bytes, b_bytes) = (size_of(&a_id), size_of(&b_id));
        assert!(a_bytes > b_bytes && b_bytes > 0);
        rt.block_on(async {
            // Over a budget of session 2's bytes, session 1 (written first) goes, and that is
            // enough; within budget nothing goes; a kept session is never chosen.
            assert_eq!(shadow.over_budget(b_bytes, |_| false).await, [a]);
            assert_eq!(shadow.over_budget(a_bytes + b_bytes, |_| false).await, []);
            assert_eq!(shadow.over_budget(0, |k| k == a).await, [b]);
            let (marker, size) = shadow.archive(a).await.unwrap().unwrap();
            assert_eq!(
                marker.hashes,
                [Hex32([1; 32]), Hex32([2; 32]), Hex32([3; 32])]
            );
            assert_eq!((marker.tokens, marker.entry_bytes), (48, a_bytes));
            assert!(size > 0);
            assert!(shadow.is_archived(a) && !shadow.is_archived(b));
            assert_eq!(
                shadow.archive_marker(a).await.unwrap(),
                Some(marker.clone())
            );
            // The entry's files are gone; the other session's stay.
            let left: Vec<String> = store
                .list("entries/")
                .unwrap()
                .into_iter()
                .map(|o| o.key)
                .collect();
            assert!(left.iter().all(|k| !k.contains(&a_id)), "{left:?}");
            assert!(left.iter().any(|k| k.contains(&b_id)));
            assert_eq!(shadow.status().archived_sessions, 1);
            // A new process finds the marker.
            let reopened = Shadow::open(store.clone(), 1000, 0).unwrap();
            assert!(reopened.is_archived(a));
            // The thaw removes it; a second thaw finds nothing.
            assert!(reopened.thawed(a).await.unwrap());
            assert!(!reopened.thawed(a).await.unwrap());
            assert_eq!(store.list("archive/").unwrap().len(), 0);
            // Deleting an archived session deletes its marker.
            assert!(shadow.archive(b).await.unwrap().is_some());
            assert_eq!(shadow.forget(TenantId(5), u64::MAX, 2).await.unwrap(), 0);
            assert!(!shadow.is_archived(b));
            assert!(
                store
                    .list("archive/")
                    .unwrap()
                    .iter()
                    .all(|o| !o.key.contains("0000000000000002"))
            );
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
