//! The shadow offline and as files: `engram shadow verify`, and a session — or every session
//! of an agent — exported as one safetensors file and imported again.

use std::collections::HashMap;

use engram_engine::{Hex32, KvFormat, ShadowBlock};
use engram_kvcore::TenantId;
use engram_kvcore::shadow::{checksum, decode_segment, encode_segment};
use serde::{Deserialize, Serialize};

use super::{
    ChainBlocks, FORMAT, FormatInfo, Manifest, Result, Storage, block_bytes, entry_files,
    entry_key, invalid, read_checked_json, read_segments, reason_of,
};

/// What `engram shadow verify` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    /// Entries checked.
    pub entries: usize,
    /// Entries whose every check passed.
    pub ok: usize,
    /// `(entry, reason)` of the others.
    pub damaged: Vec<(String, String)>,
    /// Blocks checked.
    pub blocks: usize,
    /// Bytes of the segment files read.
    pub bytes: u64,
}

/// Checks a shadow directory offline: manifests' checksums and format, every segment decodes
/// with the manifest's layout, every block's CRC, and every chain hash (recomputed from the
/// recorded fingerprint, salt, parent and tokens).
pub fn verify(store: &dyn Storage) -> Result<VerifyReport> {
    let mut report = VerifyReport::default();
    let mut manifests: HashMap<String, Manifest> = HashMap::new();
    let mut ids: Vec<String> = entry_files(&store.list("entries/")?).into_keys().collect();
    // Prefix entries first, so session chains can continue from them.
    ids.sort_by_key(|id| (!id.starts_with("p-"), id.clone()));
    for id in ids {
        report.entries += 1;
        let checked = read_checked_json::<Manifest>(store, &entry_key(&id, "manifest.json"))
            .and_then(|m| {
                if m.format != FORMAT || m.id != id {
                    return Err(invalid(&id, "format"));
                }
                let segs = read_segments(store, &m, &mut report.bytes)?;
                let mut parent = match &m.prefix {
                    Some(p) => {
                        let pm = manifests
                            .get(&p.id)
                            .ok_or_else(|| invalid(&id, "prefix_unusable"))?;
                        let last = p
                            .blocks
                            .checked_sub(1)
                            .and_then(|i| pm.blocks.get(i))
                            .ok_or_else(|| invalid(&id, "prefix_unusable"))?;
                        Some(last.block.hash.0)
                    }
                    None => None,
                };
                for b in &m.blocks {
                    block_bytes(&segs, &m, b)?;
                    let salt = if b.block.public { 0 } else { m.tenant };
                    let h = engram_engine::chain_hash(
                        &m.kv.fingerprint.0,
                        salt,
                        parent.as_ref(),
                        &b.block.tokens,
                    );
                    if h != b.block.hash.0 {
                        return Err(invalid(&id, "hash_mismatch"));
                    }
                    parent = Some(h);
                    report.blocks += 1;
                }
                Ok(m)
            });
        match checked {
            Ok(m) => {
                report.ok += 1;
                manifests.insert(id, m);
            }
            Err(e) => report.damaged.push((id, reason_of(&e))),
        }
    }
    Ok(report)
}

/// The metadata key of an exported session's manifest.
pub const EXPORT_KEY: &str = "engram.session";

/// An exported session: every block (prefix first) in one safetensors file, with the format
/// and the block list in its header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportHeader {
    /// [`FORMAT`].
    pub format: u32,
    /// The KV format.
    pub kv: FormatInfo,
    /// Leading stable blocks.
    pub stable_blocks: usize,
    /// Blocks in chain order, with the CRC of each block's bytes.
    pub blocks: Vec<ExportBlock>,
}

/// One exported block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportBlock {
    /// What the block is.
    #[serde(flatten)]
    pub block: ShadowBlock,
    /// CRC-32C of its bytes.
    pub crc32c: u32,
}

