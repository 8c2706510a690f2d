//! Reads the non-tensor part of a `torch.save` checkpoint (a zip holding a protocol-2
//! pickle), so learned routers can take their configuration (R2R's `common_args.threshold`,
//! `init_args`, `model_type`) from the official file instead of a hand-written copy.
//! Tensors themselves are read by candle's PyTorch reader; this module only finds
//! `*/data.pkl` in the zip (torch stores entries uncompressed) and turns the unpickled
//! objects into JSON. Objects JSON cannot express (classes such as `torch.float32`,
//! tensors) become strings or null, so exotic `init_args` never break loading.

use candle_core::pickle::{Object, Stack};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const LOCAL_SIG: u32 = 0x0403_4b50;

fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
    b.get(at..at + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .ok_or_else(|| "truncated zip record".to_string())
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or_else(|| "truncated zip record".to_string())
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, String> {
    let lo = u64::from(u32_at(b, at)?);
    let hi = u64::from(u32_at(b, at + 4)?);
    Ok(lo | (hi << 32))
}

fn read_exact_at(f: &mut std::fs::File, offset: u64, len: usize) -> Result<Vec<u8>, String> {
    f.seek(SeekFrom::Start(offset)).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; len];
    f.read_exact(&mut buf).map_err(|e| e.to_string())?;
    Ok(buf)
}

/// The bytes of the first zip entry whose name ends with `suffix` (stored entries only).
pub fn read_zip_entry(path: &Path, suffix: &str) -> Result<Vec<u8>, String> {
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    // The end-of-central-directory record is within the last 64 KiB + 22 bytes.
    let tail_len = len.min(65_557);
    let tail = read_exact_at(&mut f, len - tail_len, tail_len as usize)?;
    let eocd = (0..tail.len().saturating_sub(21))
        .rev()
        .find(|&i| u32_at(&tail, i) == Ok(EOCD_SIG))
        .ok_or("not a zip file (no end-of-central-directory record)")?;
    let mut cd_size = u64::from(u32_at(&tail, eocd + 12)?);
    let mut cd_offset = u64::from(u32_at(&tail, eocd + 16)?);
    if (cd_offset == 0xFFFF_FFFF || cd_size == 0xFFFF_FFFF) && eocd >= 20 {
        let loc = eocd - 20;
        if u32_at(&tail, loc)? == ZIP64_LOCATOR_SIG {
            let rec_off = u64_at(&tail, loc + 8)?;
            let rec = read_exact_at(&mut f, rec_off, 56)?;
            if u32_at(&rec, 0)? != ZIP64_EOCD_SIG {
                return Err("bad zip64 end-of-central-directory record".into());
            }
            cd_size = u64_at(&rec, 40)?;
            cd_offset = u64_at(&rec, 48)?;
        }
    }
    if cd_offset.checked_add(cd_size).is_none_or(|end| end > len) {
        return Err("central directory lies outside the file".into());
    }
    let cd = read_exact_at(&mut f, cd_offset, cd_size as usize)?;
    let mut at = 0usize;
    while at + 46 <= cd.len() && u32_at(&cd, at)? == CENTRAL_SIG {
        let method = u16_at(&cd, at + 10)?;
        let mut size = u64::from(u32_at(&cd, at + 20)?);
        let name_len = usize::from(u16_at(&cd, at + 28)?);
        let extra_len = usize::from(u16_at(&cd, at + 30)?);
        let comment_len = usize::from(u16_at(&cd, at + 32)?);
        let mut local = u64::from(u32_at(&cd, at + 42)?);
        let name = cd
            .get(at + 46..at + 46 + name_len)
            .ok_or("truncated zip entry name")?;
        if String::from_utf8_lossy(name).ends_with(suffix) {
            let extra = cd
                .get(at + 46 + name_len..at + 46 + name_len + extra_len)
                .ok_or("truncated zip extra field")?;
            zip64_fix(extra, &mut size, &mut local, u32_at(&cd, at + 24)?)?;
            if method != 0 {
                return Err(format!(
                    "entry ending in {suffix} is compressed (method {method})"
                ));
            }
            let head = read_exact_at(&mut f, local, 30)?;
            if u32_at(&head, 0)? != LOCAL_SIG {
                return Err("bad local zip header".into());
            }
            let skip = 30 + u64::from(u16_at(&head, 26)?) + u64::from(u16_at(&head, 28)?);
            if local + skip + size > len {
                return Err("zip entry lies outside the file".into());
            }
            return read_exact_at(&mut f, local + skip, size as usize);
        }
        at += 46 + name_len + extra_len + comment_len;
    }
    Err(format!("no entry ending in {suffix}"))
}

/// Apply a zip64 extended-information extra field (id 1) to 0xFFFFFFFF sizes/offsets.
fn zip64_fix(extra: &[u8], size: &mut u64, local: &mut u64, usize32: u32) -> Result<(), String> {
    let mut at = 0;
    while at + 4 <= extra.len() {
        let id = u16_at(extra, at)?;
        let n = usize::from(u16_at(extra, at + 2)?);
        if id == 1 {
            let mut p = at + 4;
            if usize32 == 0xFFFF_FFFF {
                p += 8;
            }
            if *size == 0xFFFF_FFFF {
                *size = u64_at(extra, p)?;
                p += 8;
            }
            if *local == 0xFFFF_FFFF {
                *local = u64_at(extra, p)?;
            }
            return Ok(());
        }
        at += 4 + n;
    }
    Ok(())
}

