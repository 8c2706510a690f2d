//! The seam the engine uses: `step(rows)` over a ragged batch of (sequence, new tokens).
//! A decode row has one token, an extend/prefill row many; positions continue from what
//! the sequence already has cached. The runner owns the model and its paged KV cache.

use crate::attention::RowSpan;
use crate::attention_device::TensorKv;
use crate::config::ModelConfig;
use crate::error::{Result, RuntimeError};
use crate::kv::{BlockManager, BlockTable, KvCapacity, KvStore, KvUsage, LayerKv, SeqId};
use crate::model::{ForwardOutput, Transformer};
use crate::sampling::Sampled;
use candle_core::Tensor;
use std::collections::HashSet;

/// One row of a step: which sequence and the tokens it has not cached yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
}

impl Row {
    pub fn new(seq: SeqId, tokens: Vec<u32>) -> Self {
        Self { seq, tokens }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct StepOptions {
    /// Also return the final-norm hidden state of each row's last token.
    pub want_hidden: bool,
    /// Return logits for every token instead of each row's last (teacher forcing, tests).
    pub all_logits: bool,
}

/// Per-row results, in the order of the rows given.
pub struct StepOutput {
    /// `[rows, vocab]` f32 (or `[tokens, vocab]` with `all_logits`).
    pub logits: Tensor,
    /// `[rows, hidden]` f32 when asked.
    pub hidden: Option<Tensor>,
}

impl StepOutput {
    /// Logits as one `Vec` per row (host memory).
    /// Wait until the step's results exist (GPU steps run asynchronously): for timing.
    pub fn wait(&self) -> Result<()> {
        Ok(self.logits.device().synchronize()?)
    }

    /// Greedy picks computed where the logits are: per row the argmax among ids below
    /// `limit` and its log-probability. Copies two numbers per row to the host instead of
    /// the whole vocabulary (ties may resolve to any of the tied ids).
    pub fn greedy_rows(&self, limit: usize) -> Result<Vec<(u32, f32)>> {
        self.greedy_rows_allowed(limit, None)
    }

    /// [`StepOutput::greedy_rows`] among the ids `allowed` flags (u8 `[rows, limit]`, 1 =
    /// may be picked: structured output's masks, uploaded). The log-probability stays the
    /// model's own, over the whole row (vLLM's raw log-probabilities).
    pub fn greedy_rows_allowed(
        &self,
        limit: usize,
        allowed: Option<&Tensor>,
    ) -> Result<Vec<(u32, f32)>> {
        let l = &self.logits;
        let limit = limit.clamp(1, l.dim(1)?);
        let l = if limit < l.dim(1)? {
            l.narrow(1, 0, limit)?.contiguous()?
        } else {
            l.clone()
        };
        let idx = match allowed {
            None => l.argmax_keepdim(1)?,
            Some(allowed) => {
                if allowed.dims() != l.dims() {
                    return Err(RuntimeError::InvalidStep(format!(
                        "a token mask of shape {:?} for logits of shape {:?}",
                        allowed.dims(),
                        l.dims()
                    )));
                }
                let never =
                    Tensor::full(f32::NEG_INFINITY, l.dims(), l.device())?.to_dtype(l.dtype())?;
                allowed.where_cond(&l, &never)?.argmax_keepdim(1)?
            }
        };
        let pick = l.gather(&idx, 1)?;
        let max = l.max_keepdim(1)?;
        let lse = (l.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + &max)?;
        let logprob = (pick - lse)?.flatten_all()?.to_vec1::<f32>()?;
        let ids = idx.flatten_all()?.to_vec1::<u32>()?;
        Ok(ids.into_iter().zip(logprob).collect())
    }

    /// One token per row drawn as `rows` say (greedy rows too; penalties and bias as
    /// sparse adjustments), among the ids `allowed` flags (as
    /// [`StepOutput::greedy_rows_allowed`] takes them), with its log-probability and top
    /// alternatives over the raw row: [`crate::sampling::race`], where the logits are (CUDA
    /// kernels on a GPU, so a few numbers per row reach the host). A row holding a NaN gives
    /// token 0 with a NaN log-probability.
    pub fn sample_rows(
        &self,
        limit: usize,
        rows: &[crate::sampling::race::DrawRow],
        allowed: Option<&Tensor>,
    ) -> Result<Vec<Sampled>> {
        let l = &self.logits;
        let (n, width) = l.dims2()?;
        let limit = limit.clamp(1, width);
        if rows.len() != n {
            return Err(RuntimeError::InvalidStep(format!(
                "{} draws for {n} rows of logits",
                rows.len()
            )));
        }
        if let Some(a) = allowed {
            if a.dims() != [n, limit] {
                return Err(RuntimeError::InvalidStep(format!(
                    "a token mask of shape {:?} for {n} rows of {limit} logits",
                    a.dims()
                )));
            }
        }
        let l = l
            .narrow(1, 0, limit)?
            .to_dtype(candle_core::DType::F32)?
            .contiguous()?;
        #[cfg(feature = "cuda")]
        if l.device().is_cuda() {
            return crate::cuda::sample::sample_rows(&l, rows, allowed);
        }
        let allowed = allowed.map(|a| a.to_vec2::<u8>()).transpose()?;
        Ok(l.to_vec2::<f32>()?
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(i, (raw, row))| {
                let mask = allowed.as_ref().map(|a| a[i].as_slice());
                crate::sampling::race::pick_row(raw, row, mask)
            })
            .collect())
    }

    /// Normalised entropy `H / ln(limit)` of each row's softmax over its first `limit`
    /// logits, computed where the logits are (on a GPU only one number per row reaches the
    /// host). `H = ln Σe^z − Σ p z` with `z = l − max l`, `p = e^z / Σe^z`.
    pub fn entropy_rows(&self, limit: usize) -> Result<Vec<f32>> {
        self.normalised_entropy(limit, None)
    }

    /// [`StepOutput::entropy_rows`] over the ids `allowed` leaves each row (u8 flags
    /// `[rows, limit]`, as [`unpack_bits`] makes them): a constrained row's uncertainty among
    /// the tokens it may write. Still normalised by `ln(limit)`, so thresholds keep their
    /// meaning; a row that allows one id has entropy 0.
    pub fn entropy_rows_allowed(&self, limit: usize, allowed: &Tensor) -> Result<Vec<f32>> {
        self.normalised_entropy(limit, Some(allowed))
    }

    fn normalised_entropy(&self, limit: usize, allowed: Option<&Tensor>) -> Result<Vec<f32>> {
        let l = &self.logits;
        let limit = limit.clamp(1, l.dim(1)?);
        let mut l = l.narrow(1, 0, limit)?.to_dtype(candle_core::DType::F32)?;
        let keep = allowed.map(|a| a.narrow(1, 0, limit)).transpose()?;
        if let Some(keep) = &keep {
            let lowest = Tensor::full(f32::NEG_INFINITY, l.shape(), l.device())?;
            l = keep.where_cond(&l, &lowest)?;
        }
        let mut z = l.broadcast_sub(&l.max_keepdim(1)?)?;
        let e = z.exp()?;
        if let Some(keep) = &keep {
            // A masked id's e is 0 and its z -inf: its p z term is 0, not NaN.
            z = keep.where_cond(&z, &z.zeros_like()?)?;
        }
        let sum = e.sum_keepdim(1)?;
        let pz = (e * &z)?.sum_keepdim(1)?.broadcast_div(&sum)?;
        let h = (sum.log()? - pz)?;
        let norm = (limit.max(2) as f64).ln();
        Ok((h / norm)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// The `k` largest of each row's first `limit` logits, in descending order, computed
    /// where the logits are (on a GPU only `k` numbers per row reach the host). Large rows
    /// go in two sorts of a few thousand values each (the CUDA sort works in shared memory):
    /// the maxima of chunks of `TOP_CHUNK` logits, then the logits of the `k` chunks with the
    /// largest maxima, which hold the `k` largest logits.
    pub fn top_logits_rows(&self, limit: usize, k: usize) -> Result<Vec<Vec<f32>>> {
        let l = &self.logits;
        let rows = l.dim(0)?;
        let limit = limit.clamp(1, l.dim(1)?);
        let k = k.clamp(1, limit);
        let l = l
            .narrow(1, 0, limit)?
            .to_dtype(candle_core::DType::F32)?
            .contiguous()?;
        let chunks = limit.div_ceil(TOP_CHUNK);
        if limit > TOP_DIRECT_MAX && (k * TOP_CHUNK > TOP_SORT_MAX || chunks > TOP_SORT_MAX) {
            return Err(RuntimeError::InvalidStep(format!(
                "top {k} of {limit} logits is beyond the device sort ({TOP_SORT_MAX} values)"
            )));
        }
        let candidates = if limit <= TOP_DIRECT_MAX {
            l
        } else {
            let pad = chunks * TOP_CHUNK - limit;
            let l = if pad > 0 {
                let fill = Tensor::full(f32::NEG_INFINITY, (rows, pad), l.device())?;
                Tensor::cat(&[&l, &fill], 1)?
            } else {
                l
            };
            let l = l.reshape((rows, chunks, TOP_CHUNK))?;
            let best = l
                .max_keepdim(2)?
                .squeeze(2)?
                .arg_sort_last_dim(false)?
                .narrow(1, 0, k.min(chunks))?;
            let idx = best
                .unsqueeze(2)?
                .broadcast_as((rows, k.min(chunks), TOP_CHUNK))?
                .contiguous()?;
            l.gather(&idx, 1)?
                .reshape((rows, k.min(chunks) * TOP_CHUNK))?
        };
        let order = candidates.arg_sort_last_dim(false)?.narrow(1, 0, k)?;
        Ok(candidates.gather(&order.contiguous()?, 1)?.to_vec2()?)
    }

    pub fn logits_rows(&self) -> Result<Vec<Vec<f32>>> {
        Ok(self.logits.to_dtype(candle_core::DType::F32)?.to_vec2()?)
    }
}

/// Token masks uploaded as bits (u8 `[rows, ceil(width / 8)]`, id `i` bit `i % 8` of byte
/// `i / 8`) unpacked where they are into the flags `StepOutput::greedy_rows_allowed` takes
/// (u8 `[rows, width]`): a GPU gets an eighth of the bytes, and unpacks them in a few
/// element-wise passes.
pub fn unpack_bits(bits: &Tensor, width: usize) -> Result<Tensor> {
    let (rows, bytes) = bits.dims2()?;
    if bytes * 8 < width {
        return Err(RuntimeError::InvalidStep(format!(
            "{bytes} bytes of mask bits for {width} ids"
        )));
    }
    let device = bits.device();
    let bytes_f = bits.to_dtype(candle_core::DType::F32)?.unsqueeze(2)?;
    let weights: Vec<f32> = (0..8).map(|b| (1u32 << b) as f32).collect();
    let weights = Tensor::from_vec(weights, (1, 1, 8), device)?;
    // Bit b of x is floor(x / 2^b) mod 2 (exact in f32 for bytes).
    let shifted = bytes_f.broadcast_div(&weights)?.floor()?;
    let halves = (&shifted / 2.0)?.floor()?;
    let bit = (shifted - (halves * 2.0)?)?;
    Ok(bit
        .reshape((rows, bytes * 8))?
        .narrow(1, 0, width)?
        .ge(0.5)?)
}

/// Rows of up to this many logits are sorted whole by `top_logits_rows`.
const TOP_DIRECT_MAX: usize = 4096;
/// Chunk size of `top_logits_rows`' first pass.
const TOP_CHUNK: usize = 64;
/// Longest row `top_logits_rows` sorts (candle's CUDA sort holds a row, padded to a power
/// of two, in 48 KiB of shared memory).
const TOP_SORT_MAX: usize = 8192;

pub struct Runner {
    model: Transformer,
    blocks: BlockManager,
    kv: KvStore,
}

impl Runner {
    /// On the CPU the KV cache is host memory (`attention.rs`); on a GPU it is device
    /// tensors in the model's dtype (`attention_device.rs`).
    pub fn new(model: Transformer, capacity: KvCapacity) -> Result<Self> {
        let cfg = &model.cfg;
        let row = cfg.num_kv_heads * cfg.head_dim;
        let kv = if model.device().is_cpu() {
            KvStore::Host(
                (0..cfg.num_layers)
                    .map(|_| LayerKv::new(capacity.total_tokens(), row))
                    .collect(),
            )
        } else {
            let kv = Self::tensor_kv(&model, capacity)?;
            // Weights were made on the loading thread's stream; sub-servers step on their
            // own threads' streams, and the fused kernels read some weights by address.
            model.device().synchronize()?;
            kv
        };
        Ok(Self {
            model,
            blocks: BlockManager::new(capacity),
            kv,
        })
    }

    fn tensor_kv(model: &Transformer, capacity: KvCapacity) -> Result<KvStore> {
        let cfg = &model.cfg;
        let row = cfg.num_kv_heads * cfg.head_dim;
        let layers = (0..cfg.num_layers)
            .map(|_| TensorKv::new(capacity.total_tokens(), row, model.dtype(), model.device()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(KvStore::Device(layers))
    }

    /// Switch to the tensor KV path (what GPUs use) on any device, dropping cached
    /// sequences. Used to test that path on the CPU.
    pub fn use_tensor_kv(&mut self) -> Result<()> {
        let cap = self.blocks.capacity();
        self.kv = Self::tensor_kv(&self.model, cap)?;
        self.blocks = if self.blocks.prefix_caching() {
            BlockManager::with_prefix_cache(cap)
        } else {
            BlockManager::new(cap)
        };
        Ok(())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    /// Turn the fused CUDA kernels on or off (see `Transformer::set_fused_kernels`).
    pub fn set_fused_kernels(&mut self, on: bool) {
        self.model.set_fused_kernels(on);
    }

    /// Turn CUDA graphs for decode steps on or off.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.model.set_cuda_graphs(on);
    }

    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// Longest sequence (cached + new) accepted.
    pub fn max_len(&self) -> usize {
        self.model.max_len()
    }

    pub fn seq_len(&self, seq: SeqId) -> Option<usize> {
        self.blocks.seq_len(seq)
    }

    pub fn usage(&self) -> KvUsage {
        self.blocks.usage()
    }

    /// Whether `rows` could be reserved right now (for admission control).
    pub fn blocks_needed(&self, rows: &[(SeqId, usize)]) -> usize {
        rows.iter()
            .map(|&(s, n)| self.blocks.blocks_needed(s, n))
            .sum()
    }

    pub fn free_blocks(&self) -> usize {
        let u = self.usage();
        u.total_blocks - u.used_blocks
    }

    /// Sequences with KV cached here.
    pub fn cached_sequences(&self) -> Vec<SeqId> {
        self.blocks.sequences().collect()
    }

    /// Release a sequence's KV. Returns whether it was cached here.
    pub fn free(&mut self, seq: SeqId) -> bool {
        self.blocks.free_seq(seq)
    }

    /// Forget cached positions from `len` on (e.g. a discarded token). Returns the
    /// positions kept: fewer than `len` when the block holding `len` is a shared cached
    /// prefix (see `BlockManager::truncate`).
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> usize {
        self.blocks.truncate(seq, len)
    }

    /// Keep full KV blocks of finished sequences and reuse them for new sequences that start
    /// with the same tokens (`prefix_cache.rs`). Drops what is cached now.
    pub fn enable_prefix_cache(&mut self) {
        self.blocks = BlockManager::with_prefix_cache(self.blocks.capacity());
    }

    pub fn prefix_caching(&self) -> bool {
        self.blocks.prefix_caching()
    }

    /// Salt a sequence not created yet (see `BlockManager::salt`).
    pub fn salt_sequence(&mut self, seq: SeqId, salt: &str) {
        self.blocks.salt(seq, salt);
    }

    /// Forget every cached prefix (see `BlockManager::flush_prefix_cache`).
    pub fn flush_prefix_cache(&mut self) -> usize {
        self.blocks.flush_prefix_cache()
    }

    /// For a sequence not cached yet that will hold `tokens`: reuse the cached blocks of its
    /// longest cached prefix. Returns the positions now cached (0 without a hit).
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        self.blocks.attach_prefix(seq, tokens)
    }

    /// (tokens looked up, tokens found) in the prefix cache since it was enabled.
    pub fn prefix_hits(&self) -> (u64, u64) {
        self.blocks.prefix_hits()
    }

    fn validate(&self, rows: &[Row]) -> Result<()> {
        if rows.is_empty() {
            return Err(RuntimeError::InvalidStep("no rows".into()));
        }
        let mut seen = HashSet::new();
        let vocab = self.model.cfg.vocab_size as u32;
        for r in rows {
            if !seen.insert(r.seq) {
                return Err(RuntimeError::InvalidStep(format!(
                    "sequence {} appears twice in one step",
                    r.seq
                )));
            }
            if r.tokens.is_empty() {
                return Err(RuntimeError::InvalidStep(format!(
                    "row of sequence {} has no tokens",
                    r.seq
                )));
            }
            if let Some(bad) = r.tokens.iter().find(|&&t| t >= vocab) {
                return Err(RuntimeError::InvalidStep(format!(
                    "token id {bad} is outside the vocabulary ({vocab})"
                )));
            }
            let len = self.blocks.seq_len(r.seq).unwrap_or(0) + r.tokens.len();
            if len > self.max_len() {
                return Err(RuntimeError::ContextOverflow {
                    seq: r.seq,
                    len,
                    max: self.max_len(),
                });
            }
        }
        Ok(())
    }

    /// Run one ragged batch. On `OutOfBlocks` nothing was changed. On the CPU a step of
    /// more than [`CPU_UBATCH`] tokens runs as several forward passes (see there).
    pub fn step(&mut self, rows: &[Row], opts: StepOptions) -> Result<StepOutput> {
        self.validate(rows)?;
        let wants: Vec<(SeqId, usize)> = rows.iter().map(|r| (r.seq, r.tokens.len())).collect();
        self.blocks.reserve(&wants)?;
        let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
        if total <= CPU_UBATCH || !matches!(self.kv, KvStore::Host(_)) {
            let pieces: Vec<(SeqId, &[u32])> =
                rows.iter().map(|r| (r.seq, r.tokens.as_slice())).collect();
            let out = self.forward_pass(&pieces, opts)?;
            return Ok(StepOutput {
                logits: out.logits,
                hidden: out.hidden,
            });
        }
        self.step_in_passes(rows, opts)
    }

    /// One forward pass over `pieces` (a sequence at most once; the blocks reserved), then
    /// the sequences advanced by their tokens.
    fn forward_pass(
        &mut self,
        pieces: &[(SeqId, &[u32])],
        opts: StepOptions,
    ) -> Result<ForwardOutput> {
        let mut spans = Vec::with_capacity(pieces.len());
        let mut ids = Vec::new();
        for &(seq, tokens) in pieces {
            spans.push(RowSpan {
                start: ids.len(),
                len: tokens.len(),
                past: self.blocks.seq_len(seq).unwrap_or(0),
            });
            ids.extend_from_slice(tokens);
        }
        let block_size = self.blocks.capacity().block_size;
        let out = {
            let tables: Vec<&BlockTable> = pieces
                .iter()
                .map(|&(seq, _)| {
                    self.blocks.table(seq).ok_or_else(|| {
                        RuntimeError::InvalidStep(format!("sequence {seq} has no blocks"))
                    })
                })
                .collect::<Result<_>>()?;
            self.model.forward(
                &ids,
                &spans,
                &tables,
                block_size,
                &mut self.kv,
                opts.want_hidden,
                opts.all_logits,
            )?
        };
        for &(seq, tokens) in pieces {
            self.blocks.advance(seq, tokens);
        }
        Ok(out)
    }

    /// `rows` (more than [`CPU_UBATCH`] tokens) as passes of up to that many tokens, filled
    /// in token order (a long row continues in the next pass, as llama.cpp splits a batch
    /// into ubatches); each row's results come from the pass that holds its last token (all
    /// its positions', in order, with `all_logits`). If a later pass fails, earlier ones
    /// have advanced their sequences.
    fn step_in_passes(&mut self, rows: &[Row], opts: StepOptions) -> Result<StepOutput> {
        let mut passes: Vec<Vec<(usize, std::ops::Range<usize>)>> = Vec::new();
        let mut room = 0;
        for (i, r) in rows.iter().enumerate() {
            let mut at = 0;
            while at < r.tokens.len() {
                if room == 0 {
                    passes.push(Vec::new());
                    room = CPU_UBATCH;
                }
                let n = room.min(r.tokens.len() - at);
                if let Some(pass) = passes.last_mut() {
                    pass.push((i, at..at + n));
                }
                at += n;
                room -= n;
            }
        }
        // Per row its logits (and hidden states) rows: the last token's, or every token's.
        let mut logits: Vec<Vec<Tensor>> = vec![Vec::new(); rows.len()];
        let mut hidden: Vec<Vec<Tensor>> = vec![Vec::new(); rows.len()];
        for pass in &passes {
            let pieces: Vec<(SeqId, &[u32])> = pass
                .iter()
                .map(|(i, range)| (rows[*i].seq, &rows[*i].tokens[range.clone()]))
                .collect();
            let out = self.forward_pass(&pieces, opts)?;
            let mut offset = 0;
            for (q, (i, range)) in pass.iter().enumerate() {
                let (at, len) = if opts.all_logits {
                    offset += range.len();
                    (offset - range.len(), range.len())
                } else if range.end == rows[*i].tokens.len() {
                    (q, 1)
                } else {
                    continue;
                };
                logits[*i].push(out.logits.narrow(0, at, len)?);
                if let Some(h) = &out.hidden {
                    hidden[*i].push(h.narrow(0, at, len)?);
                }
            }
        }
        let cat = |parts: Vec<Vec<Tensor>>| -> Result<Tensor> {
            let parts: Vec<Tensor> = parts.into_iter().flatten().collect();
            Ok(Tensor::cat(&parts, 0)?)
        };
        let hidden = if opts.want_hidden {
            Some(cat(hidden)?)
        } else {
            None
        };
        Ok(StepOutput {
            logits: cat(logits)?,
            hidden,
        })
    }
}

/// Tokens one forward pass takes at most on the CPU (llama.cpp's default `n_ubatch`). A
/// pass holds activations for all its tokens (the 0.5B's MLP alone 60 MB for 1024, growing
/// with the prompt), so a long prompt runs in passes of this many: peak memory stays that
/// of a 512-token pass, and results are llama.cpp's, which splits prompts the same way.
pub const CPU_UBATCH: usize = 512;
