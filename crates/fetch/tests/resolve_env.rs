//! `resolve_model` reading its configuration from the process environment (HF_HUB_CACHE,
//! HF_ENDPOINT, TOKENROUTER_CACHE). One test per binary, because it sets variables.

mod common;

use std::fs;
use std::os::unix::fs::symlink;
use std::time::{Duration, Instant};

use tokenrouter_fetch::{
    default_cache_dir, hub_cache_dir, resolve_model, FetchError, ModelLocation,
};

#[test]
fn environment_drives_cache_and_endpoint() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hub = tmp.path().join("hub");
    let endpoint = common::closed_port_url();
    std::env::set_var("HF_HUB_CACHE", &hub);
    std::env::set_var("HF_ENDPOINT", &endpoint);
    std::env::set_var("TOKENROUTER_CACHE", tmp.path().join("tr"));
    std::env::remove_var("HF_HUB_OFFLINE");
    std::env::remove_var("TOKENROUTER_OFFLINE");
    assert_eq!(hub_cache_dir(), hub);
    assert_eq!(default_cache_dir(), tmp.path().join("tr"));

    // A cached GGUF repo is found without any network.
    let repo = hub.join("models--acme--m-GGUF");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    fs::create_dir_all(repo.join("refs")).expect("refs");
    fs::create_dir_all(repo.join("blobs")).expect("blobs");
    fs::create_dir_all(repo.join("snapshots").join(commit)).expect("snap");
    fs::write(repo.join("refs/main"), format!("{commit}\n")).expect("ref");
    fs::write(repo.join("blobs/b1"), b"GGUF\x03\0\0\0").expect("blob");
    symlink(
        "../../blobs/b1",
        repo.join("snapshots").join(commit).join("m.gguf"),
    )
    .expect("link");
    assert_eq!(
        resolve_model("acme/m-GGUF").expect("cached"),
        ModelLocation::Gguf(repo.join("snapshots").join(commit).join("m.gguf"))
    );

    // A missing one fails fast, naming the cache directory and the endpoint.
    let start = Instant::now();
    let err = resolve_model("acme/missing").expect_err("missing");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "took {:?}",
        start.elapsed()
    );
    assert!(matches!(err, FetchError::HubUnreachable { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(
            &hub.join("models--acme--missing/refs/main")
                .display()
                .to_string()
        ),
        "{text}"
    );
    assert!(text.contains(&endpoint), "{text}");
}
