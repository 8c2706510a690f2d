//! A request and its events, to and from the wire's messages. After the first contact a
//! hand-off carries only what the remote copy lacks: the positions both sides surely share
//! (`anchor`), the tokens after them, and the sampler's RNG position.

use crate::request::{EventSink, Req};
use tokenrouter_api::{FinishReason, ModelIndex, RoutingOverrides, SamplingParams, TokenEvent};
use tokenrouter_runtime::Sampler;
use tokenrouter_wire::{pb, rng_pos_bytes, rng_pos_from, unix_ns};

fn sampling_to_pb(s: &SamplingParams) -> pb::Sampling {
    pb::Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as u32,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: s
            .logit_bias
            .iter()
            .map(|&(id, bias)| pb::LogitBias { id, bias })
            .collect(),
        seed: s.seed,
        min_tokens: s.min_tokens as u32,
        allowed_token_ids: s
            .allowed_token_ids
            .as_ref()
            .map(|ids| pb::TokenList { ids: ids.clone() }),
        bad_words: s
            .bad_words
            .iter()
            .map(|ids| pb::TokenList { ids: ids.clone() })
            .collect(),
        penalty_last_n: s.penalty_last_n.map(|n| n.min(u32::MAX as usize) as u32),
        llama_chain: s.llama.as_ref().and_then(|c| serde_json::to_string(c).ok()),
    }
}

fn sampling_from_pb(s: &pb::Sampling) -> Result<SamplingParams, String> {
    let llama = s
        .llama_chain
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| format!("a malformed llama.cpp sampler chain: {e}"))?;
    Ok(SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as usize,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: s.logit_bias.iter().map(|b| (b.id, b.bias)).collect(),
        seed: s.seed,
        min_tokens: s.min_tokens as usize,
        allowed_token_ids: s.allowed_token_ids.as_ref().map(|l| l.ids.clone()),
        bad_words: s.bad_words.iter().map(|l| l.ids.clone()).collect(),
        // u32::MAX stands for "the whole context" (llama.cpp's -1).
        penalty_last_n: s.penalty_last_n.map(|n| match n {
            u32::MAX => usize::MAX,
            n => n as usize,
        }),
        llama,
        // Already turned into `bad_words` by the front end's engine.
        ban_eos: false,
    })
}

/// The hand-off of `req` to a remote whose copy holds `remote_len` positions (None: it has
/// none, so this is a first contact with everything).
pub(crate) fn handoff(req: &Req, remote_len: Option<usize>, seq: u64) -> pb::Handoff {
    let p = req.prompt.len();
    let anchor = remote_len.map(|n| req.common_prefix(n)).unwrap_or(0);
    let out_from = anchor.saturating_sub(p);
    let first = (anchor == 0).then(|| pb::FirstContact {
        prompt_len: p as u32,
        sampling: Some(sampling_to_pb(&req.sampler.config)),
        seed: req.seed,
        max_tokens: req.max_tokens as u32,
        stop_ids: req.stop_ids.clone(),
        pinned: req.pinned.map(|m| m as u32),
        top_logprobs: req.top_logprobs as u32,
        routing: req.routing.0.clone().into_iter().collect(),
        // Since v6 the remote rebuilds the penalties from the tokens.
        counts: Vec::new(),
        prompt_logprobs: req.prompt_logprobs.map(|k| k as u32),
        constraint: req
            .constraint
            .as_ref()
            .and_then(|c| serde_json::to_string(c).ok()),
        priority: req.priority,
        cache_salt: req.cache_salt.clone(),
    });
    pb::Handoff {
        rid: req.rid,
        seq,
        from: req.handed_off.map(|(m, _)| m as u32),
        anchor: anchor as u32,
        tokens: req.tokens_from(anchor),
        sources: req.sources[out_from.min(req.sources.len())..]
            .iter()
            .map(|&s| s as u32)
            .collect(),
        rng_word_pos: rng_pos_bytes(req.sampler.rng_position()),
        sent_unix_ns: unix_ns(),
        first,
    }
}