/// Encodes a session's blocks as one safetensors file.
pub fn export_file(
    kv: &KvFormat,
    stable_blocks: usize,
    blocks: &[(ShadowBlock, Vec<u8>)],
) -> Result<Vec<u8>> {
    let header = ExportHeader {
        format: FORMAT,
        kv: FormatInfo::of(kv),
        stable_blocks,
        blocks: blocks
            .iter()
            .map(|(b, bytes)| ExportBlock {
                block: b.clone(),
                crc32c: checksum(bytes),
            })
            .collect(),
    };
    let json = serde_json::to_string(&header).map_err(|e| invalid("export", e.to_string()))?;
    let refs: Vec<&[u8]> = blocks.iter().map(|(_, b)| b.as_slice()).collect();
    Ok(encode_segment(
        &kv.parts,
        &refs,
        Some(HashMap::from([(EXPORT_KEY.to_string(), json)])),
    )?)
}

/// Decodes an exported session for `kv`, re-hashing its chain for `tenant` (a session may be
/// imported by another tenant: the KV of the same tokens is the same, only the salt differs).
///
/// Every block is hashed with the caller's salt, whatever the file says: an import never
/// creates a public block (public blocks are computed by the engine from an operator-marked
/// layer, never supplied by a tenant), so a crafted file can only ever reach its own tenant.
pub fn import_file(kv: &KvFormat, tenant: TenantId, bytes: &[u8]) -> Result<(usize, ChainBlocks)> {
    let seg = decode_segment(&kv.parts, bytes).map_err(|e| invalid("import", e.to_string()))?;
    let json = seg
        .metadata
        .get(EXPORT_KEY)
        .ok_or_else(|| invalid("import", "format: no engram.session header"))?;
    let header: ExportHeader =
        serde_json::from_str(json).map_err(|e| invalid("import", format!("format: {e}")))?;
    if header.format != FORMAT || header.blocks.len() != seg.blocks.len() {
        return Err(invalid("import", "format: block count or version differs"));
    }
    if let Some(reason) = header.kv.mismatch(kv) {
        return Err(invalid("import", reason));
    }
    let mut parent: Option<[u8; 32]> = None;
    let mut out = Vec::with_capacity(seg.blocks.len());
    for (b, bytes) in header.blocks.into_iter().zip(seg.blocks) {
        if checksum(&bytes) != b.crc32c {
            return Err(invalid("import", "checksum"));
        }
        let mut block = b.block;
        block.public = false;
        let h =
            engram_engine::chain_hash(&kv.fingerprint, tenant.0, parent.as_ref(), &block.tokens);
        block.hash = Hex32(h);
        parent = Some(h);
        out.push((block, bytes));
    }
    Ok((header.stable_blocks, out))
}

/// The metadata key of an exported agent's header.
pub const AGENT_EXPORT_KEY: &str = "engram.agent";

/// Sessions one agent file may hold at most.
pub const MAX_AGENT_SESSIONS: usize = 4096;

/// An exported agent: every cached session of the agent in one safetensors file. Each distinct
/// block is stored once (sessions of one agent share their stable prefix); each session lists
/// its blocks in chain order as rows of the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentExportHeader {
    /// [`FORMAT`].
    pub format: u32,
    /// The KV format.
    pub kv: FormatInfo,
    /// The distinct blocks in file order, with the CRC of each block's bytes.
    pub blocks: Vec<ExportBlock>,
    /// The sessions.
    pub sessions: Vec<AgentExportSession>,
}

/// One session of an exported agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentExportSession {
    /// The session's name.
    pub name: String,
    /// Leading stable blocks.
    pub stable_blocks: usize,
    /// Its blocks in chain order, as rows of the file.
    pub rows: Vec<usize>,
}

/// One session of an agent file: its name, leading stable blocks and blocks with bytes.
pub type AgentSession = (String, usize, ChainBlocks);

