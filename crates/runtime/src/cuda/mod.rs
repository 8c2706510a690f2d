//! The CUDA host side in one tree: launchers of our kernels (`kernels` — fused norms, rope,
//! KV writes, sampling inputs; `attention` — paged attention; `gemv` — the skinny matmuls;
//! `sample` — drawing each row's token where the logits are),
//! their checks against references for `bench-model --check-fused` (`check`), and the
//! per-op profiler (`profile`). The fused forward that uses them is `model/cuda.rs`.

pub mod attention;
pub mod check;
pub mod gemv;
pub mod kernels;
pub mod profile;
pub mod sample;
