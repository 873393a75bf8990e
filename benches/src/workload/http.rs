//! A small HTTP/1.1 client for the load driver: plain requests and server-sent-event streams,
//! over loopback or any `http://` endpoint (no TLS: the driver measures servers next to it).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The URL is not `http://host:port/path`.
    #[error("{0}: expected http://host[:port][/path]")]
    Url(String),
    /// Connect, write or read failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The answer is not HTTP/1.x.
    #[error("malformed response: {0}")]
    Malformed(String),
}

/// An endpoint: host, port and base path (no trailing `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or address.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Base path, e.g. `/v1`.
    pub base: String,
}

impl Endpoint {
    /// Parses `http://host[:port][/base]`.
    pub fn parse(url: &str) -> Result<Self, HttpError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| HttpError::Url(url.into()))?;
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().map_err(|_| HttpError::Url(url.into()))?),
            None => (authority, 80),
        };
        if host.is_empty() {
            return Err(HttpError::Url(url.into()));
        }
        Ok(Self {
            host: host.to_string(),
            port,
            base: base.to_string(),
        })
    }

    fn connect(&self, timeout: Duration) -> Result<TcpStream, HttpError> {
        let addr = (self.host.as_str(), self.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| HttpError::Url(self.host.clone()))?;
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(1800)))?;
        Ok(s)
    }

    /// Sends a request and returns the status and a reader of the (de-chunked) body.
    fn send(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: &[u8],
    ) -> Result<(u16, Box<dyn BufRead>), HttpError> {
        let mut s = self.connect(Duration::from_secs(5))?;
        let mut head = format!(
            "{method} {}{path} HTTP/1.1\r\nhost: {}:{}\r\nconnection: close\r\n\
             content-type: application/json\r\naccept: */*\r\ncontent-length: {}\r\n",
            self.base,
            self.host,
            self.port,
            body.len()
        );
        if let Some(k) = key {
            head.push_str(&format!("authorization: Bearer {k}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line)?;
        let status: u16 = line
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| HttpError::Malformed(line.trim().to_string()))?;
        let mut chunked = false;
        let mut length: Option<u64> = None;
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                return Err(HttpError::Malformed("headers cut short".into()));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                    chunked = true;
                } else if k == "content-length" {
                    length = v.parse().ok();
                }
            }
        }
        let body: Box<dyn BufRead> = if chunked {
            Box::new(BufReader::new(Chunked {
                inner: r,
                left: 0,
                done: false,
            }))
        } else if let Some(n) = length {
            Box::new(BufReader::new(r.take(n)))
        } else {
            Box::new(r)
        };
        Ok((status, body))
    }

    /// A whole request: status and body.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: &[u8],
    ) -> Result<(u16, Vec<u8>), HttpError> {
        let (status, mut r) = self.send(method, path, key, body)?;
        let mut out = Vec::new();
        r.read_to_end(&mut out)?;
        Ok((status, out))
    }

    /// A server-sent-event stream: calls `on_data` with each `data:` payload as it arrives.
    /// A non-2xx answer returns its status and body instead.
    pub fn stream(
        &self,
        path: &str,
        key: Option<&str>,
        body: &[u8],
        mut on_data: impl FnMut(&str),
    ) -> Result<(u16, String), HttpError> {
        let (status, mut r) = self.send("POST", path, key, body)?;
        if !(200..300).contains(&status) {
            let mut out = String::new();
            r.read_to_string(&mut out)?;
            return Ok((status, out));
        }
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                break;
            }
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                on_data(data.trim_start());
            }
        }
        Ok((status, String::new()))
    }
}

/// A reader of a chunked body.
struct Chunked<R> {
    inner: R,
    left: u64,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.inner.read_line(&mut line)?;
            if line.trim().is_empty() {
                // The CRLF closing the previous chunk.
                line.clear();
                self.inner.read_line(&mut line)?;
            }
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = u64::from_str_radix(size, 16).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk size")
            })?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = buf.len().min(self.left as usize);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:8080/v1/").unwrap(),
            Endpoint {
                host: "127.0.0.1".into(),
                port: 8080,
                base: "/v1".into()
            }
        );
        assert_eq!(Endpoint::parse("http://h").unwrap().port, 80);
        for bad in ["https://h/v1", "h:80", "http://:80", "http://h:x"] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn chunked_bodies_are_joined() {
        let raw = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        let mut r = Chunked {
            inner: &raw[..],
            left: 0,
            done: false,
        };
        let mut out = String::new();
        r.read_to_string(&mut out).unwrap();
        assert_eq!(out, "hello, world");
        let cut = b"5\r\nhel";
        let mut r = Chunked {
            inner: &cut[..],
            left: 0,
            done: false,
        };
        assert!(r.read_to_string(&mut String::new()).is_err());
    }
}
