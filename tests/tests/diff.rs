//! `hopscope diff` on two real recordings of the testbed: the same 3-hop
//! chain, once with the prefix cache and once without. Hops 2-3 re-send the
//! previous hops' prompt; with the cache they compute only the new tokens,
//! without it they prefill everything. The diff must say so: TTFT up, prefill
//! the dominant phase, fewer cached tokens the cause, and the phase deltas
//! adding up to the E2E delta. And a JSON hop whose grammar compiles longer
//! while another agent's hops go past it: the scheduler skipped it.

use hopscope_integration::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

const CHAIN: &[&str] = &["--chains", "1", "--hops", "3", "--max-tokens", "16", "--task-seed", "1"];

/// Records the testbed under `hopscope run` while the chain client runs once.
fn record(name: &str, serve_args: &[&str]) -> PathBuf {
    record_testbed(name, serve_args, &[CHAIN]).hop
}

fn diff(before: &PathBuf, after: &PathBuf, json: bool) -> String {
    let mut c = Command::new(hopscope_bin());
    c.arg("diff").arg(before).arg(after);
    if json {
        c.arg("--json");
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "diff failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("expected a number, got {v}"))
}

/// Σ of the known phase deltas.
fn phase_sum(phases: &Value, names: &[&str]) -> f64 {
    names.iter().filter_map(|p| phases[*p]["delta"].as_f64()).sum()
}

const ALL: [&str; 6] = ["frontend", "queue", "prefill", "kv_transfer", "first_output", "decode"];

#[test]
fn diff_blames_prefill_and_fewer_cached_tokens_when_the_prefix_cache_is_disabled() {
    let Some(_serial) = privileged("diff_blames_prefill_and_fewer_cached_tokens_when_the_prefix_cache_is_disabled") else { return };
    let before = record("diff-cache", &[]);
    let after = record("diff-nocache", &["--no-prefix-cache"]);

    let text = diff(&before, &after, false);
    eprintln!("{text}");
    let d: Value = serde_json::from_str(&diff(&before, &after, true)).expect("diff --json is json");
    assert_eq!(d["schema"], 1);
    assert!(text.contains(d["headline"].as_str().unwrap()), "the text leads with the JSON's headline");

    // The chain client sends x-session-id: both recordings have one explicit
    // chain, matched hop by hop although the keys differ.
    assert_eq!(d["matching"]["mode"], "chain");
    assert_eq!(d["matching"]["by_chain"], 3, "{}", d["matching"]);
    let chain_pairs: Vec<&Value> = d["pairs"].as_array().unwrap().iter().filter(|p| p["by"] == "chain").collect();
    assert_eq!(chain_pairs.len(), 3);

    // Every matched pair: the phase deltas add up to the E2E delta.
    for p in d["pairs"].as_array().unwrap().iter().filter(|p| p["generation"] == true) {
        let e2e = f(&p["e2e_ms"]["delta"]);
        let sum = phase_sum(&p["phases_ms"], &ALL);
        assert!((sum - e2e).abs() <= 0.01, "{}: Σ phase deltas {sum:.4} ms vs ΔE2E {e2e:.4} ms", p["key"]);
        assert!(f(&p["explain"]["e2e"]["unexplained_ms"]).abs() <= 0.01, "{}", p["key"]);
        eprintln!(
            "{}: ΔTTFT {:+.2} ms, Δprefill {:+.2} ms, ΔE2E {:+.2} ms = Σ phases {:+.2} ms; cached {} -> {}",
            p["key"],
            f(&p["ttft_ms"]["delta"]),
            f(&p["phases_ms"]["prefill"]["delta"]),
            e2e,
            sum,
            p["tokens"]["cached"]["before"],
            p["tokens"]["cached"]["after"]
        );
    }
    // And per hop index and overall, for the means.
    for agg in d["hops"].as_array().unwrap().iter().chain([&d["overall"]]) {
        let e2e = f(&agg["e2e_ms"]["mean"]["delta"]);
        let sum = phase_sum(&agg["phases_ms"], &ALL);
        assert!((sum - e2e).abs() <= 0.01, "hop {}: Σ phase deltas {sum:.4} ms vs mean ΔE2E {e2e:.4} ms", agg["hop"]);
    }

    // Hops 2-3: the cache served most of the prompt before, nothing after.
    let hops = d["hops"].as_array().unwrap();
    assert_eq!(hops.len(), 3);
    for h in &hops[1..] {
        let hop = &h["hop"];
        let t = &h["tokens"];
        assert!(f(&t["cached"]["before"]) > 0.0 && f(&t["cached"]["after"]) == 0.0, "hop {hop}: cached {}", t["cached"]);
        assert!(f(&t["computed"]["delta"]) > 0.0, "hop {hop}: computed {}", t["computed"]);
        let ex = &h["explain"]["ttft"];
        assert!(f(&ex["delta_ms"]) > 0.0, "hop {hop}: TTFT rose: {}", ex["summary"]);
        assert_eq!(ex["dominant_phase"], "prefill", "hop {hop}: {}", ex["summary"]);
        assert_eq!(ex["causes"][0]["cause"], "fewer_cached_tokens", "hop {hop}: {}", ex["summary"]);
        eprintln!("hop {hop}: {}", ex["summary"].as_str().unwrap());
    }
    assert!(text.contains("fewer_cached_tokens"), "{text}");
    assert!(d["kernels"].is_null(), "no GPU in these recordings");
}

/// A JSON agent's first hop waits in vLLM's scheduler for its grammar while
/// a plain agent's hops go past it: compiled in 40 ms before, 1.5 s after
/// (a slower backend, or a schema its cache has not seen). The diff must put
/// the hop's TTFT rise on the scheduler skipping it for its grammar — not on
/// fewer free slots — and, read the other way, on its skipping it less.
#[test]
fn diff_says_the_scheduler_skipped_a_json_hop_longer_for_its_grammar() {
    let Some(_serial) = privileged("diff_says_the_scheduler_skipped_a_json_hop_longer_for_its_grammar") else { return };
    let agents: &[&[&str]] = &[
        &["--chains", "1", "--hops", "2", "--max-tokens", "16", "--task-seed", "1", "--json-schema-hops", "1"],
        // It starts once the JSON hop is in the engine, however long either
        // client took to start, and outlasts the slow compile: its hops go
        // past the JSON hop until its grammar is ready, so the skipped time
        // is nearly all of the wait. 12 hops (~65 ms each here, the first
        // the testbed's cold step) ended ~800 ms into the 1500 and left the
        // skipped share of the extra wait at 0.5 ± noise: flaky in CI.
        &["--chains", "1", "--hops", "32", "--max-tokens", "4", "--task-seed", "2", "--start-after", "{dir}/client-0.started"],
    ];
    let before = record_testbed("diff-grammar-fast", &["--grammar-compile-ms", "40"], agents).hop;
    let after = record_testbed("diff-grammar-slow", &["--grammar-compile-ms", "1500"], agents).hop;
    let text = diff(&before, &after, false);
    eprintln!("{text}");
    let d: Value = serde_json::from_str(&diff(&before, &after, true)).expect("diff --json is json");
    assert_eq!((&d["matching"]["mode"], &d["matching"]["by_chain"]), (&Value::from("chain"), &Value::from(34)), "{}", d["matching"]);
    // Each agent with itself by its opening prompt, whichever started first.
    assert_eq!(d["matching"]["chains_by_opening"], 2, "{}", d["matching"]);
    let json_hop = |d: &Value| -> Value {
        let pairs: Vec<&Value> = d["pairs"].as_array().unwrap().iter().filter(|p| p["structured_output"]["before"] == "json").collect();
        assert_eq!(pairs.len(), 1, "one JSON hop a side: {pairs:?}");
        pairs[0].clone()
    };
    let p = json_hop(&d);
    assert_eq!((&p["hop"], &p["structured_output"]["after"]), (&Value::from(1), &Value::from("json")), "{p}");
    let (sched, passed) = (f(&p["scheduler_queue_ms"]["delta"]), f(&p["scheduler_passed_over_ms"]["delta"]));
    eprintln!("JSON hop 1: scheduler queue {sched:+.2} ms, skipped {passed:+.2} ms");
    // Not the whole 1460 ms: a long step (the testbed's first, on a cold
    // CPU) can hold the hop in the scheduler's queue on both sides.
    assert!(sched > 0.0 && passed >= sched / 2.0, "the compile took 1460 ms more, plain hops went past it meanwhile: {p}");
    let ex = &p["explain"]["ttft"];
    assert_eq!(ex["dominant_phase"], "queue", "{}", ex["summary"]);
    let cause = &ex["causes"][0];
    assert_eq!(cause["cause"], "scheduler_skipped", "{}", ex["summary"]);
    assert!(cause["detail"].as_str().unwrap().contains("for its grammar"), "{cause}");
    assert!(text.contains("the scheduler skipped it (for its grammar"), "the text says so too: {text}");
    // The other way round: skipped less.
    let back: Value = serde_json::from_str(&diff(&after, &before, true)).expect("diff --json is json");
    let ex = &json_hop(&back)["explain"]["ttft"];
    assert_eq!(ex["causes"][0]["cause"], "scheduler_skipped_less", "{}", ex["summary"]);
}