/// Encodes an agent's sessions as one safetensors file (each distinct block once).
pub fn export_agent_file(kv: &KvFormat, sessions: &[AgentSession]) -> Result<Vec<u8>> {
    if sessions.len() > MAX_AGENT_SESSIONS {
        return Err(invalid(
            "export",
            format!("format: more than {MAX_AGENT_SESSIONS} sessions"),
        ));
    }
    let mut row_of: HashMap<[u8; 32], usize> = HashMap::new();
    let mut blocks: Vec<ExportBlock> = Vec::new();
    let mut bytes: Vec<&[u8]> = Vec::new();
    let mut out = Vec::with_capacity(sessions.len());
    for (name, stable_blocks, chain) in sessions {
        let mut rows = Vec::with_capacity(chain.len());
        for (b, data) in chain {
            let row = *row_of.entry(b.hash.0).or_insert_with(|| {
                blocks.push(ExportBlock {
                    block: b.clone(),
                    crc32c: checksum(data),
                });
                bytes.push(data);
                blocks.len() - 1
            });
            rows.push(row);
        }
        out.push(AgentExportSession {
            name: name.clone(),
            stable_blocks: *stable_blocks,
            rows,
        });
    }
    let header = AgentExportHeader {
        format: FORMAT,
        kv: FormatInfo::of(kv),
        blocks,
        sessions: out,
    };
    let json = serde_json::to_string(&header).map_err(|e| invalid("export", e.to_string()))?;
    Ok(encode_segment(
        &kv.parts,
        &bytes,
        Some(HashMap::from([(AGENT_EXPORT_KEY.to_string(), json)])),
    )?)
}

/// Decodes an exported agent for `kv`, with the checks of [`import_file`] — format, KV
/// format, every block's CRC — and every session's chain re-hashed for `tenant` (never public).
/// `valid_name` checks each session's name. Sessions come back in file order.
pub fn import_agent_file(
    kv: &KvFormat,
    tenant: TenantId,
    bytes: &[u8],
    valid_name: impl Fn(&str) -> bool,
) -> Result<Vec<AgentSession>> {
    let seg = decode_segment(&kv.parts, bytes).map_err(|e| invalid("import", e.to_string()))?;
    let json = seg
        .metadata
        .get(AGENT_EXPORT_KEY)
        .ok_or_else(|| invalid("import", "format: no engram.agent header"))?;
    let header: AgentExportHeader =
        serde_json::from_str(json).map_err(|e| invalid("import", format!("format: {e}")))?;
    if header.format != FORMAT || header.blocks.len() != seg.blocks.len() {
        return Err(invalid("import", "format: block count or version differs"));
    }
    if header.sessions.len() > MAX_AGENT_SESSIONS {
        return Err(invalid("import", "format: too many sessions"));
    }
    if let Some(reason) = header.kv.mismatch(kv) {
        return Err(invalid("import", reason));
    }
    for (b, data) in header.blocks.iter().zip(&seg.blocks) {
        if checksum(data) != b.crc32c {
            return Err(invalid("import", "checksum"));
        }
    }
    let mut names = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(header.sessions.len());
    for s in header.sessions {
        if !valid_name(&s.name) || !names.insert(s.name.clone()) {
            return Err(invalid(
                "import",
                "format: a session name is invalid or repeated",
            ));
        }
        let mut parent: Option<[u8; 32]> = None;
        let mut chain = Vec::with_capacity(s.rows.len());
        for row in s.rows {
            let (b, data) = header
                .blocks
                .get(row)
                .zip(seg.blocks.get(row))
                .ok_or_else(|| invalid("import", "format: a session names a missing block"))?;
            let mut block = b.block.clone();
            block.public = false;
            let h = engram_engine::chain_hash(
                &kv.fingerprint,
                tenant.0,
                parent.as_ref(),
                &block.tokens,
            );
            block.hash = Hex32(h);
            parent = Some(h);
            chain.push((block, data.clone()));
        }
        out.push((s.name, s.stable_blocks, chain));
    }
    Ok(out)
}
