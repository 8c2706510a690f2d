//! Launcher of the row sampler (kernels/sample.cuh): one token per row drawn on the GPU, so
//! a sampled step copies two numbers per row to the host instead of its logits. The
//! reference it follows is `sampling::race`.

use super::kernels::{cuda_only_op1, err, launch, ptr, slice_ptr};
use crate::error::{Result, RuntimeError};
use crate::sampling::race::DrawRow;
use crate::sampling::{RowDraw, Sampled};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Device, Layout, Shape, Tensor};

/// Threads per row (one block each).
const THREADS: u32 = 1024;
/// Largest top-k the kernel counts exactly (counts are f32 sums).
const TOP_K_MAX: u32 = 1 << 24;
use crate::sampling::race::TOP_MAX;

/// Each row's token, raw log-probability and top alternatives: `logits` contiguous f32
/// `[rows, limit]`, `allowed` u8 flags of the same shape (1 = may be picked).
pub(crate) fn sample_rows(
    logits: &Tensor,
    rows: &[DrawRow],
    allowed: Option<&Tensor>,
) -> Result<Vec<Sampled>> {
    let (n, limit) = logits.dims2()?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let top_n = rows.iter().map(|r| r.top).max().unwrap_or(0);
    if top_n > TOP_MAX {
        return Err(RuntimeError::InvalidStep(format!(
            "{top_n} top alternatives on the device (at most {TOP_MAX})"
        )));
    }
    let dev = logits.device();
    let Device::Cuda(cuda) = dev else {
        return Err(RuntimeError::InvalidStep(
            "device sampling off a GPU".into(),
        ));
    };
    let params: Vec<f32> = rows
        .iter()
        .flat_map(|r| {
            let d = &r.draw;
            [
                d.temperature,
                d.top_p,
                d.min_p,
                d.top_k.min(TOP_K_MAX) as f32,
            ]
        })
        .collect();
    let keys: Vec<u32> = rows
        .iter()
        .flat_map(|r| [r.draw.key as u32, (r.draw.key >> 32) as u32])
        .collect();
    let params = Tensor::from_vec(params, (n, 4), dev)?;
    let keys = Tensor::from_vec(keys, (n, 2), dev)?;
    let allowed = allowed
        .map(|a| a.to_dtype(DType::U8)?.contiguous())
        .transpose()?;
    // Penalties and bias: the chosen-from logits are a copy with the rows' entries applied.
    let entries: Vec<f32> = rows
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.adjust
                .iter()
                .filter(|a| (a.id as usize) < limit)
                .flat_map(move |a| [i as f32, a.id as f32, a.sub, a.rep, a.bias])
        })
        .collect();
    let adjusted = if entries.is_empty() {
        None
    } else {
        let count = entries.len() / 5;
        let copy = logits.copy()?;
        let entries = Tensor::from_vec(entries, (count, 5), dev)?;
        let (copy_p, entries_p) = (ptr(Some(&copy))?, ptr(Some(&entries))?);
        let cfg = LaunchConfig {
            grid_dim: ((count as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (limit_i, count_i) = (limit as i32, count as i32);
        launch!(
            cuda,
            "adjust_logits_f32",
            cfg,
            &copy_p,
            &limit_i,
            &entries_p,
            &count_i
        );
        // `entries` must outlive the kernel: the copy below waits for the stream.
        Some((copy, entries))
    };
    let op = SampleRows {
        selected: ptr(adjusted.as_ref().map(|(copy, _)| copy))?,
        allowed: ptr(allowed.as_ref())?,
        params: ptr(Some(&params))?,
        keys: ptr(Some(&keys))?,
        top_n,
    };
    // `params`, `keys`, `allowed` and `adjusted` live until the copy below has waited for
    // the kernels.
    let picks = logits.apply_op1_no_bwd(&op)?.to_vec2::<f32>()?;
    drop(adjusted);
    Ok(picks
        .iter()
        .zip(rows)
        .map(|(p, row)| {
            let logprob = p[1];
            let top = if logprob.is_nan() {
                Vec::new()
            } else {
                p[2..]
                    .chunks_exact(2)
                    .take(row.top)
                    .map(|e| (e[0].to_bits(), e[1]))
                    .filter(|&(_, lp)| lp > f32::NEG_INFINITY)
                    .collect()
            };
            Sampled {
                token: p[0].to_bits(),
                logprob,
                top,
            }
        })
        .collect())
}

/// The kernel's inputs besides the raw logits, as device addresses (0: none).
struct SampleRows {
    selected: u64,
    allowed: u64,
    params: u64,
    keys: u64,
    top_n: usize,
}

cuda_only_op1!(SampleRows, "sample_rows");

impl SampleRows {
    /// Input: logits `[rows, limit]` f32; output `[rows, 2 + 2 top_n]` f32.
    fn cuda(&self, l: &CudaStorage, layout: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, limit) = layout.shape().dims2()?;
        if !layout.is_contiguous() || l.dtype() != DType::F32 {
            return Err(err("the sampler's logits must be contiguous f32"));
        }
        let l_p = slice_ptr(l, layout)?;
        let dev = &l.device;
        let width = 2 + 2 * self.top_n;
        // SAFETY: the kernel writes every number of every row.
        let out = unsafe { dev.alloc::<f32>(rows * width) }?;
        let out_p = out.device_ptr(&dev.cuda_stream()).0;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (limit_i, top_i) = (limit as i32, self.top_n as i32);
        launch!(
            dev,
            "sample_rows_f32",
            cfg,
            &l_p,
            &self.selected,
            &limit_i,
            &self.allowed,
            &self.params,
            &self.keys,
            &top_i,
            &out_p
        );
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, width)),
        ))
    }
}

