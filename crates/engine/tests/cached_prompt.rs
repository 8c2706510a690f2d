//! The prompt tokens a request's first model takes from its prefix cache, as the engine
//! tells its client (`GenerateEvent::PromptCached`, OpenAI's `cached_tokens`): whole
//! 16-token blocks of an earlier request's prompt, never the last position, counted where
//! the request starts (the entry model, or the model it is pinned to). A flush
//! (`Backend::flush_cache`) forgets every model's cache. A `cache_salt` keeps a request to
//! the blocks of requests with the same salt (vLLM's).

mod common;

use common::{greedy_request, pair, prompt, start};
use tokenrouter_api::{Backend, GenerateEvent, GenerateRequest};
use tokenrouter_engine::Engine;

/// Runs `pinned`'s request to its end: the cached count told and the tokens.
async fn cached_and_tokens(e: &Engine, ids: &[u32], pinned: Option<usize>) -> (usize, Vec<u32>) {
    let (cached, tokens, _) = cached_tokens_sources(e, ids, pinned, 1).await;
    (cached, tokens)
}

/// The cached count (told once, before any token), the tokens and their sources.
async fn cached_tokens_sources(
    e: &Engine,
    ids: &[u32],
    pinned: Option<usize>,
    seed: u64,
) -> (usize, Vec<u32>, Vec<usize>) {
    let mut req = greedy_request(ids.to_vec(), 6);
    req.pinned_model = pinned;
    // The routing decisions follow the request's seed.
    req.sampling.seed = Some(seed);
    run_told(e, req).await
}

/// Runs `req` to its end: the cached count (told once, before any token), the tokens and
/// their sources.
async fn run_told(e: &Engine, req: GenerateRequest) -> (usize, Vec<u32>, Vec<usize>) {
    let mut s = e.submit(req).unwrap();
    let (mut cached, mut tokens, mut sources) = (None, Vec::new(), Vec::new());
    while let Some(ev) = s.events.recv().await {
        match ev {
            GenerateEvent::PromptCached(n) => {
                assert!(tokens.is_empty(), "told after a token");
                assert!(cached.replace(n).is_none(), "told twice");
            }
            GenerateEvent::Token(t) => {
                tokens.push(t.id);
                sources.push(t.source);
            }
            GenerateEvent::Finished { .. } => break,
            GenerateEvent::Error(m) => panic!("request failed: {m}"),
            GenerateEvent::Prompt(_) => panic!("prompt scores were not asked for"),
        }
    }
    (cached.expect("the cached count is told"), tokens, sources)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reports_its_cached_blocks_at_the_first_model() {
    let (_pair, e) = common::routed_pair();
    let ids = prompt(40, 7);
    let (first, answer) = cached_and_tokens(&e, &ids, None).await;
    assert_eq!(first, 0, "nothing is cached yet");
    // Two whole blocks of the 39 positions before the last.
    let (again, repeated) = cached_and_tokens(&e, &ids, None).await;
    assert_eq!((again, &repeated), (32, &answer));
    // Where the large model rewrites the first token, the request reaches it with no
    // output: the count told is still the entry model's, once.
    let mut rewritten_first = 0;
    for salt in 20..40 {
        let (cached, _, sources) =
            cached_tokens_sources(&e, &prompt(40, salt), None, salt.into()).await;
        assert_eq!(cached, 0);
        rewritten_first += usize::from(sources[0] == 1);
    }
    assert!(rewritten_first > 0, "no first token was the large model's");
    // A prompt sharing the first block only.
    let mut other = ids.clone();
    other[20] += 1;
    assert_eq!(cached_and_tokens(&e, &other, None).await.0, 16);

    // Pinned to the large model: its own cache counts, not the entry model's.
    let fresh = prompt(40, 9);
    assert_eq!(cached_and_tokens(&e, &fresh, Some(1)).await.0, 0);
    assert_eq!(cached_and_tokens(&e, &fresh, Some(1)).await.0, 32);
    assert_eq!(cached_and_tokens(&e, &fresh, Some(0)).await.0, 0);

    // A flush: the next request on either model reuses nothing, and caches anew.
    e.flush_cache().unwrap();
    for model in [Some(1), None] {
        let (cached, tokens) = cached_and_tokens(&e, &fresh, model).await;
        assert_eq!(cached, 0, "{model:?}");
        assert_eq!(cached_and_tokens(&e, &fresh, model).await, (32, tokens));
    }
    e.shutdown();
    assert!(e.flush_cache().is_err(), "a stopped engine says so");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_prefix_caching_nothing_is_told() {
    let p = pair();
    let file = common::config_file(&p, "random", "{p: 0.5, seed: 3}", "random", "", "async");
    let yaml = std::fs::read_to_string(&file).unwrap();
    let yaml = yaml.replace(
        "kv_cache_tokens: 8192\n",
        "kv_cache_tokens: 8192\n    prefix_cache: false\n",
    );
    std::fs::write(&file, yaml).unwrap();
    let e = start(tokenrouter_engine::EngineConfig::from_file(&file).unwrap());
    let ids = prompt(40, 7);
    for _ in 0..2 {
        let mut s = e.submit(greedy_request(ids.clone(), 4)).unwrap();
        while let Some(ev) = s.events.recv().await {
            match ev {
                GenerateEvent::PromptCached(n) => panic!("told {n} cached tokens"),
                GenerateEvent::Finished { .. } => break,
                GenerateEvent::Error(m) => panic!("request failed: {m}"),
                _ => {}
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_salt_shares_blocks_only_within_the_salt() {
    let (_pair, e) = common::routed_pair();
    let ids = prompt(40, 11);
    let salted = |salt: Option<&str>| {
        let mut req = greedy_request(ids.clone(), 4);
        req.cache_salt = salt.map(str::to_string);
        req
    };
    let cached = |req| async { run_told(&e, req).await.0 };
    assert_eq!(cached(salted(Some("tenant-a"))).await, 0);
    assert_eq!(
        cached(salted(Some("tenant-a"))).await,
        32,
        "the same salt shares"
    );
    assert_eq!(
        cached(salted(Some("tenant-b"))).await,
        0,
        "another salt does not"
    );
    assert_eq!(cached(salted(None)).await, 0, "nor does no salt");
    assert_eq!(cached(salted(None)).await, 32);
    assert_eq!(cached(salted(Some("tenant-b"))).await, 32);
}
