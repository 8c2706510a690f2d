//! Which of our CPU kernels a quantised weight gets: chosen once per weight at load, from the
//! model's options (`KernelOptions::cpu_q5` / `cpu_qk` in the runtime).

use serde::Deserialize;

/// A CPU quantised-matmul kernel choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuKernel {
    /// The best kernel this CPU has (candle's own path where ours would only be scalar and
    /// slower).
    #[default]
    Auto,
    /// Leave the weight to candle.
    Candle,
    /// Our portable kernel (A/B measurements).
    Scalar,
    /// Our 256-bit kernel, even where 512-bit lanes exist.
    Avx2,
}

impl CpuKernel {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "candle" => Some(Self::Candle),
            "scalar" => Some(Self::Scalar),
            "avx2" => Some(Self::Avx2),
            _ => None,
        }
    }

    /// The kernel a weight gets: `Candle` leaves it to candle, `Scalar` / `Avx2` force one,
    /// `Auto` the best this CPU has (`detected`) — or none when that is the scalar loop and
    /// it does not beat candle's own path (`scalar_wins`).
    pub(crate) fn pick<K: Copy + PartialEq>(
        self,
        scalar: K,
        avx2: K,
        detected: K,
        scalar_wins: bool,
    ) -> Option<K> {
        match self {
            Self::Candle => None,
            Self::Scalar => Some(scalar),
            Self::Avx2 => Some(avx2),
            Self::Auto if detected == scalar && !scalar_wins => None,
            Self::Auto => Some(detected),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_choices_pick_kernels() {
        let pick = |c: CpuKernel, detected, scalar_wins| c.pick(0, 1, detected, scalar_wins);
        assert_eq!(pick(CpuKernel::Candle, 2, true), None);
        assert_eq!(pick(CpuKernel::Scalar, 2, false), Some(0));
        assert_eq!(pick(CpuKernel::Avx2, 2, false), Some(1));
        assert_eq!(pick(CpuKernel::Auto, 2, false), Some(2));
        assert_eq!(pick(CpuKernel::Auto, 0, false), None);
        assert_eq!(pick(CpuKernel::Auto, 0, true), Some(0));
    }
}
