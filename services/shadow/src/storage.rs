//! Where the shadow's files live: a local directory (the default) or, with the `s3` feature, an
//! S3-compatible bucket through the `object_store` crate (the path for many nodes).
//!
//! Keys are `/`-separated relative paths (`index.json`, `entries/<id>/manifest.json`). Every
//! backend gives the same three guarantees, on which the shadow's crash safety rests:
//! - a `put` is atomic: a reader sees the old object or the new one, never a part of either;
//! - a `put` is durable when it returns;
//! - a `put` that returned is seen by every later `get` and `list`.
//!
//! The local directory does not go through `object_store`: its local backend neither fsyncs a
//! file nor its directory, so a power cut could lose a manifest whose write had returned.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Result, ShadowError};

/// An object: its key and size in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// `/`-separated key relative to the shadow's root.
    pub key: String,
    /// Bytes.
    pub size: u64,
}

/// A store of the shadow's files (see the module docs for what every backend guarantees).
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// Stores `bytes` under `key` (replacing any earlier object) atomically and durably, at no
    /// more than `bytes_per_sec` (0: unlimited).
    fn put(&self, key: &str, bytes: &[u8], bytes_per_sec: u64) -> Result<()>;
    /// The object under `key`, `None` when there is none.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Every object whose key starts with `prefix` (a directory: empty or ending in `/`),
    /// however deep, sorted by key.
    fn list(&self, prefix: &str) -> Result<Vec<Object>>;
    /// Removes `key`; a missing key is no error.
    fn delete(&self, key: &str) -> Result<()>;
    /// Removes every object under `prefix` (a directory ending in `/`).
    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        for o in self.list(prefix)? {
            self.delete(&o.key)?;
        }
        Ok(())
    }
    /// Where the objects are, for logs and the status (no credentials).
    fn location(&self) -> String;
}

/// Whether `key` names a temp file a crashed local write left behind.
pub fn is_temp(key: &str) -> bool {
    let name = key.rsplit('/').next().unwrap_or(key);
    name.starts_with('.') && name.ends_with(".tmp")
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ShadowError + '_ {
    move |source| ShadowError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Sleeps until `written` bytes since `started` respect `bytes_per_sec` (0: no limit).
fn pace(started: Instant, written: u64, bytes_per_sec: u64) {
    if bytes_per_sec > 0 {
        let due = Duration::from_secs_f64(written as f64 / bytes_per_sec as f64);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
    }
}

/// Checks a key: relative, `/`-separated, no `.` or `..` component, no empty component.
fn check_key(key: &str) -> Result<()> {
    let bad = key.is_empty()
        || key
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == ".." || c.contains('\\'));
    if bad {
        return Err(ShadowError::Invalid {
            what: key.to_string(),
            reason: "not a valid shadow key".into(),
        });
    }
    Ok(())
}

/// A local directory: temp file, fsync, rename, directory fsync for every put.
#[derive(Debug, Clone)]
pub struct LocalStorage {
    root: PathBuf,
}

impl LocalStorage {
    /// A store rooted at `root` (created if missing).
    pub fn open(root: &Path) -> Result<Self> {
        fs::create_dir_all(root).map_err(io(root))?;
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    fn walk(&self, dir: &Path, out: &mut Vec<Object>) -> Result<()> {
        let rd = match fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io(dir)(e)),
        };
        for d in rd {
            let d = d.map_err(io(dir))?;
            let path = d.path();
            let meta = d.metadata().map_err(io(&path))?;
            if meta.is_dir() {
                self.walk(&path, out)?;
            } else if meta.is_file()
                && let Ok(rel) = path.strip_prefix(&self.root)
            {
                let key: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                out.push(Object {
                    key: key.join("/"),
                    size: meta.len(),
                });
            }
        }
        Ok(())
    }
}

/// Makes `dir` exist durably: creates what is missing and fsyncs each new directory's parent.
fn ensure_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        ensure_dir(parent)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(io(dir)(e)),
    }
    if let Some(parent) = dir.parent() {
        File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(io(parent))?;
    }
    Ok(())
}