/// JSON view of an unpickled object: containers and scalars map over; a class reference
/// (`torch.float32`) becomes "module.name"; anything else (tensors, reduce calls) is null.
pub fn to_json(obj: &Object) -> serde_json::Value {
    use serde_json::Value;
    match obj {
        Object::Int(i) => Value::from(*i),
        Object::Long(i) => Value::from(*i),
        Object::Float(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
        Object::Unicode(s) => Value::from(s.clone()),
        Object::Bool(b) => Value::from(*b),
        Object::None => Value::Null,
        Object::Tuple(v) | Object::List(v) => Value::Array(v.iter().map(to_json).collect()),
        Object::Dict(kv) => Value::Object(
            kv.iter()
                .filter_map(|(k, v)| match k {
                    Object::Unicode(k) => Some((k.clone(), to_json(v))),
                    _ => None,
                })
                .collect(),
        ),
        Object::Class {
            module_name,
            class_name,
        } => Value::from(format!("{module_name}.{class_name}")),
        _ => Value::Null,
    }
}

/// The top-level dict of a `torch.save` file as JSON, without `state_dict` (tensors), and
/// whether a `state_dict` entry exists (else the file is a bare state dict).
pub fn read_checkpoint_meta(path: &Path) -> Result<(serde_json::Value, bool), String> {
    let pkl = read_zip_entry(path, "data.pkl")?;
    let mut stack = Stack::empty();
    stack
        .read_loop(&mut std::io::Cursor::new(pkl))
        .map_err(|e| format!("cannot unpickle data.pkl: {e}"))?;
    let obj = stack
        .finalize()
        .map_err(|e| format!("cannot unpickle data.pkl: {e}"))?;
    match obj {
        Object::Dict(kv) => {
            let has_state_dict = kv
                .iter()
                .any(|(k, _)| matches!(k, Object::Unicode(k) if k == "state_dict"));
            let meta = kv
                .iter()
                .filter_map(|(k, v)| match k {
                    Object::Unicode(k) if k != "state_dict" => Some((k.clone(), to_json(v))),
                    _ => None,
                })
                .collect();
            Ok((serde_json::Value::Object(meta), has_state_dict))
        }
        _ => Ok((serde_json::Value::Null, false)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A stored (uncompressed) single-entry zip, written by hand.
    fn stored_zip(name: &str, data: &[u8]) -> Vec<u8> {
        let mut z = Vec::new();
        let crc = 0u32; // not checked by the reader
        z.extend_from_slice(&LOCAL_SIG.to_le_bytes());
        z.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        z.extend_from_slice(&crc.to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(name.len() as u16).to_le_bytes());
        z.extend_from_slice(&0u16.to_le_bytes());
        z.extend_from_slice(name.as_bytes());
        z.extend_from_slice(data);
        let cd_off = z.len() as u32;
        z.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
        z.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        z.extend_from_slice(&crc.to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(data.len() as u32).to_le_bytes());
        z.extend_from_slice(&(name.len() as u16).to_le_bytes());
        z.extend_from_slice(&[0; 12]);
        z.extend_from_slice(&0u32.to_le_bytes());
        z.extend_from_slice(name.as_bytes());
        let cd_size = z.len() as u32 - cd_off;
        z.extend_from_slice(&EOCD_SIG.to_le_bytes());
        z.extend_from_slice(&[0, 0, 0, 0, 1, 0, 1, 0]);
        z.extend_from_slice(&cd_size.to_le_bytes());
        z.extend_from_slice(&cd_off.to_le_bytes());
        z.extend_from_slice(&0u16.to_le_bytes());
        z
    }

    #[test]
    fn reads_meta_and_keeps_dtype_objects_as_strings() {
        // {'model_type': 'X', 'init_args': {'dtype': torch.float32, 'k': 8},
        //  'common_args': {'threshold': 0.25}} as protocol-2 pickle opcodes.
        let mut p = vec![0x80, 2, b'}', b'('];
        let uni = |p: &mut Vec<u8>, s: &str| {
            p.push(b'X');
            p.extend_from_slice(&(s.len() as u32).to_le_bytes());
            p.extend_from_slice(s.as_bytes());
        };
        uni(&mut p, "model_type");
        uni(&mut p, "X");
        uni(&mut p, "init_args");
        p.extend_from_slice(b"}(");
        uni(&mut p, "dtype");
        p.extend_from_slice(b"ctorch\nfloat32\n");
        uni(&mut p, "k");
        p.extend_from_slice(&[b'K', 8, b'u']);
        uni(&mut p, "common_args");
        p.extend_from_slice(b"}(");
        uni(&mut p, "threshold");
        p.push(b'G');
        p.extend_from_slice(&0.25f64.to_be_bytes());
        p.extend_from_slice(b"uu.");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("r.pt");
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&stored_zip("r/data.pkl", &p)).expect("write");
        drop(f);
        let (meta, has_state_dict) = read_checkpoint_meta(&path).expect("meta");
        assert!(!has_state_dict);
        assert_eq!(meta["model_type"], "X");
        assert_eq!(meta["init_args"]["dtype"], "torch.float32");
        assert_eq!(meta["init_args"]["k"], 8);
        assert_eq!(meta["common_args"]["threshold"], 0.25);
        assert!(read_zip_entry(&path, "missing.bin").is_err());
        std::fs::write(&path, b"not a zip at all, just text").expect("write");
        assert!(read_checkpoint_meta(&path).is_err());
    }
}
