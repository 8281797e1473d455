//! Every way a policy is rejected, with the message an operator sees.

use policies::{At, Policy, PolicyError, RawPolicy};

const ENGINES: &[&str] = &["batched", "fastpath", "dflash"];
const LOADED: &str = "(loaded: batched, fastpath, dflash)";

/// A one-rule policy named `r` with the given `when`.
fn when(cond: &str) -> String {
    format!("policy:\n  default: batched\n  rules:\n    - name: r\n      when: {cond}\n      route: fastpath\n")
}

fn err(yaml: &str) -> PolicyError {
    Policy::from_yaml(yaml, ENGINES).expect_err("policy should be rejected")
}

fn msg(yaml: &str) -> String {
    err(yaml).to_string()
}

#[test]
fn unknown_signals() {
    let e = err(&when("{ gredy: true }"));
    assert!(matches!(&e, PolicyError::UnknownSignal { signal, .. } if signal == "gredy"));
    assert!(
        e.to_string().starts_with("rule `r` (rules[0]): field `when.gredy`: unknown signal `gredy`; known: prompt_tokens,"),
        "{e}"
    );
    let nested = msg(&when(
        "{ all: [ { greedy: true }, { not: { engine_load.dflash: 1 } } ] }",
    ));
    assert!(
        nested.contains(
            "field `when.all[1].not.engine_load.dflash`: unknown signal `engine_load.dflash`"
        ),
        "{nested}"
    );
    assert!(msg(&when("{ engine_active: 1 }")).contains("unknown signal `engine_active`"));
}

#[test]
fn engines_inside_dotted_signals_must_be_loaded() {
    assert_eq!(
        msg(&when("{ engine_active.mtp: { lt: 4 } }")),
        format!("rule `r` (rules[0]): field `when.engine_active.mtp`: engine `mtp` is not loaded {LOADED}")
    );
    assert!(msg(&when(
        "{ any: [ { engine_accept_rate.eagle: { gt: 0.5 } } ] }"
    ))
    .contains("field `when.any[0].engine_accept_rate.eagle`: engine `eagle` is not loaded"));
    assert!(msg(&when("{ engine_queued.x: 0 }")).contains("engine `x` is not loaded"));
    assert_eq!(
        msg(&when("{ engine_queued.: 0 }")),
        "rule `r` (rules[0]): field `when.engine_queued.`: missing engine name after the `.`"
    );
}

#[test]
fn wrong_value_types() {
    let e = err(&when("{ greedy: 1 }"));
    assert!(matches!(e, PolicyError::WrongType { .. }));
    assert_eq!(
        e.to_string(),
        "rule `r` (rules[0]): field `when.greedy`: expected true or false, got the number 1"
    );
    assert!(msg(&when("{ has_tools: yes }"))
        .ends_with("expected true or false, got the string \"yes\""));
    assert_eq!(
        msg(&when("{ prompt_tokens: 1.5 }")),
        "rule `r` (rules[0]): field `when.prompt_tokens`: expected a non-negative integer or a map of operators \
         (eq, ne, lt, lte, gt, gte), got the number 1.5"
    );
    assert!(msg(&when("{ prompt_tokens: { gte: -1 } }")).ends_with(
        "field `when.prompt_tokens.gte`: expected a non-negative integer, got the number -1"
    ));
    assert!(msg(&when("{ total_active: { lt: \"4\" } }"))
        .ends_with("expected a non-negative integer, got the string \"4\""));
    assert!(msg(&when("{ kv_pressure: high }"))
        .ends_with("expected a number in 0..=1 or a map of operators, got the string \"high\""));
    assert!(msg(&when("{ model: 3 }")).ends_with(
        "field `when.model`: expected a model name or { in: [names] }, got the number 3"
    ));
    assert!(msg(&when("{ model: { in: [a, 3] } }"))
        .ends_with("field `when.model.in[1]`: expected a model name, got the number 3"));
    assert!(msg(&when("{ model: { in: a } }"))
        .ends_with("field `when.model.in`: expected a list of model names, got the string \"a\""));
    assert!(msg(&when("{ all: { greedy: true } }"))
        .ends_with("field `when.all`: expected a list of conditions, got a mapping"));
    assert!(msg(&when("{ not: [ { greedy: true } ] }"))
        .ends_with("field `when.not`: expected a mapping of conditions, got a list"));
    assert!(msg(&when("{ any: [ true ] }"))
        .ends_with("field `when.any[0]`: expected a mapping of conditions, got the boolean true"));
    assert_eq!(
        msg(&when("true")),
        "rule `r` (rules[0]): field `when`: expected a mapping of conditions, got the boolean true"
    );
    assert!(msg(&when("{ 1: true }"))
        .ends_with("field `when`: expected signal names as keys, got the number 1"));
}

