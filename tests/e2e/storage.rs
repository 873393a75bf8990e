//! The shadow's stores keep one contract (atomic replace, read-your-writes listing, deletes),
//! checked against the local directory and, with the `s3` feature, a real S3-compatible server
//! (`s3s-fs`, installed by `make s3-server`) on a local port.

use std::time::{Duration, Instant};

use engram_shadow::{LocalStorage, Storage};

use crate::shadow::fresh_dir;

/// What every store must do.
fn contract(s: &dyn Storage) {
    assert_eq!(s.get("entries/e1/manifest.json").unwrap(), None);
    assert!(s.list("").unwrap().is_empty());
    s.put("entries/e1/manifest.json", b"first", 0).unwrap();
    s.put("entries/e1/manifest.json", b"second!", 0).unwrap();
    assert_eq!(
        s.get("entries/e1/manifest.json").unwrap().as_deref(),
        Some(&b"second!"[..])
    );
    let big: Vec<u8> = (0..(3u32 << 20)).map(|i| (i * 7 + i / 991) as u8).collect();
    s.put("entries/e1/seg-1.safetensors", &big, 0).unwrap();
    s.put("entries/e2/seg-1.safetensors", b"x", 0).unwrap();
    s.put("index.json", b"{}", 0).unwrap();
    assert_eq!(
        s.get("entries/e1/seg-1.safetensors").unwrap().as_deref(),
        Some(big.as_slice())
    );
    let keys = |p: &str| -> Vec<(String, u64)> {
        s.list(p)
            .unwrap()
            .into_iter()
            .map(|o| (o.key, o.size))
            .collect()
    };
    assert_eq!(
        keys(""),
        vec![
            ("entries/e1/manifest.json".to_string(), 7),
            ("entries/e1/seg-1.safetensors".to_string(), big.len() as u64),
            ("entries/e2/seg-1.safetensors".to_string(), 1),
            ("index.json".to_string(), 2),
        ]
    );
    assert_eq!(
        keys("entries/e2/"),
        vec![("entries/e2/seg-1.safetensors".to_string(), 1)]
    );
    assert!(keys("entries/e3/").is_empty());
    for bad in ["../escape", "entries//x", "/abs"] {
        assert!(s.put(bad, b"x", 0).is_err(), "{bad:?} accepted");
    }
    s.delete("entries/e1/manifest.json").unwrap();
    s.delete("entries/e1/manifest.json").unwrap();
    assert_eq!(s.get("entries/e1/manifest.json").unwrap(), None);
    s.delete_prefix("entries/e1/").unwrap();
    assert_eq!(
        keys(""),
        vec![
            ("entries/e2/seg-1.safetensors".to_string(), 1),
            ("index.json".to_string(), 2)
        ]
    );
    // A paced put takes at least its size over the rate (1 MiB at 4 MiB/s).
    let started = Instant::now();
    s.put("entries/e2/paced", &big[..1 << 20], 4 << 20).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(240));
    s.delete_prefix("entries/").unwrap();
    s.delete("index.json").unwrap();
    assert!(s.list("").unwrap().is_empty());
}

#[test]
fn the_local_store_keeps_the_contract() {
    let d = fresh_dir("store-local");
    contract(&LocalStorage::open(&d).unwrap());
    let _ = std::fs::remove_dir_all(&d);
}

#[cfg(feature = "s3")]
/// An S3-compatible server (`s3s-fs`) on a free local port, storing objects as files under
/// `root/<bucket>/<key>`; stopped when dropped.
pub struct S3Server {
    child: std::process::Child,
    /// Its data directory.
    pub root: std::path::PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
}

#[cfg(feature = "s3")]
/// Credentials the test server accepts.
pub const S3_KEY: (&str, &str) = ("engram-test-key", "engram-test-secret-0123456789");

#[cfg(feature = "s3")]
/// The S3 server binary: `ENGRAM_S3_SERVER`, else where `make s3-server` installs it.
fn s3_server_binary() -> std::path::PathBuf {
    use std::path::PathBuf;
    let path = std::env::var_os("ENGRAM_S3_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/engram-tools/bin/s3s-fs")
        });
    assert!(
        path.is_file(),
        "no S3-compatible server at {}: run `make s3-server` (installs s3s-fs from crates.io) \
         or set ENGRAM_S3_SERVER",
        path.display()
    );
    path
}

#[cfg(feature = "s3")]
impl S3Server {
    /// Starts a server holding the (empty) bucket `bucket`.
    pub fn start(bucket: &str) -> Self {
        let root = fresh_dir("s3");
        std::fs::create_dir_all(root.join(bucket)).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new(s3_server_binary())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", S3_KEY.0, "--secret-key", S3_KEY.1])
            .arg(&root)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "s3s-fs did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            child,
            root,
            endpoint: format!("http://127.0.0.1:{port}"),
        }
    }

    /// Settings for `s3://<bucket>/<prefix>` on this server.
    pub fn settings(&self, url: &str) -> engram_shadow::S3Settings {
        engram_shadow::S3Settings {
            url: url.to_string(),
            endpoint: self.endpoint.clone(),
            region: "us-east-1".into(),
            allow_http: true,
            credentials: Some((S3_KEY.0.into(), S3_KEY.1.into())),
        }
    }
}

#[cfg(feature = "s3")]
impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[cfg(feature = "s3")]
#[test]
fn an_s3_compatible_store_keeps_the_contract() {
    use engram_shadow::ObjectStorage;

    let s3 = S3Server::start("engram-shadow");
    let store = ObjectStorage::open_s3(&s3.settings("s3://engram-shadow/node-1")).unwrap();
    contract(&store);
    // Objects really are on the server, under the prefix.
    store.put("entries/e9/manifest.json", b"m", 0).unwrap();
    let on_disk = s3
        .root
        .join("engram-shadow/node-1/entries/e9/manifest.json");
    assert_eq!(std::fs::read(&on_disk).unwrap(), b"m");
    // Wrong credentials are an error, not an empty store.
    let mut bad = s3.settings("s3://engram-shadow/node-1");
    bad.credentials = Some((S3_KEY.0.into(), "wrong-secret-0000000000".into()));
    let err = ObjectStorage::open_s3(&bad).unwrap().list("").unwrap_err();
    assert!(
        matches!(err, engram_shadow::ShadowError::Store { .. }),
        "{err}"
    );
}