/// The remote's copy of a request from its first contact.
pub(crate) fn mirror_from_first(h: &pb::Handoff, sink: EventSink) -> Result<Req, String> {
    let first = h
        .first
        .as_ref()
        .ok_or("a first contact without its request state")?;
    let p = first.prompt_len as usize;
    if h.anchor != 0 || p == 0 || p > h.tokens.len() || h.tokens.len() - p != h.sources.len() {
        return Err(format!(
            "malformed first contact: anchor {}, prompt {p}, {} tokens, {} sources",
            h.anchor,
            h.tokens.len(),
            h.sources.len()
        ));
    }
    let sampling = first
        .sampling
        .as_ref()
        .map(sampling_from_pb)
        .transpose()?
        .unwrap_or_default();
    let prompt = h.tokens[..p].to_vec();
    let rng = rng_pos_from(&h.rng_word_pos).map_err(|e| e.to_string())?;
    let sampler = Sampler::restore(sampling, first.seed, &prompt, &h.tokens[p..], rng);
    let mut req = Req::new(
        h.rid,
        prompt,
        sampler,
        first.seed,
        first.max_tokens as usize,
        first.stop_ids.clone(),
        first.pinned.map(|m| m as ModelIndex),
        first.top_logprobs as usize,
        sink,
    )
    .with_routing(RoutingOverrides(
        first.routing.clone().into_iter().collect(),
    ))
    .with_prompt_logprobs(first.prompt_logprobs.map(|k| k as usize));
    req.constraint = match &first.constraint {
        None => None,
        Some(json) => Some(
            serde_json::from_str(json)
                .map_err(|e| format!("a malformed output constraint: {e}"))?,
        ),
    };
    req.priority = first.priority;
    req.cache_salt = first.cache_salt.clone();
    req.set_output(
        h.tokens[p..].to_vec(),
        h.sources.iter().map(|&s| s as ModelIndex).collect(),
    );
    Ok(req)
}

/// Bring a remote copy up to date with a later hand-off.
pub(crate) fn apply_handoff(req: &mut Req, h: &pb::Handoff) -> Result<(), String> {
    let sources: Vec<ModelIndex> = h.sources.iter().map(|&s| s as ModelIndex).collect();
    req.apply_delta(h.anchor as usize, &h.tokens, &sources)?;
    let rng = rng_pos_from(&h.rng_word_pos).map_err(|e| e.to_string())?;
    req.sampler.set_rng_position(rng);
    Ok(())
}

pub(crate) fn token_to_pb(rid: u64, pos: usize, t: &TokenEvent) -> pb::Token {
    pb::Token {
        rid,
        pos: pos as u32,
        id: t.id,
        logprob: t.logprob,
        top: t
            .top_logprobs
            .iter()
            .map(|&(id, logprob)| pb::TopLogprob { id, logprob })
            .collect(),
        router_score: t.router_score,
        source: t.source as u32,
        rank: t.rank,
    }
}

pub(crate) fn token_from_pb(t: &pb::Token) -> TokenEvent {
    TokenEvent {
        id: t.id,
        source: t.source as ModelIndex,
        logprob: t.logprob,
        top_logprobs: t.top.iter().map(|x| (x.id, x.logprob)).collect(),
        router_score: t.router_score,
        rank: t.rank,
    }
}

pub(crate) fn reason_to_pb(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Abort => pb::FinishReason::Abort,
    }
}

