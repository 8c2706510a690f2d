//! End-to-end checks of the exact solver: hand-computable cases and agreement with Monte-Carlo.

use tokenrouter_planner::{
    optimize, optimize_up_to, simulate, throughput, Latency, PlanError, PlanInput,
};

fn input(
    latencies: &[f64],
    routing: &[&[f64]],
    credits: &[&[f64]],
    delta_ms: f64,
    n: usize,
) -> PlanInput {
    PlanInput {
        latencies: latencies.iter().map(|&l| Latency::Constant(l)).collect(),
        routing: routing.iter().map(|r| r.to_vec()).collect(),
        credits: credits.iter().map(|r| r.to_vec()).collect(),
        delta_ms,
        concurrency: n,
        sharing: 0.0,
    }
}

fn r2r(n: usize) -> PlanInput {
    input(
        &[6.0, 27.9],
        &[&[0.65, 0.35], &[1.0, 0.0]],
        &[&[1.0, 0.0], &[1.0, 0.0]],
        0.1,
        n,
    )
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

fn assert_mc_agrees(input: &PlanInput, thresholds: &[usize], ticks: u64) {
    let exact = throughput(input, thresholds).expect("exact");
    let mc = simulate(input, thresholds, ticks, 7).expect("simulate");
    assert!(
        close(mc, exact, 0.01),
        "B={thresholds:?}: exact {exact} vs Monte-Carlo {mc}"
    );
}

#[test]
fn one_model_is_n_tokens_per_rounded_step() {
    // 27.94 ms at δ = 0.1 rounds to 279 ticks = 27.9 ms; 2 tokens credited per request per step.
    let p = input(&[27.94], &[&[1.0]], &[&[2.0]], 0.1, 5);
    for b in 1..=5 {
        let x = throughput(&p, &[b]).expect("solve");
        let expect = 5.0 * 2.0 / 27.9 * 1000.0;
        assert!(close(x, expect, 1e-12), "B={b}: {x} vs {expect}");
    }
    // δ larger than the latency: a step still lasts one tick.
    let p = input(&[0.2], &[&[1.0]], &[&[1.0]], 0.5, 3);
    assert!(close(throughput(&p, &[1]).expect("solve"), 6000.0, 1e-12));
}

#[test]
fn without_routing_the_second_model_is_never_used() {
    let p = input(
        &[6.0, 27.9],
        &[&[1.0, 0.0], &[0.0, 1.0]],
        &[&[1.0, 0.0], &[0.0, 1.0]],
        0.1,
        4,
    );
    let x = throughput(&p, &[1, 3]).expect("solve");
    assert!(close(x, 4.0 / 6.0 * 1000.0, 1e-12), "{x}");
}

#[test]
fn deterministic_alternation_between_two_models() {
    // every step moves the request to the other model: 2 tokens per L0 + L1
    let p = input(
        &[5.0, 15.0],
        &[&[0.0, 1.0], &[1.0, 0.0]],
        &[&[0.0, 1.0], &[1.0, 0.0]],
        0.5,
        1,
    );
    let x = throughput(&p, &[1, 1]).expect("solve");
    assert!(close(x, 2.0 / 20.0 * 1000.0, 1e-12), "{x}");
    // two requests travel together
    let x = throughput(&p.with_concurrency(2), &[1, 2]).expect("solve");
    assert!(close(x, 4.0 / 20.0 * 1000.0, 1e-12), "{x}");
}

#[test]
fn three_model_ring_is_hand_checkable() {
    let p = input(
        &[2.0, 3.0, 5.0],
        &[&[0.0, 1.0, 0.0], &[0.0, 0.0, 1.0], &[1.0, 0.0, 0.0]],
        &[&[1.0; 3], &[1.0; 3], &[1.0; 3]],
        0.1,
        1,
    );
    let x = throughput(&p, &[1, 1, 1]).expect("solve");
    assert!(close(x, 3.0 / 10.0 * 1000.0, 1e-12), "{x}");
}

#[test]
fn mission_example_optimum() {
    let plan = optimize(&r2r(4)).expect("plan");
    assert_eq!(plan.thresholds, vec![1, 3]);
    assert!(plan.tokens_per_s > plan.baseline_tokens_per_s * 1.05);
    let b1 = throughput(&r2r(4), &[1, 1]).expect("solve");
    assert!(close(plan.baseline_tokens_per_s, b1, 1e-12));
}

#[test]
fn exact_matches_monte_carlo_r2r() {
    assert_mc_agrees(&r2r(4), &[1, 3], 20_000_000);
    assert_mc_agrees(&r2r(5), &[2, 2], 20_000_000);
}

#[test]
fn exact_matches_monte_carlo_batch_dependent_latency_and_self_loops() {
    let mut p = input(
        &[6.0, 27.9],
        &[&[0.7, 0.3], &[0.4, 0.6]],
        &[&[1.0, 0.0], &[1.0, 1.0]],
        0.1,
        6,
    );
    p.latencies = vec![
        Latency::ByBatch(vec![6.0, 6.2, 6.5, 7.0]),
        Latency::ByBatch(vec![27.9, 28.4, 29.3]),
    ];
    assert_mc_agrees(&p, &[1, 2], 20_000_000);
}

#[test]
fn exact_matches_monte_carlo_with_simultaneous_completions() {
    // equal step lengths: both models finish in the same tick all the time
    let p = input(
        &[1.0, 1.0],
        &[&[0.5, 0.5], &[0.3, 0.7]],
        &[&[1.0, 2.0], &[0.5, 1.0]],
        0.5,
        3,
    );
    assert_mc_agrees(&p, &[1, 2], 5_000_000);
    assert_mc_agrees(&p, &[2, 2], 5_000_000);
}

#[test]
fn thresholds_that_would_deadlock_still_make_progress() {
    let p = input(
        &[2.0, 4.0],
        &[&[0.5, 0.5], &[0.5, 0.5]],
        &[&[1.0; 2], &[1.0; 2]],
        1.0,
        4,
    );
    let x = throughput(&p, &[3, 3]).expect("solve");
    assert!(x > 0.0);
    assert_mc_agrees(&p, &[3, 3], 5_000_000);
}

#[test]
fn three_models_agree_with_monte_carlo_and_optimize() {
    let p = input(
        &[6.0, 15.0, 27.9],
        &[&[0.6, 0.25, 0.15], &[0.7, 0.2, 0.1], &[1.0, 0.0, 0.0]],
        &[&[1.0, 0.0, 0.0], &[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]],
        0.1,
        3,
    );
    assert_mc_agrees(&p, &[1, 2, 2], 20_000_000);
    let plan = optimize(&p).expect("plan");
    assert_eq!(plan.thresholds.len(), 3);
    assert!(plan.tokens_per_s >= plan.baseline_tokens_per_s);
    let again = throughput(&p, &plan.thresholds).expect("solve");
    assert!(close(again, plan.tokens_per_s, 1e-12));
}

#[test]
fn optimize_up_to_matches_single_optimizations() {
    let plans = optimize_up_to(&r2r(1), 5).expect("plans");
    assert_eq!(plans.len(), 5);
    for plan in &plans {
        let single = optimize(&r2r(plan.concurrency)).expect("plan");
        assert_eq!(&single, plan);
    }
    // the reference config's list starts [1, 2, 2, 3] for the LLM
    let llm: Vec<usize> = plans.iter().map(|p| p.thresholds[1]).collect();
    assert_eq!(&llm[..4], &[1, 2, 2, 3]);
    // with concurrency 1 there is nothing to batch
    assert_eq!(plans[0].thresholds, vec![1, 1]);
}

#[test]
fn sixteen_requests_full_search() {
    // the exhaustive N = 16 search (256 chains) takes well under a second, even in debug builds
    let plan = optimize(&r2r(16)).expect("plan");
    assert!(plan.tokens_per_s > plan.baseline_tokens_per_s);
    let b = plan.thresholds[1];
    assert!((5..=16).contains(&b), "{:?}", plan.thresholds);
}

#[test]
fn invalid_inputs_are_rejected() {
    let mut p = r2r(4);
    p.routing[0] = vec![0.5, 0.4];
    assert!(matches!(
        throughput(&p, &[1, 1]),
        Err(PlanError::RoutingRowSum { .. })
    ));
    assert!(matches!(
        simulate(&p, &[1, 1], 10, 1),
        Err(PlanError::RoutingRowSum { .. })
    ));
    assert!(matches!(
        optimize(&r2r(0)),
        Err(PlanError::BadConcurrency(0))
    ));
}

#[test]
fn sharing_changes_nothing_when_one_model_is_busy_at_a_time() {
    let mut p = input(
        &[5.0, 15.0],
        &[&[0.0, 1.0], &[1.0, 0.0]],
        &[&[0.0, 1.0], &[1.0, 0.0]],
        0.5,
        2,
    );
    let alone = throughput(&p, &[1, 2]).expect("solve");
    p.sharing = 1.0;
    assert!(close(throughput(&p, &[1, 2]).expect("solve"), alone, 1e-12));
}

#[test]
fn exact_matches_monte_carlo_with_a_shared_processor() {
    let mut p = r2r(4);
    p.sharing = 1.0;
    assert_mc_agrees(&p, &[1, 1], 20_000_000);
    assert_mc_agrees(&p, &[1, 3], 20_000_000);
    p.sharing = 0.5;
    assert_mc_agrees(&p, &[2, 2], 20_000_000);
    // Contention only slows things down (not at all with B = N: the models never overlap).
    for b in 1..=4 {
        let (shared, separate) = (throughput(&p, &[1, b]), throughput(&r2r(4), &[1, b]));
        let (shared, separate) = (shared.expect("solve"), separate.expect("solve"));
        if b < 4 {
            assert!(shared < separate, "B={b}: {shared} vs {separate}");
        } else {
            assert!(
                close(shared, separate, 1e-12),
                "B={b}: {shared} vs {separate}"
            );
        }
    }
}

#[test]
fn a_shared_processor_favours_batching_the_large_model() {
    // Solo CPU latencies of a 0.5B / 1.5B pair: the small model's steps grow ~linearly with the
    // batch, the large model's barely. On separate devices B = 1 is best; on one shared
    // processor every large-model step also slows the small model, so batching wins.
    let slm = vec![30.0, 54.0, 78.0, 102.0];
    let llm = vec![50.0, 56.0, 62.0, 68.0];
    let mut p = PlanInput {
        latencies: vec![Latency::ByBatch(slm), Latency::ByBatch(llm)],
        routing: vec![vec![0.7, 0.3], vec![1.0, 0.0]],
        credits: vec![vec![1.0, 0.0], vec![1.0, 0.0]],
        delta_ms: 1.5,
        concurrency: 4,
        sharing: 0.0,
    };
    let separate = tokenrouter_planner::optimize_pinned(&p, &[Some(1), None]).expect("plan");
    assert_eq!(separate.thresholds, vec![1, 1]);
    p.sharing = 1.0;
    let shared = tokenrouter_planner::optimize_pinned(&p, &[Some(1), None]).expect("plan");
    assert!(shared.thresholds[1] > 1, "{:?}", shared.thresholds);
    assert!(shared.tokens_per_s > shared.baseline_tokens_per_s * 1.05);
}