#[test]
fn unknown_operators() {
    let e = err(&when("{ prompt_tokens: { gtee: 3 } }"));
    assert!(matches!(&e, PolicyError::UnknownOperator { op, .. } if op == "gtee"));
    assert_eq!(
        e.to_string(),
        "rule `r` (rules[0]): field `when.prompt_tokens`: unknown operator `gtee`; expected one of eq, ne, lt, lte, gt, gte"
    );
    assert!(msg(&when("{ kv_pressure: { between: 0.5 } }")).contains("unknown operator `between`"));
    assert!(msg(&when("{ model: { eq: a } }"))
        .ends_with("field `when.model`: unknown operator `eq`; expected one of in"));
    assert!(msg(&when("{ model: { in: [a], nin: [b] } }")).contains("unknown operator `nin`"));
}

#[test]
fn empty_and_out_of_range_values() {
    assert_eq!(
        msg(&when("{ kv_pressure: { gt: 85 } }")),
        "rule `r` (rules[0]): field `when.kv_pressure.gt`: must be a fraction in 0..=1, got 85"
    );
    assert!(msg(&when("{ engine_accept_rate.dflash: -0.1 }"))
        .ends_with("must be a fraction in 0..=1, got -0.1"));
    assert!(msg(&when("{ kv_pressure: .nan }")).ends_with("must be a fraction in 0..=1, got NaN"));
    assert!(msg(&when("{ engine_speedup.dflash: { gte: -1 } }"))
        .ends_with("must be a finite number >= 0, got -1"));
    assert!(msg(&when("{ engine_speedup.dflash: .inf }"))
        .ends_with("must be a finite number >= 0, got inf"));
    assert!(msg(&when("{ engine_speedup.nope: 1.5 }")).contains("engine `nope` is not loaded"));
    assert!(msg(&when("{ prompt_tokens: {} }"))
        .ends_with("field `when.prompt_tokens`: empty operator map"));
    assert!(msg(&when("{ model: {} }")).ends_with("field `when.model`: empty operator map"));
    assert!(msg(&when("{ model: { in: [] } }"))
        .ends_with("field `when.model.in`: empty list of model names"));
    assert!(msg(&when("{ any: [] }")).ends_with("field `when.any`: empty list of conditions"));
    assert!(
        msg(&when("{ all: [ { not: {} } ] }")).contains("field `when.all[0].not`: empty condition")
    );
    assert_eq!(
        msg(&when("{}")),
        "rule `r` (rules[0]): field `when`: empty condition (use the policy's `default` for a catch-all)"
    );
}

#[test]
fn rule_names() {
    let rules = |body: &str| format!("policy:\n  default: batched\n  rules:\n{body}");
    let ok = "    - { name: a, when: { greedy: true }, route: fastpath }\n";

    let e = err(&rules(&format!(
        "{ok}    - {{ name: \"\", when: {{ greedy: true }}, route: fastpath }}\n"
    )));
    assert!(matches!(e, PolicyError::EmptyRuleName { index: 1 }));
    assert_eq!(e.to_string(), "rules[1]: rule name is empty");
    assert_eq!(
        msg(&rules(
            "    - { name: \"  \", when: { greedy: true }, route: fastpath }\n"
        )),
        "rules[0]: rule name is empty"
    );

    let e = err(&rules(
        "    - { when: { greedy: true }, route: fastpath }\n",
    ));
    assert!(matches!(
        e,
        PolicyError::MissingField {
            at: At::Rule {
                index: 0,
                name: None
            },
            field: "name"
        }
    ));
    assert_eq!(e.to_string(), "rules[0]: missing field `name`");

    let dup = format!("{ok}    - {{ name: b, when: {{ greedy: false }}, route: batched }}\n{ok}");
    assert_eq!(
        msg(&rules(&dup)),
        "rule `a` (rules[2]): duplicate rule name, first used by rules[0]"
    );

    assert_eq!(
        msg(&rules(
            "    - { name: default, when: { greedy: true }, route: fastpath }\n"
        )),
        "rule `default` (rules[0]): `default` is reserved for the no-rule-matched route"
    );
}

#[test]
fn missing_rule_fields() {
    let rules = |body: &str| format!("policy:\n  default: batched\n  rules:\n{body}");
    assert_eq!(
        msg(&rules("    - { name: r, when: { greedy: true } }\n")),
        "rule `r` (rules[0]): missing field `route`"
    );
    assert_eq!(
        msg(&rules("    - { name: r, route: batched }\n")),
        "rule `r` (rules[0]): missing field `when`"
    );
}

