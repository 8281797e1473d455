//! Times `Policy::decide` on the default policy from DESIGN.md. Plain
//! `Instant` timing, no criterion, to keep CI builds light.
//! Run with `cargo bench -p policies`.

use std::hint::black_box;
use std::time::Instant;

use policies::{Policy, Signals};

const POLICY: &str = r#"
policy:
  default: batched
  fallback: [batched]
  rules:
    - name: tools-need-batched
      when: { has_tools: true }
      route: batched
    - name: long-context
      when: { prompt_tokens: { gte: 8192 } }
      route: batched
    - name: kv-pressure
      when: { kv_pressure: { gt: 0.85 } }
      route: batched
    - name: alone-and-greedy
      when: { greedy: true, total_active: { eq: 0 } }
      route: fastpath
    - name: speculate-when-quiet
      when: { all: [ { greedy: true }, { engine_active.dflash: { lt: 4 } }, { not: { engine_accept_rate.dflash: { lt: 0.3 } } } ] }
      route: dflash
"#;

const ITERS: u32 = 1_000_000;

fn signals(greedy: bool, has_tools: bool, total_active: u64, dflash_active: u64) -> Signals {
    let mut s = Signals {
        prompt_tokens: 900,
        max_tokens: 256,
        greedy,
        has_tools,
        total_active,
        kv_pressure: 0.4,
        model: "qwen3".into(),
        ..Signals::default()
    };
    for (engine, active) in [
        ("batched", total_active - dflash_active),
        ("fastpath", 0),
        ("dflash", dflash_active),
    ] {
        s.engine_active.insert(engine.into(), active);
        s.engine_queued.insert(engine.into(), 0);
    }
    s.engine_accept_rate.insert("dflash".into(), 0.7);
    s
}

fn time(label: &str, policy: &Policy, s: &Signals) {
    let expected = policy.decide(s).rule;
    let start = Instant::now();
    for _ in 0..ITERS {
        let d = policy.decide(black_box(s));
        black_box(d.engine);
    }
    let ns = start.elapsed().as_nanos() as f64 / f64::from(ITERS);
    println!("{label:<36} rule {expected:<22} {ns:>7.1} ns/decision");
}

fn main() {
    let policy = Policy::from_yaml(POLICY, &["batched", "fastpath", "dflash"])
        .expect("bench policy is valid");
    println!("decide() over {ITERS} calls each:");
    time("first rule (tools)", &policy, &signals(false, true, 3, 0));
    time(
        "fourth rule (alone and greedy)",
        &policy,
        &signals(true, false, 0, 0),
    );
    time(
        "fifth rule (speculate, map lookups)",
        &policy,
        &signals(true, false, 2, 2),
    );
    time(
        "no rule matches (default)",
        &policy,
        &signals(false, false, 6, 0),
    );
}
