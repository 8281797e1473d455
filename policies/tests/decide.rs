//! `decide()` against independent reference evaluations: a hand-written
//! if-chain for the design's policy over an enumerated signal grid, and a
//! direct interpreter of the YAML for randomly generated policies.

use policies::{Decision, Policy, Signals};
use serde_yaml::Value;

const ENGINES: &[&str] = &["batched", "fastpath", "dflash", "mtp"];

const DESIGN_POLICY: &str = r#"
policy:
  default: batched
  fallback: [batched]
  rules:
    - name: tools-need-batched
      when: { has_tools: true }
      route: batched
      fallback: []
    - name: long-context
      when: { prompt_tokens: { gte: 8192 } }
      route: batched
    - name: kv-pressure
      when: { kv_pressure: { gt: 0.85 } }
      route: batched
    - name: alone-and-greedy
      when: { greedy: true, total_active: { eq: 0 } }
      route: fastpath
      fallback: [dflash, batched, fastpath, dflash]
    - name: speculate-when-quiet
      when: { all: [ { greedy: true }, { engine_active.dflash: { lt: 4 } }, { not: { engine_accept_rate.dflash: { lt: 0.3 } } } ] }
      route: dflash
    - name: small-models-short
      when: { model: { in: [tiny, small] }, max_tokens: { lte: 64 } }
      route: mtp
      fallback: [fastpath, batched]
    - name: images-or-queue
      when: { any: [ { has_images: true }, { total_queued: { gt: 0 } } ] }
      route: batched
"#;

fn design() -> Policy {
    Policy::from_yaml(DESIGN_POLICY, ENGINES).unwrap()
}

/// The design policy written out by hand: (engine, rule, chain).
fn reference(s: &Signals) -> (&'static str, &'static str, &'static [&'static str]) {
    let dflash_active = s.engine_active.get("dflash").copied().unwrap_or(0);
    let rate_known_bad = matches!(s.engine_accept_rate.get("dflash"), Some(r) if *r < 0.3);
    if s.has_tools {
        ("batched", "tools-need-batched", &["batched"])
    } else if s.prompt_tokens >= 8192 {
        ("batched", "long-context", &["batched"])
    } else if s.kv_pressure > 0.85 {
        ("batched", "kv-pressure", &["batched"])
    } else if s.greedy && s.total_active == 0 {
        (
            "fastpath",
            "alone-and-greedy",
            &["fastpath", "dflash", "batched"],
        )
    } else if s.greedy && dflash_active < 4 && !rate_known_bad {
        ("dflash", "speculate-when-quiet", &["dflash", "batched"])
    } else if (s.model == "tiny" || s.model == "small") && s.max_tokens <= 64 {
        ("mtp", "small-models-short", &["mtp", "fastpath", "batched"])
    } else if s.has_images || s.total_queued > 0 {
        ("batched", "images-or-queue", &["batched"])
    } else {
        ("batched", "default", &["batched"])
    }
}

fn check(d: &Decision<'_>, engine: &str, rule: &str, chain: &[&str]) {
    assert_eq!(d.engine, engine);
    assert_eq!(d.rule, rule);
    assert_eq!(d.chain(), chain);
    assert_eq!(d.fallback, &chain[1..]);
}

