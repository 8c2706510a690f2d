//! CUDA graphs for decode-only steps (every row one token, up to 32 rows): a small model's
//! step is bound by kernel launches (~9 per layer even fused), so each batch-size bucket
//! (1, 2, 4, ..., 32) is captured once and replayed. Inputs (ids, positions, slots, block
//! tables) live in one persistent device buffer that is refreshed before each replay;
//! padding rows store nothing and are not attended. Outputs are copied into persistent
//! logits/hidden buffers inside the graph, so every allocation made during capture is also
//! freed inside it. `KernelOptions::cuda_graphs` off turns graphs off.

use super::cuda::MetaPtrs;
use super::{ForwardOutput, Transformer};
use crate::attention::RowSpan;
use crate::attention_device::TensorKv;
use crate::kv::BlockTable;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaSlice, DevicePtr};
use candle_core::{DType, Result, Tensor};
use std::collections::HashMap;

/// Largest decode batch replayed from a graph.
pub(super) const GRAPH_MAX_BATCH: usize = 32;

fn driver(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("CUDA graph: {e}"))
}

/// A captured graph. SAFETY of `Send`: a graph is only launched while the `Mutex` around
/// `DecodeGraphs` is held, so calls on it are serialised as CUDA requires.
struct Graph(CudaGraph);
unsafe impl Send for Graph {}

pub(super) struct DecodeGraphs {
    /// `[ids | pos | slots | tok_row]` (each `cap` long), then `cap` block-table rows.
    inputs: CudaSlice<u32>,
    cap: usize,
    max_blocks: usize,
    logits: Tensor,
    hidden: Tensor,
    graphs: HashMap<(usize, bool), Graph>,
    disabled: bool,
}

impl DecodeGraphs {
    fn new(model: &Transformer, block_size: usize, caches: &[TensorKv]) -> Result<Self> {
        let dev = model.device.as_cuda_device()?;
        let cap = GRAPH_MAX_BATCH;
        let slots = caches.first().map_or(0, |c| c.k.dim(0).unwrap_or(0));
        let max_blocks = model.max_len().min(slots).div_ceil(block_size).max(1);
        Ok(Self {
            inputs: dev.alloc_zeros::<u32>(4 * cap + cap * max_blocks)?,
            cap,
            max_blocks,
            logits: Tensor::zeros((cap, model.cfg.vocab_size), DType::F32, &model.device)?,
            hidden: Tensor::zeros((cap, model.cfg.hidden_size), DType::F32, &model.device)?,
            graphs: HashMap::new(),
            disabled: false,
        })
    }
}

impl Transformer {
    pub(super) fn graph_applies(&self, rows: &[RowSpan], all_logits: bool) -> bool {
        self.kernels.cuda_graphs
            && !all_logits
            && rows.len() <= GRAPH_MAX_BATCH
            && rows.iter().all(|r| r.len == 1)
    }

    /// Run a decode-only step from a graph (capturing it on first use of its bucket).
    /// `None`: graphs cannot serve this step (or failed before); use the plain path.
    pub(super) fn forward_graph(
        &self,
        ids: &[u32],
        rows: &[RowSpan],
        tables: &[&BlockTable],
        block_size: usize,
        caches: &[TensorKv],
        want_hidden: bool,
    ) -> Result<Option<ForwardOutput>> {
        let mut guard = self
            .graphs
            .lock()
            .map_err(|_| driver("graph state poisoned"))?;
        if guard.is_none() {
            *guard = Some(DecodeGraphs::new(self, block_size, caches)?);
        }
        let Some(g) = guard.as_mut() else {
            return Ok(None);
        };
        if g.disabled {
            return Ok(None);
        }
        let b = rows.len().next_power_of_two();
        let (cap, mb) = (g.cap, g.max_blocks);
        let mut host = vec![0u32; 4 * cap + b * mb];
        for i in 0..b {
            match (rows.get(i), tables.get(i)) {
                (Some(r), Some(t)) => {
                    let nb = (r.past + 1).div_ceil(block_size);
                    if nb > mb {
                        return Ok(None);
                    }
                    host[i] = ids[r.start];
                    host[cap + i] = r.past as u32;
                    host[2 * cap + i] = t.slot(r.past, block_size) as u32;
                    host[3 * cap + i] = i as u32;
                    let at = 4 * cap + i * mb;
                    host[at..at + nb].copy_from_slice(&t.blocks[..nb]);
                }
                _ => {
                    host[2 * cap + i] = u32::MAX;
                    host[3 * cap + i] = u32::MAX;
                }
            }
        }
        let dev = self.device.as_cuda_device()?;
        let stream = dev.cuda_stream();
        let n = host.len();
        stream
            .memcpy_htod(&host, &mut g.inputs.slice_mut(0..n))
            .map_err(driver)?;
        let key = (b, want_hidden);
        if let Some(graph) = g.graphs.get(&key) {
            graph.0.launch().map_err(driver)?;
        } else {
            // Small host-to-device uploads inside candle ops (shapes) are cached so the
            // capture can reuse them; the first run computes this step for real.
            let _cache = dev.enable_cuda_graph_htod_cache();
            self.graph_body(g, b, block_size, caches, want_hidden)?;
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(driver)?;
            let body = self.graph_body(g, b, block_size, caches, want_hidden);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            match (body, graph) {
                (Ok(()), Ok(Some(graph))) => {
                    graph.upload().map_err(driver)?;
                    tracing::debug!(batch = b, "captured a CUDA graph");
                    g.graphs.insert(key, Graph(graph));
                }
                (body, graph) => {
                    tracing::warn!(
                        batch = b,
                        body = ?body.err(),
                        graph = ?graph.err(),
                        "CUDA graph capture failed; decode steps run without graphs"
                    );
                    g.disabled = true;
                }
            }
        }
        let logits = g.logits.narrow(0, 0, rows.len())?.copy()?;
        let hidden = if want_hidden {
            Some(g.hidden.narrow(0, 0, rows.len())?.copy()?)
        } else {
            None
        };
        Ok(Some(ForwardOutput { logits, hidden }))
    }

    /// The step over the persistent inputs, writing the persistent outputs.
    fn graph_body(
        &self,
        g: &DecodeGraphs,
        b: usize,
        block_size: usize,
        caches: &[TensorKv],
        want_hidden: bool,
    ) -> Result<()> {
        let stream = self.device.as_cuda_device()?.cuda_stream();
        let base = g.inputs.device_ptr(&stream).0;
        let sec = |k: usize| base + (k * g.cap * 4) as u64;
        let x = self.embed_ids(sec(0), b)?;
        let m = MetaPtrs {
            tokens: b,
            pos: sec(1),
            slots: sec(2),
            tok_row: sec(3),
            tables: sec(4),
            max_blocks: g.max_blocks,
            block_size,
            splits: self.attention_splits(b, None),
        };
        let h = self.layers_fused(x, &m, &[], caches)?;
        let logits = self.lm_head.forward(&h, None)?.to_dtype(DType::F32)?;
        g.logits.slice_set(&logits, 0, 0)?;
        if want_hidden {
            g.hidden.slice_set(&h.to_dtype(DType::F32)?, 0, 0)?;
        }
        Ok(())
    }
}
