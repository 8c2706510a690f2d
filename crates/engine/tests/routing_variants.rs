//! The GPU routing benchmark's variants (config/random/routing_variants.json, used by
//! scripts/gpu_routing.py) apply to their base config and mean what their names say: a
//! change to the base that breaks a variant fails here, not silently on the GPU machine.

use std::path::{Path, PathBuf};

use tokenrouter_engine::{EngineConfig, Execution, Threshold};

fn variants_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/random/routing_variants.json")
}

fn config_of(sets: &[String]) -> EngineConfig {
    let file = variants_file();
    let def: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("read variants"))
            .expect("json");
    let base = file
        .parent()
        .expect("dir")
        .join(def["base"].as_str().expect("base"));
    EngineConfig::from_file_with_overrides(&base, sets).expect("variant applies to the base")
}

fn sets(variant: &str, p: f64) -> Vec<String> {
    let def: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(variants_file()).expect("read variants"))
            .expect("json");
    let list: Vec<String> = match variant.strip_prefix("static:") {
        Some(b) => def["static"]
            .as_array()
            .expect("static")
            .iter()
            .map(|s| s.as_str().expect("str").replace("{B}", b))
            .collect(),
        None => def["variants"][variant]
            .as_array()
            .unwrap_or_else(|| panic!("no variant {variant}"))
            .iter()
            .map(|s| s.as_str().expect("str").to_string())
            .collect(),
    };
    std::iter::once(format!("{}={p}", def["rate"].as_str().expect("rate")))
        .chain(list)
        .collect()
}

#[test]
fn every_variant_applies_and_means_its_name() {
    let class = |c: &EngineConfig, i: usize| c.models[i].section.scheduler_class.clone();
    let slm = config_of(&sets("slm_only", 0.35));
    assert_eq!(class(&slm, 0).as_deref(), Some("slm_only"));
    assert_eq!(class(&slm, 1).as_deref(), Some("slm_only"));
    let llm = config_of(&sets("llm_only", 0.35));
    assert_eq!(class(&llm, 0).as_deref(), Some("llm_only"));
    let sync = config_of(&sets("sync", 0.35));
    assert_eq!(sync.system.execution, Execution::Sync);
    let asyn = config_of(&sets("async", 0.2));
    assert_eq!(asyn.system.execution, Execution::Async);
    assert_eq!(
        asyn.models[1].section.delayed_batching_threshold,
        Threshold::Fixed(1)
    );
    let p = asyn.models[0]
        .section
        .scheduler_kwargs
        .get("p")
        .and_then(|v| v.as_f64());
    assert_eq!(p, Some(0.2));
    let delayed = config_of(&sets("delayed", 0.35));
    assert!(matches!(
        delayed.models[1].section.delayed_batching_threshold,
        Threshold::Auto(_)
    ));
    let fixed = config_of(&sets("static:4", 0.35));
    assert_eq!(
        fixed.models[1].section.delayed_batching_threshold,
        Threshold::Fixed(4)
    );
}
