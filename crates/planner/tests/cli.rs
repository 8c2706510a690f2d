//! The `plan-batching` command line: script-compatible flags, YAML and JSON output.

use clap::Parser;
use tokenrouter_planner::{run, PlanArgs};

const MISSION: [&str; 13] = [
    "plan-batching",
    "--M",
    "2",
    "--N",
    "4",
    "--latencies",
    "6.0",
    "27.9",
    "--P",
    "[[0.65,0.35],[1,0]]",
    "--C",
    "[[1,0],[1,0]]",
    "--delta",
];

fn args(extra: &[&str]) -> PlanArgs {
    let mut argv: Vec<&str> = MISSION.to_vec();
    argv.push("0.1");
    argv.extend_from_slice(extra);
    PlanArgs::try_parse_from(argv).expect("flags parse")
}

#[test]
fn mission_command_prints_the_optimum() {
    let text = run(&args(&[])).expect("run");
    assert!(text.contains("thresholds: [1, 3]"), "{text}");
    // the whole output is valid YAML (the table is made of comments)
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
    assert_eq!(
        doc["thresholds"],
        serde_yaml::to_value(vec![1, 3]).expect("value")
    );
}

#[test]
fn max_concurrency_output_parses_as_yaml_lists() {
    let text = run(&args(&[
        "--max-concurrency",
        "6",
        "--names",
        "quick",
        "reference",
    ]))
    .expect("run");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
    let mut lists = Vec::new();
    for name in ["quick", "reference"] {
        let list: Vec<usize> =
            serde_yaml::from_value(doc["model"][name]["delayed_batching_threshold"].clone())
                .expect("list of integers");
        assert_eq!(list.len(), 6, "{name}: {list:?}");
        assert!(list.iter().all(|&b| (1..=6).contains(&b)));
        lists.push(list);
    }
    assert_eq!(lists[0], vec![1; 6], "{text}");
    assert_eq!(&lists[1][..4], &[1, 2, 2, 3], "{text}");
    // one table row per concurrency
    let rows = text
        .lines()
        .filter(|l| l.starts_with("# ") && l[2..].trim_start().starts_with(char::is_numeric))
        .count();
    assert_eq!(rows, 6, "{text}");
}

#[test]
fn json_output_lists_plans() {
    let text = run(&args(&["--max-concurrency", "3", "--json"])).expect("run");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let plans = v["plans"].as_array().expect("plans");
    assert_eq!(plans.len(), 3);
    assert_eq!(plans[1]["concurrency"], 2);
    assert!(plans[2]["tokens_per_s"].as_f64().expect("number") > 0.0);
    assert_eq!(v["models"], serde_json::json!(["model0", "model1"]));
}

#[test]
fn simulation_column_is_printed_on_request() {
    let text = run(&args(&["--simulate-ticks", "200000"])).expect("run");
    assert!(text.contains("simulated"), "{text}");
}

#[test]
fn bad_flags_are_errors_not_panics() {
    let mut bad = args(&[]);
    bad.routing = "[[0.65,0.3],[1,0]]".into();
    assert!(run(&bad).is_err());
    assert!(run(&args(&["--max-concurrency", "0"])).is_err());
    assert!(run(&args(&["--thresholds", "1"])).is_err());
    assert!(run(&args(&["--names", "only-one"])).is_err());
}
