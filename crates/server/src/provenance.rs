//! Counts which model wrote each token of a response and how often a choice switched
//! between models: the `tokenrouter` extension object (per-token provenance is the point
//! of token-level routing, so every response reports it).

use std::collections::BTreeMap;

use crate::choice::OutToken;
use crate::openai::response::Provenance;

/// Accumulates provenance over the choices of one response, delta by delta.
#[derive(Debug)]
pub struct ProvenanceCounter {
    names: Vec<String>,
    by_model: Vec<usize>,
    /// Source of the last token seen, per choice index.
    last_source: BTreeMap<usize, usize>,
    switches: usize,
}

impl ProvenanceCounter {
    /// `names`: configured model names by model index.
    pub fn new(names: Vec<String>) -> Self {
        let by_model = vec![0; names.len()];
        Self {
            names,
            by_model,
            last_source: BTreeMap::new(),
            switches: 0,
        }
    }

    pub fn add(&mut self, choice: usize, tokens: &[OutToken]) {
        for token in tokens {
            if token.event.source >= self.by_model.len() {
                self.by_model.resize(token.event.source + 1, 0);
            }
            self.by_model[token.event.source] += 1;
            if let Some(prev) = self.last_source.insert(choice, token.event.source) {
                if prev != token.event.source {
                    self.switches += 1;
                }
            }
        }
    }

    pub fn completion_tokens(&self) -> usize {
        self.by_model.iter().sum()
    }

    pub fn snapshot(&self) -> Provenance {
        let tokens_by_model = self
            .by_model
            .iter()
            .enumerate()
            .map(|(i, &count)| (source_name(&self.names, i), count))
            .collect();
        Provenance {
            tokens_by_model,
            switches: self.switches,
        }
    }
}

/// Display name of model `index` (a stable placeholder if the engine reports an index
/// outside the configured models).
pub fn source_name(names: &[String], index: usize) -> String {
    names
        .get(index)
        .cloned()
        .unwrap_or_else(|| format!("model{index}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenrouter_api::TokenEvent;

    fn toks(sources: &[usize]) -> Vec<OutToken> {
        sources
            .iter()
            .map(|&source| OutToken {
                event: TokenEvent {
                    id: 0,
                    source,
                    logprob: 0.0,
                    top_logprobs: vec![],
                    router_score: None,
                    rank: None,
                },
                text_offset: 0,
            })
            .collect()
    }

    #[test]
    fn counts_tokens_and_switches_per_choice_across_deltas() {
        let mut p = ProvenanceCounter::new(vec!["quick".into(), "reference".into()]);
        p.add(0, &toks(&[0, 0, 1]));
        p.add(1, &toks(&[1, 1]));
        p.add(0, &toks(&[1, 0])); // continues choice 0 from source 1: one switch (1 -> 0)
        let snap = p.snapshot();
        assert_eq!(snap.tokens_by_model["quick"], 3);
        assert_eq!(snap.tokens_by_model["reference"], 4);
        assert_eq!(snap.switches, 2);
        assert_eq!(p.completion_tokens(), 7);
    }

    #[test]
    fn unknown_source_index_gets_a_placeholder_name() {
        let mut p = ProvenanceCounter::new(vec!["quick".into()]);
        p.add(0, &toks(&[2]));
        assert_eq!(p.snapshot().tokens_by_model["model2"], 1);
        assert_eq!(p.snapshot().tokens_by_model["quick"], 0);
    }
}