#[test]
fn engines_must_be_loaded() {
    let policy = |default: &str, fallback: &str, route: &str, rule_fallback: &str| {
        format!(
            "policy:\n  default: {default}\n  fallback: {fallback}\n  rules:\n    \
             - {{ name: r, when: {{ greedy: true }}, route: {route}, fallback: {rule_fallback} }}\n"
        )
    };
    assert!(Policy::from_yaml(
        &policy("batched", "[batched]", "fastpath", "[dflash]"),
        ENGINES
    )
    .is_ok());

    let e = err(&policy("gpu", "[batched]", "fastpath", "[]"));
    assert!(
        matches!(&e, PolicyError::UnknownEngine { at: At::Policy, engine, .. } if engine == "gpu")
    );
    assert_eq!(
        e.to_string(),
        format!("policy: field `default`: engine `gpu` is not loaded {LOADED}")
    );
    assert_eq!(
        msg(&policy("batched", "[batched, mtp]", "fastpath", "[]")),
        format!("policy: field `fallback[1]`: engine `mtp` is not loaded {LOADED}")
    );
    assert_eq!(
        msg(&policy("batched", "[]", "mtp", "[]")),
        format!("rule `r` (rules[0]): field `route`: engine `mtp` is not loaded {LOADED}")
    );
    assert_eq!(
        msg(&policy("batched", "[]", "fastpath", "[batched, Batched]")),
        format!(
            "rule `r` (rules[0]): field `fallback[1]`: engine `Batched` is not loaded {LOADED}"
        )
    );
    let none = Policy::from_yaml(&policy("batched", "[]", "fastpath", "[]"), &[]).unwrap_err();
    assert_eq!(
        none.to_string(),
        "policy: field `default`: engine `batched` is not loaded (loaded: none)"
    );
}

#[test]
fn structural_errors_come_from_serde_with_a_path() {
    let e = err("policy:\n  default: batched\n  rules:\n    - { name: r, when: { greedy: true }, route: batched, fallbacks: [] }\n");
    assert!(matches!(e, PolicyError::Yaml(_)));
    let m = e.to_string();
    assert!(
        m.starts_with("policy YAML is malformed: policy.rules[0]: unknown field `fallbacks`"),
        "{m}"
    );

    assert!(msg("policy:\n  rules: []\n").contains("missing field `default`"));
    assert!(msg("policy:\n  default: batched\n  default_engine: x\n")
        .contains("unknown field `default_engine`"));
    assert!(msg("policy: [").starts_with("policy YAML is malformed"));
    let dup_key = msg(&when("{ greedy: true, greedy: false }"));
    assert!(dup_key.contains("duplicate"), "{dup_key}");
}

#[test]
fn standalone_versus_config_documents() {
    let config = "model: qwen3\nserver: { port: 8080 }\nengines: [ { name: batched } ]\n\
                  policy:\n  default: batched\n  rules:\n    - { name: r, when: { greedy: true }, route: fastpath }\n";
    // A standalone policy file may hold nothing but `policy:`.
    assert!(msg(config).contains("unknown field `model`"));
    let from_text = Policy::from_config_yaml(config, ENGINES).unwrap();
    assert_eq!(from_text.rule_count(), 1);

    let value: serde_yaml::Value = serde_yaml::from_str(config).unwrap();
    assert_eq!(
        Policy::from_config_value(&value, ENGINES).unwrap(),
        from_text
    );
    assert_eq!(
        Policy::from_policy_value(&value["policy"], ENGINES).unwrap(),
        from_text
    );
    let raw: RawPolicy = serde_yaml::from_value(value["policy"].clone()).unwrap();
    assert_eq!(Policy::compile(&raw, ENGINES).unwrap(), from_text);

    let e = Policy::from_config_yaml("model: qwen3\n", ENGINES).unwrap_err();
    assert!(matches!(e, PolicyError::MissingPolicy));
    assert_eq!(e.to_string(), "config has no top-level `policy:` section");
    let e = Policy::from_config_value(&serde_yaml::from_str("model: qwen3\n").unwrap(), ENGINES)
        .unwrap_err();
    assert!(matches!(e, PolicyError::MissingPolicy));
    // Errors in the section still name the rule when read from a config.
    let bad = config.replace("route: fastpath", "route: mtp");
    assert!(Policy::from_config_yaml(&bad, ENGINES)
        .unwrap_err()
        .to_string()
        .starts_with("rule `r` (rules[0]): field `route`"));
}

#[test]
fn a_policy_without_rules_always_defaults() {
    let policy =
        Policy::from_yaml("policy: { default: dflash, fallback: [batched] }", ENGINES).unwrap();
    let d = policy.decide(&policies::Signals::default());
    assert_eq!((d.engine, d.rule), ("dflash", "default"));
    assert_eq!(d.chain(), ["dflash".to_owned(), "batched".to_owned()]);
}
