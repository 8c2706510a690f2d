//! With the `cuda` feature, compile our fused kernels (kernels/fused.cu, which includes the
//! other files of kernels/) to PTX with nvcc, for the compute capability in CUDA_COMPUTE_CAP
//! (default 90: H100/H200). CPU builds do nothing here.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("fused.ptx");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("CUDA_ROOT")
        .map(|r| PathBuf::from(r).join("bin/nvcc"))
        .unwrap_or_else(|_| PathBuf::from("nvcc"));
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", &format!("-arch=sm_{cap}"), "-o"])
        .arg(&out)
        .arg("kernels/fused.cu")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("nvcc failed on kernels/fused.cu ({s})"),
        Err(e) => panic!(
            "the cuda feature needs nvcc ({}): {e}; see ../shared/cuda/README.md",
            nvcc.display()
        ),
    }
}
