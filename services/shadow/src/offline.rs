//! The shadow offline and as files: `engram shadow verify`, and a session — or every session
//! of an agent — exported as one safetensors file and imported again.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};

use engram_engine::{Hex32, KvFormat, ShadowBlock};
use engram_kvcore::TenantId;
use engram_kvcore::shadow::{
    SegmentReader, checksum, encode_segment, segment_data_len, segment_header,
};
use serde::{Deserialize, Serialize};

use super::{
    ChainBlocks, FORMAT, FormatInfo, Manifest, Result, ShadowError, Storage, block_bytes,
    entry_files, entry_key, invalid, read_checked_json, read_segments, reason_of,
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

/// Decodes an exported session for `kv` from `reader` (`len` bytes), a block at a time,
/// re-hashing its chain for `tenant` (a session may be imported by another tenant: the KV of the
/// same tokens is the same, only the salt differs). The file is never held in memory whole.
///
/// Every block is hashed with the caller's salt, whatever the file says: an import never
/// creates a public block (public blocks are computed by the engine from an operator-marked
/// layer, never supplied by a tenant), so a crafted file can only ever reach its own tenant.
/// A chain of more than `max_tokens` tokens (the model's context) is refused before any block
/// is read: no turn could attend it.
pub fn import_file<R: Read + Seek>(
    kv: &KvFormat,
    tenant: TenantId,
    reader: R,
    len: u64,
    max_tokens: usize,
) -> Result<(usize, ChainBlocks)> {
    let mut seg = SegmentReader::open(&kv.parts, reader, len)
        .map_err(|e| invalid("import", e.to_string()))?;
    let json = seg
        .metadata()
        .get(EXPORT_KEY)
        .ok_or_else(|| invalid("import", "format: no engram.session header"))?;
    let header: ExportHeader =
        serde_json::from_str(json).map_err(|e| invalid("import", format!("format: {e}")))?;
    if header.format != FORMAT || header.blocks.len() != seg.len() {
        return Err(invalid("import", "format: block count or version differs"));
    }
    if let Some(reason) = header.kv.mismatch(kv) {
        return Err(invalid("import", reason));
    }
    let tokens: usize = header.blocks.iter().map(|b| b.block.tokens.len()).sum();
    if tokens > max_tokens {
        return Err(too_long(tokens, max_tokens));
    }
    let mut parent: Option<[u8; 32]> = None;
    let mut out = Vec::with_capacity(seg.len());
    for (i, b) in header.blocks.into_iter().enumerate() {
        let bytes = read_checked(&mut seg, i, b.crc32c)?;
        let block = rehash(kv, tenant, &mut parent, b.block);
        out.push((block, bytes));
    }
    Ok((header.stable_blocks, out))
}

/// A chain longer than the model's context.
fn too_long(tokens: usize, max_tokens: usize) -> ShadowError {
    invalid(
        "import",
        format!("a chain of {tokens} tokens is longer than the model's context ({max_tokens})"),
    )
}

/// Block `i` of `seg`, refused unless its CRC is `crc`.
fn read_checked<R: Read + Seek>(seg: &mut SegmentReader<R>, i: usize, crc: u32) -> Result<Vec<u8>> {
    let bytes = seg.block(i).map_err(|e| invalid("import", e.to_string()))?;
    if checksum(&bytes) != crc {
        return Err(invalid("import", "checksum"));
    }
    Ok(bytes)
}

/// `block` as the caller's tenant's, after `parent` in its chain: private, hashed with the
/// tenant's salt.
fn rehash(
    kv: &KvFormat,
    tenant: TenantId,
    parent: &mut Option<[u8; 32]>,
    mut block: ShadowBlock,
) -> ShadowBlock {
    block.public = false;
    let h = engram_engine::chain_hash(&kv.fingerprint, tenant.0, parent.as_ref(), &block.tokens);
    block.hash = Hex32(h);
    *parent = Some(h);
    block
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

/// An agent file written a session at a time, in the memory of one session: each distinct
/// block's bytes go to `spool` (a temporary file) as they come, and [`AgentExportWriter::finish`]
/// gives the file as a reader that lays them out (header first, then each part of every block)
/// from the spool.
#[derive(Debug)]
pub struct AgentExportWriter<S> {
    parts: Vec<engram_kvcore::BlockPart>,
    block_len: usize,
    kv: FormatInfo,
    spool: S,
    row_of: HashMap<[u8; 32], usize>,
    blocks: Vec<ExportBlock>,
    sessions: Vec<AgentExportSession>,
}

impl<S: Read + Write + Seek> AgentExportWriter<S> {
    /// An empty agent file for `kv`, spooling into `spool`.
    pub fn new(kv: &KvFormat, spool: S) -> Self {
        Self {
            parts: kv.parts.clone(),
            block_len: kv.parts.iter().map(|p| p.len()).sum(),
            kv: FormatInfo::of(kv),
            spool,
            row_of: HashMap::new(),
            blocks: Vec::new(),
            sessions: Vec::new(),
        }
    }

    /// Sessions added.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Adds a session: its name, leading stable blocks and chain (blocks the file holds already
    /// are not written again).
    pub fn add_session(
        &mut self,
        name: String,
        stable_blocks: usize,
        chain: &ChainBlocks,
    ) -> Result<()> {
        if self.sessions.len() >= MAX_AGENT_SESSIONS {
            return Err(invalid(
                "export",
                format!("format: more than {MAX_AGENT_SESSIONS} sessions"),
            ));
        }
        let mut rows = Vec::with_capacity(chain.len());
        for (b, data) in chain {
            if let Some(&row) = self.row_of.get(&b.hash.0) {
                rows.push(row);
                continue;
            }
            if data.len() != self.block_len {
                return Err(invalid("export", "format: a block of another layout"));
            }
            self.spool.write_all(data).map_err(spool_error)?;
            self.blocks.push(ExportBlock {
                block: b.clone(),
                crc32c: checksum(data),
            });
            let row = self.blocks.len() - 1;
            self.row_of.insert(b.hash.0, row);
            rows.push(row);
        }
        self.sessions.push(AgentExportSession {
            name,
            stable_blocks,
            rows,
        });
        Ok(())
    }

    /// The file, as a reader of its bytes.
    pub fn finish(mut self) -> Result<AgentExportFile<S>> {
        let n = self.blocks.len();
        let header = AgentExportHeader {
            format: FORMAT,
            kv: self.kv,
            blocks: self.blocks,
            sessions: self.sessions,
        };
        let json = serde_json::to_string(&header).map_err(|e| invalid("export", e.to_string()))?;
        let head = segment_header(
            &self.parts,
            n,
            Some(HashMap::from([(AGENT_EXPORT_KEY.to_string(), json)])),
        )?;
        self.spool.flush().map_err(spool_error)?;
        let len = head.len() as u64 + segment_data_len(&self.parts, n);
        Ok(AgentExportFile {
            head,
            spool: self.spool,
            parts: self.parts.iter().map(|p| (p.offset, p.len())).collect(),
            blocks: n,
            block_len: self.block_len,
            pos: 0,
            len,
        })
    }
}

fn spool_error(e: std::io::Error) -> ShadowError {
    ShadowError::Io {
        path: "agent export spool".into(),
        source: e,
    }
}

/// A finished agent file ([`AgentExportWriter::finish`]): its bytes as a [`Read`]er, header
/// first, then each part of every block read from the spool.
#[derive(Debug)]
pub struct AgentExportFile<S> {
    head: Vec<u8>,
    spool: S,
    /// Each part's offset in a block's bytes and its length.
    parts: Vec<(usize, usize)>,
    blocks: usize,
    block_len: usize,
    pos: u64,
    len: u64,
}

impl<S> AgentExportFile<S> {
    /// Bytes of the whole file.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the file has no bytes (never: it has a header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<S: Read + Seek> Read for AgentExportFile<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let head = self.head.len() as u64;
        if self.pos < head {
            let at = self.pos as usize;
            let n = buf.len().min(self.head.len() - at);
            buf[..n].copy_from_slice(&self.head[at..at + n]);
            self.pos += n as u64;
            return Ok(n);
        }
        // The part, the block and the byte within it that `pos` falls on.
        let mut off = self.pos - head;
        for &(offset, len) in &self.parts {
            let tensor = (len * self.blocks) as u64;
            if off >= tensor {
                off -= tensor;
                continue;
            }
            let (block, within) = ((off / len as u64) as usize, (off % len as u64) as usize);
            let n = buf.len().min(len - within);
            let at = (block * self.block_len + offset + within) as u64;
            self.spool.seek(SeekFrom::Start(at))?;
            self.spool.read_exact(&mut buf[..n])?;
            self.pos += n as u64;
            return Ok(n);
        }
        Ok(0)
    }
}

/// An exported agent file opened for import: its header and every block's CRC checked (a block
/// at a time), the sessions then read one by one ([`AgentImportFile::session`]) in the memory of
/// one session. Nothing in it is trusted before every check passed.
#[derive(Debug)]
pub struct AgentImportFile<R> {
    seg: SegmentReader<R>,
    header: AgentExportHeader,
}

/// Opens an exported agent for `kv` from `reader` (`len` bytes), with the checks of
/// [`import_file`] — format, KV format, every block's CRC — and every session's name (by
/// `valid_name`, and unique) and rows.
pub fn open_agent_import<R: Read + Seek>(
    kv: &KvFormat,
    reader: R,
    len: u64,
    max_tokens: usize,
    valid_name: impl Fn(&str) -> bool,
) -> Result<AgentImportFile<R>> {
    let mut seg = SegmentReader::open(&kv.parts, reader, len)
        .map_err(|e| invalid("import", e.to_string()))?;
    let json = seg
        .metadata()
        .get(AGENT_EXPORT_KEY)
        .ok_or_else(|| invalid("import", "format: no engram.agent header"))?;
    let header: AgentExportHeader =
        serde_json::from_str(json).map_err(|e| invalid("import", format!("format: {e}")))?;
    if header.format != FORMAT || header.blocks.len() != seg.len() {
        return Err(invalid("import", "format: block count or version differs"));
    }
    if header.sessions.len() > MAX_AGENT_SESSIONS {
        return Err(invalid("import", "format: too many sessions"));
    }
    if let Some(reason) = header.kv.mismatch(kv) {
        return Err(invalid("import", reason));
    }
    let mut names = std::collections::HashSet::new();
    for s in &header.sessions {
        if !valid_name(&s.name) || !names.insert(s.name.as_str()) {
            return Err(invalid(
                "import",
                "format: a session name is invalid or repeated",
            ));
        }
        if s.rows.iter().any(|&r| r >= header.blocks.len()) {
            return Err(invalid("import", "format: a session names a missing block"));
        }
        let tokens: usize = s
            .rows
            .iter()
            .map(|&r| header.blocks[r].block.tokens.len())
            .sum();
        if tokens > max_tokens {
            return Err(too_long(tokens, max_tokens));
        }
    }
    for (i, b) in header.blocks.iter().enumerate() {
        read_checked(&mut seg, i, b.crc32c)?;
    }
    Ok(AgentImportFile { seg, header })
}

impl<R: Read + Seek> AgentImportFile<R> {
    /// The sessions' names, in file order.
    pub fn names(&self) -> Vec<String> {
        self.header
            .sessions
            .iter()
            .map(|s| s.name.clone())
            .collect()
    }

    /// Session `i` (file order) as `tenant`'s: its name, stable blocks and chain, re-hashed for
    /// the tenant (never public), each block's CRC checked again as it is read.
    pub fn session(&mut self, kv: &KvFormat, tenant: TenantId, i: usize) -> Result<AgentSession> {
        let s = self
            .header
            .sessions
            .get(i)
            .ok_or_else(|| invalid("import", "format: no such session"))?;
        let mut parent: Option<[u8; 32]> = None;
        let mut chain = Vec::with_capacity(s.rows.len());
        for &row in &s.rows {
            let b = self
                .header
                .blocks
                .get(row)
                .ok_or_else(|| invalid("import", "format: a session names a missing block"))?;
            let bytes = read_checked(&mut self.seg, row, b.crc32c)?;
            chain.push((rehash(kv, tenant, &mut parent, b.block.clone()), bytes));
        }
        Ok((s.name.clone(), s.stable_blocks, chain))
    }
}