impl Storage for LocalStorage {
    fn put(&self, key: &str, bytes: &[u8], bytes_per_sec: u64) -> Result<()> {
        let path = self.path(key)?;
        let dir = path.parent().unwrap_or(&self.root).to_path_buf();
        ensure_dir(&dir)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tmp"));
        {
            let mut f = File::create(&tmp).map_err(io(&tmp))?;
            let started = Instant::now();
            let mut written = 0u64;
            for chunk in bytes.chunks(256 << 10) {
                f.write_all(chunk).map_err(io(&tmp))?;
                written += chunk.len() as u64;
                pace(started, written, bytes_per_sec);
            }
            f.sync_all().map_err(io(&tmp))?;
        }
        fs::rename(&tmp, &path).map_err(io(&path))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))?;
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.path(key)?;
        match fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<Object>> {
        let dir = if prefix.is_empty() {
            self.root.clone()
        } else {
            self.path(prefix.trim_end_matches('/'))?
        };
        let mut out = Vec::new();
        self.walk(&dir, &mut out)?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        let path = self.path(prefix.trim_end_matches('/'))?;
        match fs::remove_dir_all(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn location(&self) -> String {
        self.root.display().to_string()
    }
}

/// Settings of an S3-compatible store (`shadow.url = "s3://bucket/prefix"`). Credentials come
/// from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`) or
/// the instance's role, never from the config file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct S3Settings {
    /// `s3://bucket` or `s3://bucket/prefix`.
    pub url: String,
    /// Endpoint of a non-AWS server (`http://127.0.0.1:9000`); empty: AWS (or `AWS_ENDPOINT`).
    pub endpoint: String,
    /// Region; empty: `AWS_REGION` or `us-east-1`.
    pub region: String,
    /// Allow a plain-HTTP endpoint.
    pub allow_http: bool,
    /// Access key id and secret; empty: from the environment or the instance's role.
    pub credentials: Option<(String, String)>,
}

impl S3Settings {
    /// The bucket and the key prefix (no leading or trailing `/`) of `url`.
    pub fn parse(url: &str) -> std::result::Result<(String, String), String> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| "must start with s3://".to_string())?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !valid_bucket {
            return Err(format!(
                "bucket {bucket:?}: 3 to 63 lowercase letters, digits, '-' or '.'"
            ));
        }
        let prefix = prefix.trim_matches('/').to_string();
        if !prefix.is_empty() {
            check_key(&prefix).map_err(|e| e.to_string())?;
        }
        Ok((bucket.to_string(), prefix))
    }
}

/// The store a configuration names: the S3-compatible one `s3` describes (a build with the
/// `s3` feature), else the local directory `dir`.
pub fn open_storage(s3: Option<&S3Settings>, dir: &Path) -> Result<Arc<dyn Storage>> {
    match s3 {
        None => Ok(Arc::new(LocalStorage::open(dir)?)),
        #[cfg(feature = "s3")]
        Some(s) => Ok(Arc::new(ObjectStorage::open_s3(s)?)),
        #[cfg(not(feature = "s3"))]
        Some(s) => Err(ShadowError::Store {
            key: s.url.clone(),
            reason: "this binary was built without the `s3` feature (cargo build --features s3)"
                .into(),
        }),
    }
}

#[cfg(feature = "s3")]
pub use remote::ObjectStorage;

#[cfg(feature = "s3")]
mod remote {
    use std::future::Future;
    use std::sync::Arc;
    use std::time::Instant;

    use futures_util::TryStreamExt;
    use object_store::aws::AmazonS3Builder;
    use object_store::path::Path as ObjectPath;
    use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

    use super::{Object, Result, S3Settings, ShadowError, Storage, check_key, pace};

    /// An `object_store` store, driven from the shadow's blocking threads on a runtime of its
    /// own (the service's runtime is never blocked on it).
    #[derive(Debug)]
    pub struct ObjectStorage {
        store: Arc<dyn ObjectStore>,
        /// Key prefix inside the bucket, empty or ending in `/`.
        prefix: String,
        location: String,
        runtime: Option<tokio::runtime::Runtime>,
    }

    fn remote(key: &str, e: impl std::fmt::Display) -> ShadowError {
        ShadowError::Store {
            key: key.to_string(),
            reason: e.to_string(),
        }
    }

    impl ObjectStorage {
        /// A store for an `s3://` URL.
        pub fn open_s3(s: &S3Settings) -> Result<Self> {
            let (bucket, prefix) =
                S3Settings::parse(&s.url).map_err(|e| remote("shadow.url", e))?;
            let mut b = AmazonS3Builder::from_env().with_bucket_name(&bucket);
            if !s.endpoint.is_empty() {
                b = b.with_endpoint(&s.endpoint);
            }
            if !s.region.is_empty() {
                b = b.with_region(&s.region);
            }
            if s.allow_http {
                b = b.with_allow_http(true);
            }
            if let Some((id, secret)) = &s.credentials {
                b = b.with_access_key_id(id).with_secret_access_key(secret);
            }
            let store = b.build().map_err(|e| remote("shadow.url", e))?;
            Self::new(Arc::new(store), &prefix, &s.url)
        }