#[test]
fn design_policy_matches_reference_over_signal_grid() {
    let policy = design();
    let mut seen_rules = std::collections::BTreeSet::new();
    let mut cases = 0;
    for greedy in [false, true] {
        for has_tools in [false, true] {
            for has_images in [false, true] {
                for total_active in [0, 1, 5] {
                    for total_queued in [0, 1] {
                        for prompt_tokens in [0, 8191, 8192, 8193] {
                            for kv_pressure in [0.0, 0.85, 0.850_001, 1.0] {
                                for dflash_active in [None, Some(0), Some(3), Some(4), Some(10)] {
                                    for rate in
                                        [None, Some(0.0), Some(0.2999), Some(0.3), Some(0.9)]
                                    {
                                        for model in ["tiny", "big"] {
                                            for max_tokens in [64, 65] {
                                                let mut s = Signals {
                                                    prompt_tokens,
                                                    max_tokens,
                                                    greedy,
                                                    has_tools,
                                                    has_images,
                                                    total_active,
                                                    total_queued,
                                                    kv_pressure,
                                                    model: model.into(),
                                                    ..Signals::default()
                                                };
                                                if let Some(a) = dflash_active {
                                                    s.engine_active.insert("dflash".into(), a);
                                                }
                                                if let Some(r) = rate {
                                                    s.engine_accept_rate.insert("dflash".into(), r);
                                                }
                                                let (engine, rule, chain) = reference(&s);
                                                check(&policy.decide(&s), engine, rule, chain);
                                                seen_rules.insert(rule);
                                                cases += 1;
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 2 * 2 * 3 * 2 * 4 * 4 * 5 * 5 * 2 * 2);
    // Every rule and the default fired somewhere in the grid.
    assert_eq!(seen_rules.len(), policy.rule_count() + 1, "{seen_rules:?}");
}

#[test]
fn first_match_wins_even_when_later_rules_match() {
    let policy = design();
    // Matches tools, long-context, kv-pressure and alone-and-greedy.
    let s = Signals {
        has_tools: true,
        prompt_tokens: 10_000,
        kv_pressure: 0.9,
        greedy: true,
        ..Signals::default()
    };
    assert_eq!(policy.decide(&s).rule, "tools-need-batched");
}

/// A rule routing to an engine that cannot take the request is passed
/// over as if it did not hold: the next rule that holds decides, else the
/// default; the chain's engines that cannot take it are skipped by
/// `first_where`.
#[test]
fn rules_whose_engine_cannot_take_the_request_are_passed_over() {
    let policy = design();
    let s = Signals {
        greedy: true,
        ..Signals::default()
    };
    assert_eq!(policy.decide(&s).rule, "alone-and-greedy");
    let no_fastpath = |e: &str| e != "fastpath";
    let d = policy.decide_where(&s, no_fastpath);
    assert_eq!((d.rule, d.engine), ("speculate-when-quiet", "dflash"));
    let only_batched = |e: &str| e == "batched";
    let d = policy.decide_where(&s, only_batched);
    assert_eq!((d.rule, d.engine), ("default", "batched"));
    // The default decides even when its engine cannot take the request;
    // the chain names what can.
    let only_mtp = |e: &str| e == "mtp";
    let d = policy.decide_where(&s, only_mtp);
    assert_eq!(d.rule, "default");
    assert_eq!(d.first_where(only_mtp), None);
    let d = policy.decide(&s);
    assert_eq!(d.first_where(|e| e != "fastpath"), Some("dflash"));
}

#[test]
fn unknown_accept_rate_fails_comparisons_and_not_inverts() {
    let yaml = r#"
policy:
  default: batched
  rules:
    - { name: rate-ne, when: { engine_accept_rate.dflash: { ne: 0.5 } }, route: dflash }
    - { name: rate-low, when: { engine_accept_rate.dflash: { lt: 0.3 } }, route: mtp }
    - { name: not-high, when: { not: { engine_accept_rate.dflash: { gte: 0.3 } } }, route: fastpath }
"#;
    let policy = Policy::from_yaml(yaml, ENGINES).unwrap();
    let mut s = Signals::default();
    // Unknown: `ne` and `lt` are false, `not gte` is true.
    assert_eq!(policy.decide(&s).rule, "not-high");
    s.engine_accept_rate.insert("dflash".into(), f64::NAN);
    assert_eq!(policy.decide(&s).rule, "not-high", "NaN counts as unknown");
    s.engine_accept_rate.insert("dflash".into(), 0.5);
    assert_eq!(policy.decide(&s).rule, "default");
    s.engine_accept_rate.insert("dflash".into(), 0.1);
    assert_eq!(policy.decide(&s).rule, "rate-ne");
}

#[test]
fn speculate_while_it_pays_is_one_comparison_on_the_speedup() {
    let yaml = r#"
policy:
  default: fastpath
  rules:
    - { name: pays, when: { greedy: true, not: { engine_speedup.dflash: { lt: 1.0 } } }, route: dflash }
"#;
    let policy = Policy::from_yaml(yaml, ENGINES).unwrap();
    let mut s = Signals {
        greedy: true,
        ..Signals::default()
    };
    assert_eq!(policy.decide(&s).rule, "pays", "unknown: try it");
    // Speedups above 1 are ratios, not fractions.
    s.engine_speedup.insert("dflash".into(), 1.8);
    assert_eq!(policy.decide(&s).rule, "pays");
    s.engine_speedup.insert("dflash".into(), 0.9);
    assert_eq!(policy.decide(&s).rule, "default");
    s.engine_speedup.insert("dflash".into(), f64::NAN);
    assert_eq!(policy.decide(&s).rule, "pays", "NaN counts as unknown");
}

#[test]
fn every_operator_on_both_sides_of_its_bound() {
    let cases: &[(&str, &[(u64, bool)])] = &[
        ("eq", &[(9, false), (10, true), (11, false)]),
        ("ne", &[(9, true), (10, false), (11, true)]),
        ("lt", &[(9, true), (10, false), (11, false)]),
        ("lte", &[(9, true), (10, true), (11, false)]),
        ("gt", &[(9, false), (10, false), (11, true)]),
        ("gte", &[(9, false), (10, true), (11, true)]),
    ];
    for (op, expect) in cases {
        let yaml = format!(
            "policy: {{ default: batched, rules: [ {{ name: r, when: {{ total_queued: {{ {op}: 10 }} }}, route: fastpath }} ] }}"
        );
        let policy = Policy::from_yaml(&yaml, ENGINES).unwrap();
        for &(v, hit) in *expect {
            let s = Signals {
                total_queued: v,
                ..Signals::default()
            };
            assert_eq!(policy.decide(&s).rule == "r", hit, "{op} 10 at {v}");
        }
    }
}

#[test]
fn operator_maps_are_conjunctions_and_bare_numbers_mean_eq() {
    let yaml = r#"
policy:
  default: batched
  rules:
    - { name: mid, when: { prompt_tokens: { gte: 1024, lt: 8192 } }, route: dflash }
    - { name: exact, when: { max_tokens: 7, kv_pressure: 0.5 }, route: mtp }
"#;
    let policy = Policy::from_yaml(yaml, ENGINES).unwrap();
    let rule = |prompt_tokens, max_tokens, kv_pressure| {
        let s = Signals {
            prompt_tokens,
            max_tokens,
            kv_pressure,
            ..Signals::default()
        };
        policy.decide(&s).rule.to_owned()
    };
    assert_eq!(rule(1023, 0, 0.0), "default");
    assert_eq!(rule(1024, 0, 0.0), "mid");
    assert_eq!(rule(8191, 0, 0.0), "mid");
    assert_eq!(rule(8192, 0, 0.0), "default");
    assert_eq!(rule(0, 7, 0.5), "exact");
    assert_eq!(rule(0, 7, 0.51), "default");
    assert_eq!(rule(0, 8, 0.5), "default");
}

#[test]
fn nested_all_any_not() {
    let yaml = r#"
policy:
  default: batched
  rules:
    - name: nested
      when:
        any:
          - all: [ { greedy: true }, { not: { any: [ { has_tools: true }, { has_images: true } ] } } ]
          - not: { not: { model: big } }
      route: fastpath
"#;
    let policy = Policy::from_yaml(yaml, ENGINES).unwrap();
    for greedy in [false, true] {
        for has_tools in [false, true] {
            for has_images in [false, true] {
                for model in ["big", "small"] {
                    let s = Signals {
                        greedy,
                        has_tools,
                        has_images,
                        model: model.into(),
                        ..Signals::default()
                    };
                    let expect = (greedy && !(has_tools || has_images)) || model == "big";
                    assert_eq!(policy.decide(&s).rule == "nested", expect, "{s:?}");
                }
            }
        }
    }
}

#[test]
fn per_engine_counts_default_to_zero() {
    let yaml = r#"
policy:
  default: batched
  rules:
    - { name: idle, when: { engine_active.dflash: 0, engine_queued.dflash: { lt: 1 } }, route: dflash }
"#;
    let policy = Policy::from_yaml(yaml, ENGINES).unwrap();
    let mut s = Signals::default();
    assert_eq!(policy.decide(&s).rule, "idle");
    s.engine_queued.insert("dflash".into(), 1);
    assert_eq!(policy.decide(&s).rule, "default");
    s.engine_queued.insert("dflash".into(), 0);
    s.engine_active.insert("batched".into(), 9);
    assert_eq!(
        policy.decide(&s).rule,
        "idle",
        "other engines' counts do not leak in"
    );
}

#[test]
fn fallback_chains_inherit_override_and_dedupe() {
    let yaml = r#"
policy:
  default: fastpath
  fallback: [dflash, fastpath, batched, dflash]
  rules:
    - { name: inherits, when: { greedy: true }, route: batched }
    - { name: overrides, when: { has_tools: true }, route: mtp, fallback: [batched, mtp] }
    - { name: none, when: { has_images: true }, route: dflash, fallback: [] }
"#;
    let policy = Policy::from_yaml(yaml, ENGINES).unwrap();
    let decide = |greedy, has_tools, has_images| {
        let s = Signals {
            greedy,
            has_tools,
            has_images,
            ..Signals::default()
        };
        let d = policy.decide(&s);
        (d.rule.to_owned(), d.chain().to_vec())
    };
    assert_eq!(
        decide(true, false, false),
        (
            "inherits".into(),
            vec!["batched".into(), "dflash".into(), "fastpath".into()]
        )
    );
    assert_eq!(
        decide(false, true, false),
        ("overrides".into(), vec!["mtp".into(), "batched".into()])
    );
    assert_eq!(
        decide(false, false, true),
        ("none".into(), vec!["dflash".to_owned()])
    );
    assert_eq!(
        decide(false, false, false),
        (
            "default".into(),
            vec!["fastpath".into(), "dflash".into(), "batched".into()]
        )
    );
    let d = policy.decide(&Signals::default());
    assert_eq!(d.engine, "fastpath");
    assert_eq!(d.fallback, ["dflash".to_owned(), "batched".to_owned()]);
}

#[test]
fn accessors() {
    let policy = design();
    assert_eq!(policy.rule_count(), 7);
    assert_eq!(policy.default_engine(), "batched");
    assert_eq!(policy.rule_names().next(), Some("tools-need-batched"));
    assert_eq!(policy.rule_names().last(), Some("images-or-queue"));
}

// ---- Random policies against a direct interpreter of the YAML ----

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

const COUNT_KEYS: &[&str] = &[
    "prompt_tokens",
    "max_tokens",
    "total_active",
    "total_queued",
    "engine_active.dflash",
    "engine_queued.batched",
];
const FRACTION_KEYS: &[&str] = &["kv_pressure", "engine_accept_rate.dflash"];
const FLAG_KEYS: &[&str] = &["greedy", "has_tools", "has_images"];
const OPS: &[&str] = &["eq", "ne", "lt", "lte", "gt", "gte"];
const COUNTS: &[u64] = &[0, 1, 2, 3];
const FRACTIONS: &[f64] = &[0.0, 0.25, 0.5, 1.0];
const MODELS: &[&str] = &["a", "b", "c"];

fn gen_cond(rng: &mut Rng, depth: u32) -> String {
    let mut parts: Vec<String> = Vec::new();
    for _ in 0..1 + rng.below(2) {
        let entry = gen_entry(rng, depth);
        // A mapping cannot repeat a key.
        let key = entry.split(':').next().unwrap().to_owned();
        if !parts.iter().any(|p| p.split(':').next() == Some(&key)) {
            parts.push(entry);
        }
    }
    format!("{{ {} }}", parts.join(", "))
}

fn gen_ops<T: std::fmt::Display + Copy>(rng: &mut Rng, values: &[T]) -> String {
    if rng.below(3) == 0 {
        return rng.pick(values).to_string();
    }
    let mut ops: Vec<&str> = OPS.to_vec();
    let n = 1 + rng.below(2);
    let parts: Vec<String> = (0..n)
        .map(|_| {
            let op = ops.remove(rng.below(ops.len()));
            format!("{op}: {}", rng.pick(values))
        })
        .collect();
    format!("{{ {} }}", parts.join(", "))
}

fn gen_entry(rng: &mut Rng, depth: u32) -> String {
    let kind = if depth == 0 {
        3 + rng.below(4)
    } else {
        rng.below(7)
    };
    match kind {
        0 | 1 => {
            let n = 1 + rng.below(3);
            let items: Vec<String> = (0..n).map(|_| gen_cond(rng, depth - 1)).collect();
            format!(
                "{}: [ {} ]",
                if kind == 0 { "all" } else { "any" },
                items.join(", ")
            )
        }
        2 => format!("not: {}", gen_cond(rng, depth - 1)),
        3 => format!("{}: {}", rng.pick(COUNT_KEYS), gen_ops(rng, COUNTS)),
        4 => format!("{}: {}", rng.pick(FRACTION_KEYS), gen_ops(rng, FRACTIONS)),
        5 => format!("{}: {}", rng.pick(FLAG_KEYS), rng.below(2) == 0),
        _ if rng.below(2) == 0 => format!("model: {}", rng.pick(MODELS)),
        _ => format!(
            "model: {{ in: [ {}, {} ] }}",
            rng.pick(MODELS),
            rng.pick(MODELS)
        ),
    }
}

fn gen_signals(rng: &mut Rng) -> Signals {
    let mut s = Signals {
        prompt_tokens: rng.pick(COUNTS),
        max_tokens: rng.pick(COUNTS),
        greedy: rng.below(2) == 0,
        has_tools: rng.below(2) == 0,
        has_images: rng.below(2) == 0,
        total_active: rng.pick(COUNTS),
        total_queued: rng.pick(COUNTS),
        kv_pressure: rng.pick(FRACTIONS),
        model: rng.pick(MODELS).into(),
        ..Signals::default()
    };
    if rng.below(4) != 0 {
        s.engine_active.insert("dflash".into(), rng.pick(COUNTS));
    }
    if rng.below(4) != 0 {
        s.engine_queued.insert("batched".into(), rng.pick(COUNTS));
    }
    if rng.below(3) != 0 {
        s.engine_accept_rate
            .insert("dflash".into(), rng.pick(FRACTIONS));
    }
    s
}

/// Reads signals straight from the struct by key name, as f64; `None` is
/// unknown.
fn lookup(key: &str, s: &Signals) -> Option<f64> {
    Some(match key {
        "prompt_tokens" => s.prompt_tokens as f64,
        "max_tokens" => s.max_tokens as f64,
        "total_active" => s.total_active as f64,
        "total_queued" => s.total_queued as f64,
        "kv_pressure" => s.kv_pressure,
        "engine_active.dflash" => s.engine_active.get("dflash").copied().unwrap_or(0) as f64,
        "engine_queued.batched" => s.engine_queued.get("batched").copied().unwrap_or(0) as f64,
        "engine_accept_rate.dflash" => *s.engine_accept_rate.get("dflash")?,
        other => panic!("generator made unknown key {other}"),
    })
}

fn interpret(cond: &Value, s: &Signals) -> bool {
    cond.as_mapping().unwrap().iter().all(|(k, v)| {
        let key = k.as_str().unwrap();
        match key {
            "all" => v.as_sequence().unwrap().iter().all(|c| interpret(c, s)),
            "any" => v.as_sequence().unwrap().iter().any(|c| interpret(c, s)),
            "not" => !interpret(v, s),
            "greedy" => v.as_bool() == Some(s.greedy),
            "has_tools" => v.as_bool() == Some(s.has_tools),
            "has_images" => v.as_bool() == Some(s.has_images),
            "model" => match v {
                Value::String(m) => *m == s.model,
                _ => v["in"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .any(|m| m.as_str() == Some(&s.model)),
            },
            _ => {
                let Some(actual) = lookup(key, s) else {
                    return false;
                };
                match v.as_mapping() {
                    None => actual == v.as_f64().unwrap(),
                    Some(ops) => ops.iter().all(|(op, bound)| {
                        let b = bound.as_f64().unwrap();
                        match op.as_str().unwrap() {
                            "eq" => actual == b,
                            "ne" => actual != b,
                            "lt" => actual < b,
                            "lte" => actual <= b,
                            "gt" => actual > b,
                            "gte" => actual >= b,
                            other => panic!("generator made unknown op {other}"),
                        }
                    }),
                }
            }
        }
    })
}

#[test]
fn random_policies_match_a_direct_interpretation() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut matched = 0;
    let mut defaulted = 0;
    for _ in 0..300 {
        let rules: Vec<String> = (0..1 + rng.below(4))
            .map(|i| {
                format!(
                    "    - {{ name: r{i}, when: {}, route: {} }}",
                    gen_cond(&mut rng, 2),
                    rng.pick(ENGINES)
                )
            })
            .collect();
        let yaml = format!(
            "policy:\n  default: batched\n  rules:\n{}\n",
            rules.join("\n")
        );
        let policy = Policy::from_yaml(&yaml, ENGINES).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
        let doc: Value = serde_yaml::from_str(&yaml).unwrap();
        let raw_rules = doc["policy"]["rules"].as_sequence().unwrap();
        for _ in 0..200 {
            let s = gen_signals(&mut rng);
            let expected = raw_rules
                .iter()
                .find(|r| interpret(&r["when"], &s))
                .map_or(("batched", "default"), |r| {
                    (r["route"].as_str().unwrap(), r["name"].as_str().unwrap())
                });
            let d = policy.decide(&s);
            assert_eq!((d.engine, d.rule), expected, "\n{yaml}\n{s:?}");
            if d.rule == "default" {
                defaulted += 1
            } else {
                matched += 1
            }
        }
    }
    // The generator exercises both outcomes substantially.
    assert!(
        matched > 10_000 && defaulted > 10_000,
        "matched {matched}, defaulted {defaulted}"
    );
}
