//! Launcher of the row sampler (kernels/sample.cuh): one token per row drawn on the GPU, so
//! a sampled step copies two numbers per row to the host instead of its logits. The
//! reference it follows is `sampling::race`.

use super::kernels::{cuda_only_op1, err, launch, ptr, slice_ptr};
use crate::error::Result;
use crate::sampling::RowDraw;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Layout, Shape, Tensor};

/// Threads per row (one block each).
const THREADS: u32 = 1024;
/// Largest top-k the kernel counts exactly (counts are f32 sums).
const TOP_K_MAX: u32 = 1 << 24;

/// Each row's `(token, raw log-probability)`: `logits` contiguous f32 `[rows, limit]`,
/// `allowed` u8 flags of the same shape (1 = may be picked).
pub(crate) fn sample_rows(
    logits: &Tensor,
    draws: &[RowDraw],
    allowed: Option<&Tensor>,
) -> Result<Vec<(u32, f32)>> {
    let (rows, _) = logits.dims2()?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let dev = logits.device();
    let params: Vec<f32> = draws
        .iter()
        .flat_map(|d| {
            [
                d.temperature,
                d.top_p,
                d.min_p,
                d.top_k.min(TOP_K_MAX) as f32,
            ]
        })
        .collect();
    let keys: Vec<u32> = draws
        .iter()
        .flat_map(|d| [d.key as u32, (d.key >> 32) as u32])
        .collect();
    let params = Tensor::from_vec(params, (rows, 4), dev)?;
    let keys = Tensor::from_vec(keys, (rows, 2), dev)?;
    let allowed = allowed
        .map(|a| a.to_dtype(DType::U8)?.contiguous())
        .transpose()?;
    let op = SampleRows {
        allowed: ptr(allowed.as_ref())?,
        params: ptr(Some(&params))?,
        keys: ptr(Some(&keys))?,
    };
    // `params`, `keys` and `allowed` live until the copy below has waited for the kernel.
    let picks = logits.apply_op1_no_bwd(&op)?.to_vec2::<f32>()?;
    Ok(picks.iter().map(|p| (p[0].to_bits(), p[1])).collect())
}

/// The kernel's inputs besides the logits, as device addresses (0: no mask).
struct SampleRows {
    allowed: u64,
    params: u64,
    keys: u64,
}

cuda_only_op1!(SampleRows, "sample_rows");

impl SampleRows {
    /// Input: logits `[rows, limit]` f32; output `[rows, 2]` f32 (token bits, logprob).
    fn cuda(&self, l: &CudaStorage, layout: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, limit) = layout.shape().dims2()?;
        if !layout.is_contiguous() || l.dtype() != DType::F32 {
            return Err(err("the sampler's logits must be contiguous f32"));
        }
        let l_p = slice_ptr(l, layout)?;
        let dev = &l.device;
        // SAFETY: the kernel writes both numbers of every row.
        let out = unsafe { dev.alloc::<f32>(rows * 2) }?;
        let out_p = out.device_ptr(&dev.cuda_stream()).0;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let limit_i = limit as i32;
        launch!(
            dev,
            "sample_rows_f32",
            cfg,
            &l_p,
            &limit_i,
            &self.allowed,
            &self.params,
            &self.keys,
            &out_p
        );
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, 2)),
        ))
    }
}

/// One kind of draw checked by [`check_sample_rows`].
#[derive(Debug)]
pub struct SampleCheck {
    pub what: &'static str,
    pub rows: usize,
    /// Rows whose kernel pick differs from `sampling::race::pick`'s on the host.
    pub wrong_picks: usize,
    /// Largest |kernel log-prob - reference log-prob|.
    pub max_logprob_err: f32,
    /// Milliseconds a step of `rows` takes: the kernel (with its uploads and the two numbers
    /// a row back), and for comparison the host path (all logits copied, each row sampled
    /// by `Sampler`).
    pub device_ms: f64,
    pub host_ms: f64,
}

/// The kernel against its reference (`sampling::race::pick` on the host) on random logits
/// of a Qwen row (151,936 wide, 151,665 sampled), for each kind of draw at 1, 8 and 64 rows,
/// with the time a step spends drawing on the device against the host path's.
pub fn check_sample_rows(device: &candle_core::Device) -> Result<Vec<SampleCheck>> {
    use crate::runner::StepOutput;
    use crate::sampling::race;
    use crate::sampling::{Sampler, SamplingParams};
    use rand::{Rng, SeedableRng};
    let (vocab, limit) = (151_936usize, 151_665usize);
    let kinds: [(&str, RowDraw, bool); 8] = [
        ("greedy", RowDraw::GREEDY, false),
        ("T=1", draw(1.0, 0, 1.0, 0.0), false),
        ("T=0.7 top_p=0.9", draw(0.7, 0, 0.9, 0.0), false),
        ("T=0.8 top_k=50", draw(0.8, 50, 1.0, 0.0), false),
        ("T=1 top_k=1", draw(1.0, 1, 1.0, 0.0), false),
        ("T=1 min_p=0.1", draw(1.0, 0, 1.0, 0.1), false),
        ("T=0.6 top_k=40 top_p=0.95", draw(0.6, 40, 0.95, 0.0), false),
        ("masked T=0.7 top_p=0.95", draw(0.7, 0, 0.95, 0.0), true),
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
        for (what, kind, masked) in &kinds {
            let draws: Vec<RowDraw> = (0..rows)
                .map(|_| RowDraw {
                    key: rng.random(),
                    ..*kind
                })
                .collect();
            let allowed = masked.then_some(&mask);
            let got = step.sample_rows(limit, &draws, allowed)?;
            let (mut wrong, mut worst) = (0usize, 0f32);
            for (r, ((row, d), (token, logprob))) in
                host_logits.iter().zip(&draws).zip(&got).enumerate()
            {
                let flags_r = masked.then(|| &flags[r * limit..(r + 1) * limit]);
                let (want, want_lp) = race::pick(&row[..limit], flags_r, d);
                wrong += usize::from(*token != want);
                worst = worst.max((logprob - want_lp).abs());
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
                    s.sample(row, limit, 0);
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

fn draw(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> RowDraw {
    RowDraw {
        temperature,
        top_k,
        top_p,
        min_p,
        key: 0,
    }
}
