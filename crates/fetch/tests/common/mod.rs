//! Test helpers shared by the integration tests: a tiny HTTP/1.1 server on a local port (so
//! download paths are exercised without the network), synthetic wheels and a closed port.

#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;

/// A local HTTP server answering GETs from a fixed route table; 404 otherwise.
pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    hits: Arc<Mutex<Vec<String>>>,
}

impl TestServer {
    /// Starts serving the routes that `make_routes` builds from the base URL.
    pub fn start(make_routes: impl FnOnce(&str) -> HashMap<String, Vec<u8>>) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind test server");
        let base = format!("http://{}", listener.local_addr().expect("local addr"));
        let routes = Arc::new(make_routes(&base));
        let hits = Arc::new(Mutex::new(Vec::new()));
        let hits_srv = Arc::clone(&hits);
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let routes = Arc::clone(&routes);
                let hits = Arc::clone(&hits_srv);
                thread::spawn(move || serve_one(stream, &routes, &hits));
            }
        });
        TestServer { base, hits }
    }

    /// Paths requested so far, in order.
    pub fn hits(&self) -> Vec<String> {
        self.hits.lock().expect("hits lock").clone()
    }
}

fn serve_one(stream: TcpStream, routes: &HashMap<String, Vec<u8>>, hits: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(&stream);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    loop {
        let mut header = String::new();
        match reader.read_line(&mut header) {
            Ok(0) | Err(_) => break,
            Ok(_) if header == "\r\n" || header == "\n" => break,
            Ok(_) => {}
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_string();
    hits.lock().expect("hits lock").push(path.clone());
    let mut out = &stream;
    let (status, body): (&str, &[u8]) = match routes.get(&path) {
        Some(body) => ("200 OK", body),
        None => ("404 Not Found", b""),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = out
        .write_all(head.as_bytes())
        .and_then(|_| out.write_all(body))
        .and_then(|_| out.flush());
}

/// A URL on a local port where nothing listens (connections are refused at once).
pub fn closed_port_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

/// A wheel (zip, deflated) shaped like the chunk packages: `<pkg>/data/<chunk_name>` plus the
/// usual `__init__.py` and `.dist-info` files.
pub fn make_wheel(underscored: &str, version: &str, chunk_name: &str, chunk: &[u8]) -> Vec<u8> {
    use zip::write::SimpleFileOptions;
    let opts = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
    let mut zw = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let files: [(String, &[u8]); 4] = [
        (format!("{underscored}/__init__.py"), b"# chunk package\n"),
        (format!("{underscored}/data/{chunk_name}"), chunk),
        (
            format!("{underscored}-{version}.dist-info/METADATA"),
            b"Metadata-Version: 2.1\n",
        ),
        (format!("{underscored}-{version}.dist-info/RECORD"), b""),
    ];
    for (name, bytes) in files {
        zw.start_file(name, opts).expect("zip entry");
        zw.write_all(bytes).expect("zip write");
    }
    zw.finish().expect("zip finish").into_inner()
}

/// Lower-case hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Deterministic pseudo-random bytes (xorshift), so chunks compress like real weights.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