        /// A store over any `object_store` backend, under `prefix`.
        pub fn new(store: Arc<dyn ObjectStore>, prefix: &str, location: &str) -> Result<Self> {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("engram-shadow-io")
                .enable_all()
                .build()
                .map_err(|e| remote("runtime", e))?;
            let prefix = prefix.trim_matches('/');
            Ok(Self {
                store,
                prefix: if prefix.is_empty() {
                    String::new()
                } else {
                    format!("{prefix}/")
                },
                location: location.to_string(),
                runtime: Some(runtime),
            })
        }

        /// Runs `f` on the store's runtime and waits for it (from any thread, async or not).
        fn run<T: Send + 'static>(&self, f: impl Future<Output = T> + Send + 'static) -> Result<T> {
            let rt = self
                .runtime
                .as_ref()
                .ok_or_else(|| remote("runtime", "stopped"))?;
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            rt.spawn(async move {
                let _ = tx.send(f.await);
            });
            rx.recv().map_err(|_| remote("runtime", "task lost"))
        }

        fn path(&self, key: &str) -> Result<ObjectPath> {
            check_key(key)?;
            Ok(ObjectPath::from(format!("{}{key}", self.prefix)))
        }
    }

    impl Drop for ObjectStorage {
        fn drop(&mut self) {
            // Dropping a runtime blocks; the service may drop the shadow on an async thread.
            if let Some(rt) = self.runtime.take() {
                rt.shutdown_background();
            }
        }
    }

    impl Storage for ObjectStorage {
        fn put(&self, key: &str, bytes: &[u8], bytes_per_sec: u64) -> Result<()> {
            let path = self.path(key)?;
            let store = self.store.clone();
            let payload = PutPayload::from(bytes.to_vec());
            let started = Instant::now();
            // One PUT: S3 stores the whole object or nothing, and durably before it answers.
            self.run(async move { store.put(&path, payload).await })?
                .map_err(|e| remote(key, e))?;
            pace(started, bytes.len() as u64, bytes_per_sec);
            Ok(())
        }

        fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
            let path = self.path(key)?;
            let store = self.store.clone();
            let got = self.run(async move {
                match store.get(&path).await {
                    Ok(r) => r.bytes().await.map(|b| Some(b.to_vec())),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })?;
            got.map_err(|e| remote(key, e))
        }

        fn list(&self, prefix: &str) -> Result<Vec<Object>> {
            let full = format!("{}{}", self.prefix, prefix.trim_end_matches('/'));
            let root = self.prefix.clone();
            let store = self.store.clone();
            let listed = self.run(async move {
                let p = (!full.is_empty()).then(|| ObjectPath::from(full));
                store.list(p.as_ref()).try_collect::<Vec<_>>().await
            })?;
            let mut out: Vec<Object> = listed
                .map_err(|e| remote(prefix, e))?
                .into_iter()
                .filter_map(|m| {
                    let key = m.location.as_ref().strip_prefix(root.as_str())?.to_string();
                    Some(Object { key, size: m.size })
                })
                .collect();
            out.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(out)
        }

        fn delete(&self, key: &str) -> Result<()> {
            let path = self.path(key)?;
            let store = self.store.clone();
            let done = self.run(async move {
                match store.delete(&path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            })?;
            done.map_err(|e| remote(key, e))
        }

        fn location(&self) -> String {
            self.location.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn s3_urls_parse_to_bucket_and_prefix() {
        assert_eq!(
            S3Settings::parse("s3://engram-shadow").unwrap(),
            ("engram-shadow".into(), String::new())
        );
        assert_eq!(
            S3Settings::parse("s3://engram-shadow/node-1/").unwrap(),
            ("engram-shadow".into(), "node-1".into())
        );
        for bad in [
            "file:///tmp",
            "s3://",
            "s3://UPPER",
            "s3://ab",
            "s3://b_u",
            "s3://bucket/a/../b",
        ] {
            assert!(S3Settings::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn keys_that_escape_the_root_are_refused() {
        let d = std::env::temp_dir().join(format!("engram-storage-keys-{}", std::process::id()));
        let s = LocalStorage::open(&d).unwrap();
        for bad in ["", "../x", "a//b", "/abs", "a/./b", "a\\b"] {
            assert!(s.put(bad, b"x", 0).is_err(), "{bad:?} accepted");
            assert!(s.get(bad).is_err(), "{bad:?} accepted");
        }
        let _ = fs::remove_dir_all(&d);
    }
}