/// One kind of draw checked by [`check_sample_rows`].
#[derive(Debug)]
pub struct SampleCheck {
    pub what: &'static str,
    pub rows: usize,
    /// Rows whose kernel pick (or top alternatives' ids) differ from
    /// `sampling::race::pick_row`'s on the host.
    pub wrong_picks: usize,
    /// Largest |kernel log-prob - reference log-prob| (the token's and the alternatives').
    pub max_logprob_err: f32,
    /// Milliseconds a step of `rows` takes: the kernel (with its uploads and the few
    /// numbers a row back), and for comparison the host path (all logits copied, each row
    /// sampled by `Sampler`).
    pub device_ms: f64,
    pub host_ms: f64,
}

/// A kind of draw: name, draw, masked (every third id), penalised, top alternatives.
type Kind = (&'static str, RowDraw, bool, bool, usize);

/// The kernels against their reference (`sampling::race::pick_row` on the host) on random
/// logits of a Qwen row (151,936 wide, 151,665 sampled), for each kind of draw at 1, 8 and
/// 64 rows, with the time a step spends drawing on the device against the host path's.
pub fn check_sample_rows(device: &Device) -> Result<Vec<SampleCheck>> {
    use crate::runner::StepOutput;
    use crate::sampling::race::{self, Adjust};
    use crate::sampling::{Sampler, SamplingParams};
    use rand::{Rng, SeedableRng};
    let (vocab, limit) = (151_936usize, 151_665usize);
    let draw = RowDraw::sampled;
    let kinds: [Kind; 10] = [
        ("greedy", RowDraw::GREEDY, false, false, 0),
        ("T=1", draw(1.0, 0, 1.0, 0.0), false, false, 0),
        ("T=0.7 top_p=0.9", draw(0.7, 0, 0.9, 0.0), false, false, 0),
        ("T=0.8 top_k=50", draw(0.8, 50, 1.0, 0.0), false, false, 0),
        ("T=1 top_k=1", draw(1.0, 1, 1.0, 0.0), false, false, 0),
        ("T=1 min_p=0.1", draw(1.0, 0, 1.0, 0.1), false, false, 0),
        (
            "T=0.6 top_k=40 top_p=0.95",
            draw(0.6, 40, 0.95, 0.0),
            false,
            false,
            0,
        ),
        (
            "masked T=0.7 top_p=0.95",
            draw(0.7, 0, 0.95, 0.0),
            true,
            false,
            0,
        ),
        (
            "penalised T=0.8 top_p=0.95",
            draw(0.8, 0, 0.95, 0.0),
            false,
            true,
            0,
        ),
        (
            "T=0.8 top_logprobs=5",
            draw(0.8, 0, 1.0, 0.0),
            false,
            false,
            5,
        ),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut out = Vec::new();
    for rows in [1usize, 8, 64] {
        // Peaked rows (a few ids well ahead, as a trained model's) and flat ones.
        let noise = Tensor::randn(0f32, 3.0, (rows, vocab), device)?;
        let spikes: Vec<f32> = (0..rows * vocab)
            .map(|i| {
                if i % vocab < 8 && (i / vocab) % 2 == 0 {
                    12.0
                } else {
                    0.0
                }
            })
            .collect();
        let logits = (noise + Tensor::from_vec(spikes, (rows, vocab), device)?)?;
        let host_logits = logits.to_vec2::<f32>()?;
        let step = StepOutput {
            logits,
            hidden: None,
        };
        // Every third id allowed, as the engine uploads masks.
        let flags: Vec<u8> = (0..rows * limit)
            .map(|i| u8::from(i % limit % 3 == 0))
            .collect();
        let mask = Tensor::from_vec(flags.clone(), (rows, limit), device)?;
        for &(what, kind, masked, penalised, top) in &kinds {
            let draws: Vec<DrawRow> = (0..rows)
                .map(|_| DrawRow {
                    draw: RowDraw {
                        key: rng.random(),
                        ..kind
                    },
                    // A repetition penalty on 300 ids (the spikes among them), a presence
                    // penalty on 50, a bias on 5.
                    adjust: if penalised {
                        (0..300u32)
                            .map(|i| Adjust {
                                id: i * 7,
                                sub: if i < 50 { 0.5 } else { 0.0 },
                                rep: 1.3,
                                bias: if i % 60 == 0 { 4.0 } else { 0.0 },
                            })
                            .collect()
                    } else {
                        Vec::new()
                    },
                    top,
                })
                .collect();
            let allowed = masked.then_some(&mask);
            let got = step.sample_rows(limit, &draws, allowed)?;
            let (mut wrong, mut worst) = (0usize, 0f32);
            for (r, ((row, d), s)) in host_logits.iter().zip(&draws).zip(&got).enumerate() {
                let flags_r = masked.then(|| &flags[r * limit..(r + 1) * limit]);
                let want = race::pick_row(&row[..limit], d, flags_r);
                let ids = |s: &Sampled| s.top.iter().map(|t| t.0).collect::<Vec<_>>();
                wrong += usize::from(s.token != want.token || ids(s) != ids(&want));
                worst = worst.max((s.logprob - want.logprob).abs());
                for (a, b) in s.top.iter().zip(&want.top) {
                    worst = worst.max((a.1 - b.1).abs());
                }
            }
            let reps = 20;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                step.sample_rows(limit, &draws, allowed)?;
            }
            let device_ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
            let params = SamplingParams {
                temperature: kind.temperature,
                top_k: kind.top_k as usize,
                top_p: kind.top_p,
                min_p: kind.min_p,
                ..Default::default()
            };
            let mut samplers: Vec<Sampler> = (0..rows)
                .map(|r| Sampler::new(params.clone(), r as u64, &[]))
                .collect();
            let t0 = std::time::Instant::now();
            for _ in 0..3 {
                let rows_now = step.logits_rows()?;
                for (s, row) in samplers.iter_mut().zip(&rows_now) {
                    s.sample(row, limit, top);
                }
            }
            let host_ms = t0.elapsed().as_secs_f64() * 1e3 / 3.0;
            out.push(SampleCheck {
                what,
                rows,
                wrong_picks: wrong,
                max_logprob_err: worst,
                device_ms,
                host_ms,
            });
        }
    }
    Ok(out)
}
