//! Small HTTP helpers shared by the Hub and PyPI paths: a reachability probe with a short
//! connect timeout (so an unreachable Hub fails in seconds, not minutes), a `ureq` agent with
//! timeouts that trusts the system certificate store, JSON GETs and streaming downloads.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::error::{FetchError, Result};

/// Splits `scheme://[user@]host[:port]/...` into host and port (default 80/443).
pub(crate) fn host_port(url: &str) -> std::result::Result<(String, u16), String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("`{url}` is not an http(s) URL"))?;
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" | "socks5" | "socks5h" | "socks4" => 80,
        "https" => 443,
        other => return Err(format!("unsupported URL scheme `{other}` in `{url}`")),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let (host, port) = if let Some(stripped) = host_port.strip_prefix('[') {
        // [ipv6]:port
        let (h, tail) = stripped
            .split_once(']')
            .ok_or_else(|| format!("bad IPv6 host in `{url}`"))?;
        (h.to_string(), tail.strip_prefix(':'))
    } else {
        match host_port.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (host_port.to_string(), None),
        }
    };
    if host.is_empty() {
        return Err(format!("no host in `{url}`"));
    }
    let port = match port {
        Some(p) => p.parse().map_err(|_| format!("bad port in `{url}`"))?,
        None => default_port,
    };
    Ok((host, port))
}

/// The proxy `ureq` would use for `url` (same variables as `try_proxy_from_env`).
fn proxy_for(url: &str) -> Option<String> {
    let https = url.to_ascii_lowercase().starts_with("https");
    let names: &[&str] = if https {
        &["ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"]
    } else {
        &["ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"]
    };
    names
        .iter()
        .filter_map(|n| std::env::var(n).ok())
        .find(|v| !v.is_empty())
        .map(|v| {
            if v.contains("://") {
                v
            } else {
                format!("http://{v}")
            }
        })
}

/// Checks that a TCP connection to `url`'s host (or its proxy) opens within `timeout`.
/// Returns a human-readable reason on failure.
pub(crate) fn probe(url: &str, timeout: Duration) -> std::result::Result<(), String> {
    let target = proxy_for(url).unwrap_or_else(|| url.to_string());
    let (host, port) = host_port(&target)?;
    let addrs: Vec<_> = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .collect();
    let mut last = format!("no address for {host}");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(_) => return Ok(()),
            Err(e) => last = format!("cannot connect to {host}:{port}: {e}"),
        }
    }
    Err(last)
}

/// An agent with connect/read timeouts, proxy from the environment and system root certificates.
pub(crate) fn agent(connect_timeout: Duration, read_timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(connect_timeout)
        .timeout_read(read_timeout)
        .try_proxy_from_env(true)
        .user_agent(concat!("tokenrouter-fetch/", env!("CARGO_PKG_VERSION")))
        .build()
}

fn http_error(url: &str, err: ureq::Error) -> FetchError {
    let reason = match err {
        ureq::Error::Status(code, resp) => format!("HTTP status {code} {}", resp.status_text()),
        ureq::Error::Transport(t) => t.to_string(),
    };
    FetchError::Http {
        url: url.to_string(),
        reason,
    }
}

/// GETs `url` and parses JSON; `Ok(None)` on 404.
pub(crate) fn get_json<T: serde::de::DeserializeOwned>(
    agent: &ureq::Agent,
    url: &str,
) -> Result<Option<T>> {
    let resp = match agent.get(url).set("Accept", "application/json").call() {
        Ok(r) => r,
        Err(ureq::Error::Status(404, _)) => return Ok(None),
        Err(e) => return Err(http_error(url, e)),
    };
    let mut body = String::new();
    resp.into_reader()
        .take(64 << 20)
        .read_to_string(&mut body)
        .map_err(|e| FetchError::Http {
            url: url.to_string(),
            reason: format!("reading body: {e}"),
        })?;
    serde_json::from_str(&body)
        .map(Some)
        .map_err(|e| FetchError::Http {
            url: url.to_string(),
            reason: format!("malformed JSON: {e}"),
        })
}

/// Streams the body of `url` into `out`, calling `on_bytes` after each chunk; returns the length.
pub(crate) fn download(
    agent: &ureq::Agent,
    url: &str,
    out: &mut dyn Write,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<u64> {
    let resp = agent.get(url).call().map_err(|e| http_error(url, e))?;
    let mut reader = resp.into_reader();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(FetchError::Http {
                    url: url.to_string(),
                    reason: format!("reading body after {total} bytes: {e}"),
                })
            }
        };
        out.write_all(&buf[..n])
            .map_err(|e| FetchError::io(format!("writing download of {url}"), e))?;
        total += n as u64;
        on_bytes(n as u64);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_host_and_port() {
        let ok = |u: &str, h: &str, p: u16| assert_eq!(host_port(u), Ok((h.to_string(), p)), "{u}");
        ok("https://huggingface.co", "huggingface.co", 443);
        ok("http://127.0.0.1:9/x/y", "127.0.0.1", 9);
        ok(
            "https://user:pw@mirror.local:8443/simple/",
            "mirror.local",
            8443,
        );
        ok("http://[::1]:8080/", "::1", 8080);
        assert!(host_port("ftp://x").is_err());
        assert!(host_port("no-scheme").is_err());
        assert!(host_port("http://:80").is_err());
    }

    #[test]
    fn probe_of_closed_port_fails_fast() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        drop(listener);
        let start = std::time::Instant::now();
        let err =
            probe(&format!("http://127.0.0.1:{port}"), Duration::from_secs(2)).expect_err("closed");
        assert!(err.contains("cannot connect"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(3));
    }
}
