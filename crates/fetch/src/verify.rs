//! Integrity checks: SHA-256 while writing or of a whole file, and `.sha256-ok` marker files
//! recording that a cached file was verified, so later starts skip re-hashing gigabytes.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use crate::error::{FetchError, Result};

/// Lower-case hex of a digest.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A writer that hashes and counts everything passing through it.
pub(crate) struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    len: u64,
}

impl<W: Write> HashingWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            len: 0,
        }
    }

    /// Bytes written so far.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The inner writer, the hex digest and the length.
    pub(crate) fn finish(self) -> (W, String, u64) {
        (self.inner, hex(&self.hasher.finalize()), self.len)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// SHA-256 (hex) and length of a file.
pub(crate) fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut file = fs::File::open(path)
        .map_err(|e| FetchError::io(format!("opening {}", path.display()), e))?;
    let mut writer = HashingWriter::new(std::io::sink());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| FetchError::io(format!("reading {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        writer
            .write_all(&buf[..n])
            .map_err(|e| FetchError::io("hashing", e))?;
    }
    let (_, digest, len) = writer.finish();
    Ok((digest, len))
}

/// Path of the marker recording that `file` was verified.
pub(crate) fn marker_path(file: &Path) -> PathBuf {
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(".sha256-ok");
    file.with_file_name(name)
}

/// `size mtime` fingerprint of a file; `None` if it does not exist.
fn fingerprint(file: &Path) -> Option<String> {
    let meta = fs::metadata(file).ok()?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    Some(format!("{} {mtime}", meta.len()))
}

/// True if `file` has `size` bytes and a marker says it hashed to `sha256` while it had the
/// current size and modification time.
pub(crate) fn is_marked_verified(file: &Path, size: u64, sha256: &str) -> bool {
    let Some(fp) = fingerprint(file) else {
        return false;
    };
    if !fp.starts_with(&format!("{size} ")) {
        return false;
    }
    match fs::read_to_string(marker_path(file)) {
        Ok(text) => text.trim() == format!("{} {fp}", sha256.to_ascii_lowercase()),
        Err(_) => false,
    }
}

/// Records that `file` hashed to `sha256` (atomically: temp file + rename).
pub(crate) fn write_marker(file: &Path, sha256: &str) -> Result<()> {
    let fp = fingerprint(file).ok_or_else(|| {
        FetchError::io(
            format!("reading {}", file.display()),
            std::io::Error::from(std::io::ErrorKind::NotFound),
        )
    })?;
    let marker = marker_path(file);
    let dir = marker.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".marker-")
        .tempfile_in(dir)
        .map_err(|e| FetchError::io(format!("creating marker in {}", dir.display()), e))?;
    writeln!(tmp, "{} {fp}", sha256.to_ascii_lowercase())
        .map_err(|e| FetchError::io(format!("writing {}", marker.display()), e))?;
    make_world_readable(tmp.path())?;
    tmp.persist(&marker)
        .map_err(|e| FetchError::io(format!("writing {}", marker.display()), e.error))?;
    Ok(())
}

/// Gives a freshly created cache file (temp files are 0600) the usual `rw-r--r--` mode, so
/// other users and tools can read the models.
pub(crate) fn make_world_readable(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(0o644))
            .map_err(|e| FetchError::io(format!("setting permissions of {}", path.display()), e))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Removes a marker if present.
pub(crate) fn remove_marker(file: &Path) -> Result<()> {
    let marker = marker_path(file);
    match fs::remove_file(&marker) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(FetchError::io(format!("removing {}", marker.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ABC_SHA: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn hashes_known_vector() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("abc");
        fs::write(&f, b"abc").expect("write");
        assert_eq!(sha256_file(&f).expect("hash"), (ABC_SHA.to_string(), 3));
        let mut w = HashingWriter::new(Vec::new());
        w.write_all(b"ab").expect("write");
        w.write_all(b"c").expect("write");
        assert_eq!(w.len(), 3);
        let (inner, digest, len) = w.finish();
        assert_eq!(
            (inner.as_slice(), digest.as_str(), len),
            (&b"abc"[..], ABC_SHA, 3)
        );
    }

    #[test]
    fn marker_is_tied_to_size_hash_and_mtime() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("m.gguf");
        fs::write(&f, b"abc").expect("write");
        assert!(!is_marked_verified(&f, 3, ABC_SHA));
        write_marker(&f, ABC_SHA).expect("marker");
        assert!(is_marked_verified(&f, 3, ABC_SHA));
        assert!(!is_marked_verified(&f, 4, ABC_SHA));
        assert!(!is_marked_verified(&f, 3, &"0".repeat(64)));
        // Same size, new content and mtime: the marker no longer applies.
        let old = fs::metadata(&f).and_then(|m| m.modified()).expect("mtime");
        fs::write(&f, b"xyz").expect("rewrite");
        let later = old + std::time::Duration::from_secs(5);
        fs::File::options()
            .write(true)
            .open(&f)
            .and_then(|h| h.set_modified(later))
            .expect("set mtime");
        assert!(!is_marked_verified(&f, 3, ABC_SHA));
        remove_marker(&f).expect("remove");
        assert!(!marker_path(&f).exists());
        remove_marker(&f).expect("remove twice is fine");
    }
}
