//! The routing methods shipped with tokenrouter, registered by name. Each method has a
//! role per model: `<method>_slm` for the entry (small) model, `<method>_llm` for the
//! others; the bare `<method>` picks the role from the model's position.

pub mod basic;
pub mod citer;
pub mod collm;
pub mod glimprouter;
pub mod me;
pub mod r2r;
pub mod router_net;
pub mod torch_file;

use crate::policy::Registry;

pub fn register_all(r: &mut Registry) {
    basic::register(r);
    r2r::register(r);
    citer::register(r);
    collm::register(r);
    glimprouter::register(r);
    me::register(r);
}

/// Deterministic uniform number in [0, 1) from a few integers (splitmix64), so routing
/// decisions depend on the request and position, never on batch composition.
pub fn unit_hash(a: u64, b: u64, c: u64) -> f64 {
    let mut z = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.rotate_left(21))
        .wrapping_add(c.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Turn a learned router's per-row scores into decisions: go to `to` where `route(score)`,
/// else stay. If the router failed, keep the small model's tokens rather than stall.
pub fn decide<E: std::fmt::Display>(
    step: &crate::policy::StepView<'_>,
    method: &str,
    to: tokenrouter_api::ModelIndex,
    scores: Result<Vec<f32>, E>,
    route: impl Fn(&crate::policy::RowView<'_>, f32) -> bool,
) -> Vec<crate::policy::Decision> {
    use crate::policy::Decision;
    match scores {
        Ok(s) => s
            .into_iter()
            .zip(step.rows)
            .map(|(p, row)| {
                if route(row, p) {
                    Decision::go(to, Some(p))
                } else {
                    Decision::stay(Some(p))
                }
            })
            .collect(),
        Err(e) => {
            tracing::error!(
                model = step.model,
                "{method} router failed, keeping the small model's tokens: {e}"
            );
            vec![Decision::STAY; step.rows.len()]
        }
    }
}
