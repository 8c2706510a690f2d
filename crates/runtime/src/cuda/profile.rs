//! Kernel timing for `tokenrouter bench-model --op-profile` (GPU builds): while on, every
//! launch of our kernels first records a CUDA event on its stream, so the GPU time between
//! two consecutive events is the time of the kernel launched between them (plus any candle
//! op that followed it, e.g. cuBLAS). The caller keeps the device busy while the step is
//! enqueued, so launch gaps of the host do not count. Off (one atomic load) otherwise.

use candle_core::cuda_backend::cudarc::driver::{sys::CUevent_flags, CudaEvent};
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static ON: AtomicBool = AtomicBool::new(false);
static EVENTS: Mutex<Vec<(String, CudaEvent)>> = Mutex::new(Vec::new());

fn driver(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("op profile: {e}"))
}

/// Record an event before launching kernel `name` (no-op unless profiling).
pub fn mark(dev: &CudaDevice, name: &str) -> Result<()> {
    if !ON.load(Ordering::Relaxed) {
        return Ok(());
    }
    let ev = dev
        .cuda_stream()
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver)?;
    EVENTS
        .lock()
        .map_err(|_| driver("poisoned"))?
        .push((name.to_string(), ev));
    Ok(())
}

/// Start recording (drops anything recorded before).
pub fn start() -> Result<()> {
    EVENTS.lock().map_err(|_| driver("poisoned"))?.clear();
    ON.store(true, Ordering::SeqCst);
    Ok(())
}

/// GPU time of one kernel name over a profiled step.
pub struct KernelTime {
    pub name: String,
    pub launches: usize,
    pub ms: f64,
}

/// Stop, wait for the device, and return the time per kernel name, in order of first
/// launch, plus the GPU time from the first mark to the end of the stream's work (ms).
pub fn finish(dev: &CudaDevice) -> Result<(Vec<KernelTime>, f64)> {
    ON.store(false, Ordering::SeqCst);
    let end = dev
        .cuda_stream()
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver)?;
    let events = std::mem::take(&mut *EVENTS.lock().map_err(|_| driver("poisoned"))?);
    let mut out: Vec<KernelTime> = Vec::new();
    for (i, (name, ev)) in events.iter().enumerate() {
        let next = events.get(i + 1).map_or(&end, |(_, e)| e);
        let ms = f64::from(ev.elapsed_ms(next).map_err(driver)?);
        match out.iter_mut().find(|k| &k.name == name) {
            Some(k) => {
                k.launches += 1;
                k.ms += ms;
            }
            None => out.push(KernelTime {
                name: name.clone(),
                launches: 1,
                ms,
            }),
        }
    }
    let total = match events.first() {
        Some((_, first)) => f64::from(first.elapsed_ms(&end).map_err(driver)?),
        None => 0.0,
    };
    Ok((out, total))
}