pub(crate) fn reason_from_pb(r: i32) -> FinishReason {
    match pb::FinishReason::try_from(r) {
        Ok(pb::FinishReason::Stop) => FinishReason::Stop,
        Ok(pb::FinishReason::Length) => FinishReason::Length,
        _ => FinishReason::Abort,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn req(
        prompt: usize,
    ) -> (
        Req,
        tokio::sync::mpsc::UnboundedReceiver<tokenrouter_api::GenerateEvent>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let p: Vec<u32> = (0..prompt as u32).map(|i| i % 1000).collect();
        let mut c = SamplingParams::greedy();
        c.presence_penalty = 0.5;
        c.logit_bias = vec![(4, -1.5)];
        c.min_tokens = 4;
        c.allowed_token_ids = Some(vec![11, 12, 13, 14, 15]);
        c.bad_words = vec![vec![12, 12], vec![7]];
        c.penalty_last_n = Some(4);
        // llama.cpp's chain travels as it is (v7), DRY's breakers as text.
        c.llama = Some(tokenrouter_api::LlamaChain {
            xtc_probability: 0.25,
            dry: Some(tokenrouter_api::DryParams {
                multiplier: 0.8,
                base: 1.75,
                allowed_length: 2,
                penalty_last_n: Some(32),
                sequence_breakers: vec!["\n".into(), "*".into()],
            }),
            ..Default::default()
        });
        let s = Sampler::new(c, 9, &p);
        (Req::new(3, p, s, 9, 100, vec![2], None, 0, tx), rx)
    }

    fn tok(id: u32, source: ModelIndex) -> TokenEvent {
        TokenEvent {
            id,
            source,
            logprob: 0.0,
            top_logprobs: vec![],
            router_score: None,
            rank: None,
        }
    }

    #[test]
    fn a_first_contact_rebuilds_the_request_and_deltas_keep_it_equal() {
        let (mut front, _rx) = req(5);
        front.priority = -7;
        front.cache_salt = Some("tenant".into());
        front.push_token(tok(11, 0));
        front.push_token(tok(12, 0));
        let first = handoff(&front, None, 1);
        assert!(first.first.is_some());
        let (ptx, _prx) = tokio::sync::mpsc::unbounded_channel();
        let sink = EventSink::Peer {
            out: ptx,
            cancelled: Default::default(),
        };
        let mut copy = mirror_from_first(&first, sink).unwrap();
        assert_eq!(
            (copy.prompt.clone(), copy.output.clone()),
            (front.prompt.clone(), front.output.clone())
        );
        assert_eq!(copy.sampler.counts(), front.sampler.counts());
        assert_eq!(copy.sampler.config, front.sampler.config);
        assert_eq!(copy.banned_now(), front.banned_now());
        assert_eq!(copy.priority, -7);
        assert_eq!(copy.cache_salt.as_deref(), Some("tenant"));
        // Back at the front: the remote wrote one token, the front dropped it and wrote two.
        copy.push_token(tok(13, 1));
        front.push_token(tok(13, 1));
        front.mark_returned();
        let remote_len = front.total_len();
        front.drop_last(1);
        front.push_token(tok(14, 0));
        front.push_token(tok(15, 0));
        let delta = handoff(&front, Some(remote_len), 2);
        assert!(delta.first.is_none());
        assert_eq!(delta.anchor as usize, remote_len - 1);
        assert_eq!(delta.tokens, vec![14, 15]);
        apply_handoff(&mut copy, &delta).unwrap();
        assert_eq!(copy.output, front.output);
        assert_eq!(copy.sources, front.sources);
        assert_eq!(copy.sampler.counts(), front.sampler.counts());
    }

    #[test]
    fn a_delta_after_first_contact_has_a_constant_size() {
        let size = |prompt: usize| {
            let (mut r, _rx) = req(prompt);
            for i in 0..40 {
                r.push_token(tok(100 + i, 0));
            }
            r.mark_returned();
            let len = r.total_len();
            r.push_token(tok(7, 0));
            let mut h = handoff(&r, Some(len), 12345);
            h.sent_unix_ns = 0;
            h.encoded_len()
        };
        let (short, long) = (size(20), size(2000));
        assert!(long <= short + 4, "{short} bytes vs {long} bytes");
        let (r, _rx) = req(2000);
        assert!(handoff(&r, None, 1).encoded_len() >= 2000);
    }
}
