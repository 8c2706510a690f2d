//! The native half of the `tokenrouter` Python package: the routing engine in-process
//! ([`engine::Engine`], [`stream::Stream`]), the whole CLI (`run_cli`, behind the
//! `tokenrouter` console script and `python -m tokenrouter.launch_server`), and a tiny
//! synthetic pair for trying and testing without a download. Everything Python users see
//! is in `python/tokenrouter/`; this module stays thin.

mod engine;
mod stream;

use std::path::Path;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    EngineError,
    pyo3::exceptions::PyRuntimeError,
    "The engine failed: a model did not load, went down, or refused the request for load."
);

/// Runs the `tokenrouter` command line (`argv[0]` is the program name) without the GIL and
/// returns its exit code.
#[pyfunction]
fn run_cli(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(move || tokenrouter::run_with_args(argv))
}

/// Writes the tiny synthetic pair (random weights, one tokenizer) and its config under
/// `dir`; returns the config's path. `p`: probability of routing a token to the large model.
#[pyfunction]
#[pyo3(signature = (dir, p = 0.5, seed = 0))]
fn write_tiny_pair(py: Python<'_>, dir: &str, p: f64, seed: u64) -> PyResult<String> {
    py.detach(|| tokenrouter_engine::synth_pair::write_tiny_pair(Path::new(dir), p, seed, ""))
        .map(|path| path.display().to_string())
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("EngineError", m.py().get_type::<EngineError>())?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<stream::Stream>()?;
    m.add_function(wrap_pyfunction!(run_cli, m)?)?;
    m.add_function(wrap_pyfunction!(write_tiny_pair, m)?)?;
    Ok(())
}
