//! Loading weights without holding them twice, so a model's peak memory is its running size.
//!
//! - candle's `Content::tensor` reads a tensor into a byte buffer and then copies it into a
//!   vector of blocks, so loading the largest tensor (the 151936-row token embedding of the
//!   Qwen2.5 models, 145-191 MB) briefly held it twice: the load, not the running model, set
//!   the process's peak memory. [`read_cpu_qtensor`] allocates the blocks once and reads the
//!   file straight into them.
//! - Repacking and stacking weights frees the buffers they were made from. glibc's malloc
//!   serves buffers of a few MB from its heap once a larger one has been freed, and keeps the
//!   freed ones' pages, so a load that stacks q/k/v and gate/up ended 300 MB above its weights
//!   (1.5B). [`return_freed_pages`] hands them back after each layer.

use candle_core::quantized::k_quants::{self, GgmlType};
use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::Device;
use std::io::{Read, Seek, SeekFrom};

/// The tensor `name` of `content` from `file`: straight into its blocks on the CPU,
/// through candle's reader on other devices and for block types read here has no case for.
pub fn read_tensor(
    content: &gguf_file::Content,
    file: &mut std::fs::File,
    name: &str,
    device: &Device,
) -> candle_core::Result<QTensor> {
    if device.is_cpu() {
        if let Some(t) = read_cpu_qtensor(content, file, name)? {
            return Ok(t);
        }
    }
    content.tensor(file, name, device)
}

/// The tensor `name` of `content` from `file`, on the CPU. `Ok(None)` for a block type read
/// here has no case for.
fn read_cpu_qtensor<R: Read + Seek>(
    content: &gguf_file::Content,
    file: &mut R,
    name: &str,
) -> candle_core::Result<Option<QTensor>> {
    let Some(info) = content.tensor_infos.get(name) else {
        candle_core::bail!("no tensor named {name} in the GGUF file");
    };
    let dims = info.shape.dims().to_vec();
    let elems: usize = dims.iter().product();
    let block = info.ggml_dtype.block_size();
    if !elems.is_multiple_of(block) {
        candle_core::bail!("{elems} values are not a whole number of {block}-value blocks");
    }
    let blocks = elems / block;
    let start = content.tensor_data_offset.saturating_add(info.offset);
    let file_size = file.seek(SeekFrom::End(0))?;
    let bytes = (blocks * info.ggml_dtype.type_size()) as u64;
    if start.saturating_add(bytes) > file_size {
        candle_core::bail!(
            "tensor needs {bytes} bytes at offset {start}, the file has {file_size} in all"
        );
    }
    file.seek(SeekFrom::Start(start))?;
    let storage = match info.ggml_dtype {
        GgmlDType::F32 => read_blocks::<f32, _>(file, blocks)?,
        GgmlDType::F16 => read_blocks::<half::f16, _>(file, blocks)?,
        GgmlDType::BF16 => read_blocks::<half::bf16, _>(file, blocks)?,
        GgmlDType::Q4_0 => read_blocks::<k_quants::BlockQ4_0, _>(file, blocks)?,
        GgmlDType::Q4_1 => read_blocks::<k_quants::BlockQ4_1, _>(file, blocks)?,
        GgmlDType::Q5_0 => read_blocks::<k_quants::BlockQ5_0, _>(file, blocks)?,
        GgmlDType::Q5_1 => read_blocks::<k_quants::BlockQ5_1, _>(file, blocks)?,
        GgmlDType::Q8_0 => read_blocks::<k_quants::BlockQ8_0, _>(file, blocks)?,
        GgmlDType::Q2K => read_blocks::<k_quants::BlockQ2K, _>(file, blocks)?,
        GgmlDType::Q3K => read_blocks::<k_quants::BlockQ3K, _>(file, blocks)?,
        GgmlDType::Q4K => read_blocks::<k_quants::BlockQ4K, _>(file, blocks)?,
        GgmlDType::Q5K => read_blocks::<k_quants::BlockQ5K, _>(file, blocks)?,
        GgmlDType::Q6K => read_blocks::<k_quants::BlockQ6K, _>(file, blocks)?,
        _ => return Ok(None),
    };
    Ok(Some(QTensor::new(storage, dims)?))
}

/// `blocks` blocks of `T` read from the file's current position.
fn read_blocks<T: GgmlType + Send + Sync + 'static, R: Read>(
    file: &mut R,
    blocks: usize,
) -> candle_core::Result<QStorage> {
    let mut data = vec![T::zeros(); blocks];
    let len = std::mem::size_of_val(data.as_slice());
    // SAFETY: ggml's block types are plain `repr(C)` structs of integers and f16 values with
    // no padding (candle's reader casts file bytes to them the same way), so every byte
    // pattern is a valid value; the slice covers exactly the vector's initialised elements.
    let bytes = unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), len) };
    file.read_exact(bytes)?;
    Ok(QStorage::Cpu(Box::new(data)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    /// Every block type our models use reads back as candle's own reader reads it.
    #[test]
    fn reads_what_candles_reader_reads() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let types = [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::Q4_0,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ];
        let mut tensors = Vec::new();
        for (i, t) in types.iter().enumerate() {
            let x = Tensor::randn(0f32, 1.0, (3 + i, 512), &dev)?;
            tensors.push((format!("t{i}"), QTensor::quantize(&x, *t)?));
        }
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
        let mut buf = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut buf, &[], &refs)?;
        buf.set_position(0);
        let content = gguf_file::Content::read(&mut buf)?;
        for (name, _) in &tensors {
            let ours = read_cpu_qtensor(&content, &mut buf, name)?.expect("a supported type");
            let theirs = content.tensor(&mut buf, name, &dev)?;
            assert_eq!(ours.dtype(), theirs.dtype(), "{name}");
            assert_eq!(ours.shape(), theirs.shape(), "{name}");
            assert_eq!(ours.data()?, theirs.data()?, "{name}");
        }
        assert!(read_cpu_qtensor(&content, &mut buf, "missing").is_err());
        Ok(())
    }
}
