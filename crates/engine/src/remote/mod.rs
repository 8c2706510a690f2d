//! Sub-servers in other processes. The front end's side is a *proxy* (`proxy.rs`) that
//! stands where a sub-server thread would: the inter-model loop delivers to it and hears
//! from it as from any model. The remote side (`host.rs`, `tokenrouter subserver`) runs an
//! ordinary `SubServer` over copies of the requests it serves, kept in step by deltas
//! (`convert.rs`). The transport and schema are `tokenrouter-wire`'s.

use crate::config::NamedModel;
use sha2::{Digest, Sha256};
use tokenrouter_runtime::TextModel;
use tokenrouter_wire::pb;

mod convert;
pub(crate) mod dial;
pub mod host;
mod host_session;
pub(crate) mod proxy;

pub use host::{start_subserver, HostOptions, SubserverHost};
pub use proxy::ProxyStats;

/// Lower a counter without wrapping (a remote's counters mirror its front end's requests).
pub(crate) fn saturating_dec(a: &std::sync::atomic::AtomicUsize, n: usize) {
    use std::sync::atomic::Ordering;
    let _ = a.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
        Some(v.saturating_sub(n))
    });
}

/// What must agree between the front end's config entry and the remote's for the model to
/// behave as it would in one process.
pub(crate) fn identity(m: &NamedModel) -> pb::Identity {
    pb::Identity {
        model_path: m.section.model_path.clone(),
        scheduler_class: m.section.scheduler_class().to_string(),
        scheduler_kwargs: canonical(&m.section.scheduler_kwargs),
        delayed_batching_threshold: format!("{:?}", m.section.delayed_batching_threshold),
        random_weights: m.section.random_weights,
    }
}

/// The differences between two identities, as `key: ours vs theirs` lines (empty: equal).
pub(crate) fn identity_differences(front: &pb::Identity, remote: &pb::Identity) -> Vec<String> {
    let field = |i: &pb::Identity| {
        [
            ("model_path", i.model_path.clone()),
            ("scheduler_class", i.scheduler_class.clone()),
            ("scheduler_kwargs", i.scheduler_kwargs.clone()),
            (
                "delayed_batching_threshold",
                i.delayed_batching_threshold.clone(),
            ),
            ("random_weights", i.random_weights.to_string()),
        ]
    };
    field(front)
        .into_iter()
        .zip(field(remote))
        .filter(|((_, a), (_, b))| a != b)
        .map(|((key, a), (_, b))| format!("{key}: `{a}` (front end) vs `{b}` (sub-server)"))
        .collect()
}

/// A YAML value as one line with mapping keys sorted at every level (so that two files
/// that say the same thing compare equal whatever their key order).
fn canonical(v: &serde_yaml::Value) -> String {
    use serde_yaml::Value;
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("{s:?}"),
        Value::Sequence(items) => format!(
            "[{}]",
            items.iter().map(canonical).collect::<Vec<_>>().join(",")
        ),
        Value::Mapping(map) => {
            let mut entries: Vec<(String, String)> = map
                .iter()
                .map(|(k, v)| (canonical(k), canonical(v)))
                .collect();
            entries.sort();
            let body: Vec<String> = entries
                .into_iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect();
            format!("{{{}}}", body.join(","))
        }
        Value::Tagged(t) => format!("!{} {}", t.tag, canonical(&t.value)),
    }
}

/// A sha256 over the token table (what the in-process tokenizer check compares).
pub fn vocab_fingerprint(text: &TextModel) -> Vec<u8> {
    let mut h = Sha256::new();
    let n = text.real_vocab_len();
    h.update((n as u64).to_le_bytes());
    let tok = text.tokenizer();
    for id in 0..n as u32 {
        match tok.id_to_token(id) {
            Some(t) => {
                h.update([1u8]);
                h.update((t.len() as u64).to_le_bytes());
                h.update(t.as_bytes());
            }
            None => h.update([0u8]),
        }
    }
    h.finalize().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_yaml_ignores_key_order() {
        let a: serde_yaml::Value = serde_yaml::from_str("{b: 1, a: {y: [1, 2], x: s}}").unwrap();
        let b: serde_yaml::Value = serde_yaml::from_str("{a: {x: s, y: [1, 2]}, b: 1}").unwrap();
        let c: serde_yaml::Value = serde_yaml::from_str("{a: {x: s, y: [2, 1]}, b: 1}").unwrap();
        assert_eq!(canonical(&a), canonical(&b));
        assert_ne!(canonical(&a), canonical(&c));
    }
}
