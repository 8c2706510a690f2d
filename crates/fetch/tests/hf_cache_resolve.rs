//! `resolve_model_with` against a fake Hugging Face hub cache built in a temporary directory
//! (refs → commit, snapshots of symlinks into blobs), plus the fast, descriptive failure when a
//! model is missing and the Hub cannot be reached.

mod common;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::closed_port_url;
use tokenrouter_fetch::{
    resolve_model_with, FetchError, FetchOptions, ModelLocation, ResolveOptions,
};

const COMMIT_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const COMMIT_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/// One snapshot: (ref name, commit, [(file name, contents)]).
type Snapshot<'a> = (&'a str, &'a str, &'a [(&'a str, &'a [u8])]);

/// Builds `models--{org}--{name}` with one snapshot per (ref, commit, files) entry; file
/// contents go to `blobs/` and the snapshot holds relative symlinks, as `huggingface_hub` does.
fn add_repo(root: &Path, repo: &str, snapshots: &[Snapshot]) -> PathBuf {
    let dir = root.join(format!("models--{}", repo.replace('/', "--")));
    fs::create_dir_all(dir.join("blobs")).expect("blobs");
    fs::create_dir_all(dir.join("refs")).expect("refs");
    for (reference, commit, files) in snapshots {
        fs::write(dir.join("refs").join(reference), commit).expect("ref");
        let snap = dir.join("snapshots").join(commit);
        fs::create_dir_all(&snap).expect("snapshot");
        for (i, (name, bytes)) in files.iter().enumerate() {
            let blob = format!("{commit}{i:04}");
            fs::write(dir.join("blobs").join(&blob), bytes).expect("blob");
            let link = snap.join(name);
            let depth = name.matches('/').count();
            fs::create_dir_all(link.parent().expect("parent")).expect("subdir");
            let target = format!("{}../../blobs/{blob}", "../".repeat(depth));
            symlink(target, &link).expect("symlink");
        }
    }
    dir
}

fn options(hf_root: &Path, download: bool) -> ResolveOptions {
    let mut fetch = FetchOptions::from_env_with(|_| None, false);
    fetch.hf_cache_dir = hf_root.to_path_buf();
    fetch.hub_endpoint = Some(closed_port_url());
    fetch.pypi_index = None;
    fetch.connect_timeout = Duration::from_secs(2);
    ResolveOptions {
        fetch,
        cache_dir: hf_root.join("tokenrouter-cache"),
        download,
    }
}

const GGUF: &[u8] = b"GGUF\x03\x00\x00\x00fake";

#[test]
fn gguf_repo_resolves_by_id_file_and_revision() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    let repo = add_repo(
        root,
        "acme/coder-GGUF",
        &[
            (
                "main",
                COMMIT_A,
                &[("coder-q4.gguf", GGUF), ("README.md", b"hi")],
            ),
            (
                "v1",
                COMMIT_B,
                &[("coder-q4.gguf", GGUF), ("coder-q8.gguf", GGUF)],
            ),
        ],
    );
    let opts = options(root, false);
    let snap_a = repo.join("snapshots").join(COMMIT_A);
    let snap_b = repo.join("snapshots").join(COMMIT_B);
    let want_a = ModelLocation::Gguf(snap_a.join("coder-q4.gguf"));
    for spec in [
        "acme/coder-GGUF",
        "acme/coder-GGUF:coder-q4.gguf",
        "acme/coder-GGUF/coder-q4.gguf",
    ] {
        assert_eq!(
            resolve_model_with(spec, &opts).expect(spec),
            want_a,
            "{spec}"
        );
    }
    assert_eq!(
        resolve_model_with("acme/coder-GGUF@v1:coder-q8.gguf", &opts).expect("rev"),
        ModelLocation::Gguf(snap_b.join("coder-q8.gguf"))
    );
    assert_eq!(
        resolve_model_with(&format!("acme/coder-GGUF/coder-q4.gguf@{COMMIT_B}"), &opts)
            .expect("commit"),
        ModelLocation::Gguf(snap_b.join("coder-q4.gguf"))
    );
    // Two GGUFs in the v1 snapshot: the bare id must say which to pick.
    let err = resolve_model_with("acme/coder-GGUF@v1", &opts).expect_err("ambiguous");
    assert!(
        err.to_string().contains("coder-q4.gguf, coder-q8.gguf"),
        "{err}"
    );
    // The resolved path reads through the symlink into the blob.
    assert_eq!(fs::read(want_a.path()).expect("read via symlink"), GGUF);
}

#[test]
fn safetensors_repo_resolves_to_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    let index = br#"{"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}"#;
    let repo = add_repo(
        root,
        "acme/tiny",
        &[(
            "main",
            COMMIT_A,
            &[
                ("config.json", b"{}"),
                ("tokenizer.json", b"{}"),
                ("model.safetensors.index.json", index),
                ("model-00001-of-00002.safetensors", b"\0"),
                ("model-00002-of-00002.safetensors", b"\0"),
            ],
        )],
    );
    let opts = options(root, false);
    assert_eq!(
        resolve_model_with("acme/tiny", &opts).expect("hf dir"),
        ModelLocation::HfDir(repo.join("snapshots").join(COMMIT_A))
    );
    // A dangling shard symlink (blob deleted) means the model is not really cached (and would
    // be downloaded if allowed).
    fs::remove_file(repo.join("blobs").join(format!("{COMMIT_A}0004"))).expect("rm blob");
    let err = resolve_model_with("acme/tiny", &opts).expect_err("incomplete");
    assert!(matches!(err, FetchError::NotCached { .. }), "{err}");
    assert!(
        err.to_string().contains("model-00002-of-00002.safetensors"),
        "{err}"
    );
}

#[test]
fn local_paths_win_over_ids() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("m.gguf");
    fs::write(&file, GGUF).expect("write");
    let opts = options(&tmp.path().join("hf"), false);
    let spec = file.to_str().expect("utf8 path");
    assert_eq!(
        resolve_model_with(spec, &opts).expect("path"),
        ModelLocation::Gguf(file.clone())
    );
    let dir = tmp.path().join("hfdir");
    fs::create_dir_all(&dir).expect("mkdir");
    fs::write(dir.join("config.json"), b"{}").expect("config");
    fs::write(dir.join("model.safetensors"), b"\0").expect("weights");
    assert_eq!(
        resolve_model_with(dir.to_str().expect("utf8"), &opts).expect("dir"),
        ModelLocation::HfDir(dir)
    );
}

#[test]
fn missing_id_with_unreachable_hub_fails_fast_and_names_the_cache() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("hub-cache");
    let opts = options(&root, true);
    let endpoint = opts.fetch.hub_endpoint.clone().expect("endpoint");
    let start = Instant::now();
    let err = resolve_model_with("acme/absent-model:x.gguf", &opts).expect_err("missing");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    assert!(matches!(err, FetchError::HubUnreachable { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(
            &root
                .join("models--acme--absent-model")
                .display()
                .to_string()
        ),
        "{text}"
    );
    assert!(
        text.contains(&endpoint) && text.contains("unreachable"),
        "{text}"
    );
    assert!(
        !root.join("models--acme--absent-model").exists(),
        "nothing may be created on failure"
    );
}
