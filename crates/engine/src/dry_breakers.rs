//! DRY's sequence breakers in the served vocabulary: a request names them as text
//! (llama.cpp's `dry_sequence_breakers`, newline, colon, quote and asterisk by default);
//! the sampler needs the token sequences that spell them. Finding them reads every token
//! of the vocabulary, so each list is resolved once and kept (the front engine and each
//! remote sub-server host resolve with their own copy of the shared tokenizer).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokenrouter_api::SamplingParams;
use tokenrouter_grammar::LazyCompiler;
use tokenrouter_runtime::sampling::DryBreakers;

/// Lists kept at most; past it the cache starts again (clients send few distinct lists).
const KEPT: usize = 64;

#[derive(Default)]
pub(crate) struct DryTables {
    resolved: Mutex<HashMap<Vec<String>, Arc<DryBreakers>>>,
}

impl DryTables {
    /// The breakers of a request whose sampling runs DRY (`None` for the others), in the
    /// vocabulary of `compiler` (`None` while the models load).
    pub(crate) fn for_sampling(
        &self,
        sampling: &SamplingParams,
        compiler: Option<&LazyCompiler>,
    ) -> Result<Option<Arc<DryBreakers>>, String> {
        let Some(dry) = sampling
            .llama
            .as_ref()
            .and_then(|c| c.dry.as_ref())
            .filter(|d| d.is_active() && !d.sequence_breakers.is_empty())
        else {
            return Ok(None);
        };
        let texts = &dry.sequence_breakers;
        if let Some(found) = self.lock().get(texts) {
            return Ok(Some(found.clone()));
        }
        let compiler = compiler.ok_or("the models are still loading")?;
        let table = compiler.get().map_err(|e| e.to_string())?;
        let breakers = Arc::new(DryBreakers::resolve(
            texts,
            table.vocab_len(),
            |id| table.token_bytes(id),
            |text| compiler.encode_plain(text),
        ));
        let mut kept = self.lock();
        if kept.len() >= KEPT {
            kept.clear();
        }
        kept.insert(texts.clone(), breakers.clone());
        Ok(Some(breakers))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<String>, Arc<DryBreakers>>> {
        // A panic elsewhere while holding it leaves a usable map.
        self.resolved.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenrouter_api::{DryParams, LlamaChain};
    use tokenrouter_runtime::TextModel;

    fn with_breakers(breakers: &[&str], multiplier: f32) -> SamplingParams {
        SamplingParams {
            llama: Some(LlamaChain {
                dry: Some(DryParams {
                    multiplier,
                    base: DryParams::BASE,
                    allowed_length: 2,
                    penalty_last_n: None,
                    sequence_breakers: breakers.iter().map(|s| s.to_string()).collect(),
                }),
                ..LlamaChain::default()
            }),
            ..SamplingParams::default()
        }
    }

    #[test]
    fn breakers_are_found_in_the_served_vocabulary_once() {
        let text = TextModel::synthetic(300).unwrap();
        let compiler = LazyCompiler::new(
            text.tokenizer().clone(),
            text.vocab_len(),
            text.eos_ids().to_vec(),
        );
        let tables = DryTables::default();
        let sampling = with_breakers(&[" ", "\n"], 0.8);
        let found = tables
            .for_sampling(&sampling, Some(&compiler))
            .unwrap()
            .unwrap();
        for s in [" ", "\n"] {
            let ids = text.encode(s).unwrap();
            assert_eq!(ids.len(), 1, "{s:?}");
            assert!(found.breaks_alone(ids[0]), "{s:?}");
        }
        let other = text.encode("x").unwrap()[0];
        assert!(!found.breaks_alone(other));
        // Resolved once: the same table for the same texts.
        let again = tables.for_sampling(&sampling, Some(&compiler)).unwrap();
        assert!(Arc::ptr_eq(&found, &again.unwrap()));
        // No DRY, DRY off, or no breakers: nothing to find (the vocabulary is not needed).
        for s in [
            SamplingParams::default(),
            with_breakers(&[" "], 0.0),
            with_breakers(&[], 0.8),
        ] {
            assert!(tables.for_sampling(&s, None).unwrap().is_none());
        }
        // DRY on before the models are loaded (nothing resolved yet): told.
        assert!(DryTables::default().for_sampling(&sampling, None).is_err());
    }
}
