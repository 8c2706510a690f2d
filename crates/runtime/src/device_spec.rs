//! Devices and dtypes as the user writes them (`cpu`, `cuda`, `cuda:1`; `f32`, `bf16`,
//! `f16`), parsed once into typed values with one error message, so the engine's config
//! and the command line's benchmarks agree on the spelling and fail before loading weights.

use candle_core::{DType, Device};
use std::fmt;
use std::str::FromStr;

/// Where a model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// CUDA device by ordinal.
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (use cpu, cuda or cuda:N)")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }

    /// Opens the device (a CUDA device fails here in a CPU-only build or without a driver).
    pub fn open(self) -> Result<Device, String> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(n) => Device::new_cuda(n).map_err(|e| format!("device `{self}`: {e}")),
        }
    }

    /// The compute dtype for dense weights: `spec` if given, else f32 on the CPU and bf16
    /// on a GPU.
    pub fn dtype(self, spec: Option<&str>) -> Result<DType, String> {
        match spec {
            None if self == Self::Cpu => Ok(DType::F32),
            None => Ok(DType::BF16),
            Some("f32" | "float32") => Ok(DType::F32),
            Some("bf16" | "bfloat16") => Ok(DType::BF16),
            Some("f16" | "float16") => Ok(DType::F16),
            Some(o) => Err(format!("unknown dtype `{o}` (use f32, bf16 or f16)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_dtypes() {
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceSpec::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "CPU"] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains(bad) && e.contains("cuda:N"), "{e}");
        }
        assert_eq!(DeviceSpec::Cuda(1).to_string(), "cuda:1");
        assert_eq!(DeviceSpec::Cpu.dtype(None), Ok(DType::F32));
        assert_eq!(DeviceSpec::Cuda(0).dtype(None), Ok(DType::BF16));
        assert_eq!(DeviceSpec::Cpu.dtype(Some("bfloat16")), Ok(DType::BF16));
        assert!(DeviceSpec::Cpu
            .dtype(Some("f8"))
            .unwrap_err()
            .contains("f8"));
    }
}
