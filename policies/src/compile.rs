//! Turns a [`RawPolicy`] into a [`Policy`]: resolves signal names to enum
//! variants, checks every value's type and range, and checks that every
//! engine named anywhere is loaded. Anything that gets past here is safe to
//! evaluate without further checks.

use std::collections::HashMap;

use serde_yaml::{Mapping, Value};

use crate::error::{At, PolicyError};
use crate::eval::{Cond, Count, Flag, Measure, Op};
use crate::policy::{Policy, Rule};
use crate::schema::{RawPolicy, RawRule};

/// The signals, as listed in "unknown signal" errors.
pub(crate) const SIGNAL_KEYS: &str = "prompt_tokens, max_tokens, greedy, has_tools, has_images, \
     total_active, total_queued, kv_pressure, model, engine_active.NAME, engine_queued.NAME, \
     engine_accept_rate.NAME, engine_speedup.NAME";

const NUMERIC_OPS: &str = "eq, ne, lt, lte, gt, gte";

/// The name a decision reports when no rule matched; rules may not use it.
pub(crate) const DEFAULT_RULE: &str = "default";

pub(crate) fn compile(raw: &RawPolicy, loaded: &[&str]) -> Result<Policy, PolicyError> {
    let policy = Ctx {
        at: At::Policy,
        loaded,
    };
    policy.engine("default", &raw.default)?;
    policy.engines("fallback", &raw.fallback)?;

    let mut first_use: HashMap<&str, usize> = HashMap::new();
    let mut rules = Vec::with_capacity(raw.rules.len());
    for (index, rule) in raw.rules.iter().enumerate() {
        let name = rule_name(index, rule)?;
        if let Some(&first) = first_use.get(name) {
            return Err(PolicyError::DuplicateRuleName {
                name: name.to_owned(),
                first,
                second: index,
            });
        }
        first_use.insert(name, index);
        rules.push(compile_rule(index, name, rule, &raw.fallback, loaded)?);
    }

    Ok(Policy::new(
        rules.into(),
        chain(&raw.default, &raw.fallback),
    ))
}

fn rule_name(index: usize, rule: &RawRule) -> Result<&str, PolicyError> {
    let name = rule.name.as_deref().ok_or(PolicyError::MissingField {
        at: At::Rule { index, name: None },
        field: "name",
    })?;
    if name.trim().is_empty() {
        return Err(PolicyError::EmptyRuleName { index });
    }
    if name == DEFAULT_RULE {
        return Err(PolicyError::ReservedRuleName {
            name: name.to_owned(),
            index,
        });
    }
    Ok(name)
}

fn compile_rule(
    index: usize,
    name: &str,
    raw: &RawRule,
    policy_fallback: &[String],
    loaded: &[&str],
) -> Result<Rule, PolicyError> {
    let ctx = Ctx {
        at: At::Rule {
            index,
            name: Some(name.to_owned()),
        },
        loaded,
    };
    let missing = |field| PolicyError::MissingField {
        at: ctx.at.clone(),
        field,
    };

    let route = raw.route.as_deref().ok_or_else(|| missing("route"))?;
    ctx.engine("route", route)?;
    let fallback = match &raw.fallback {
        Some(own) => {
            ctx.engines("fallback", own)?;
            own.as_slice()
        }
        None => policy_fallback,
    };
    let when = ctx.condition(raw.when.as_ref().ok_or_else(|| missing("when"))?, "when")?;

    Ok(Rule {
        name: name.to_owned(),
        when,
        chain: chain(route, fallback),
    })
}

/// The engine first, then fallbacks in order, each engine once.
fn chain(first: &str, rest: &[String]) -> Box<[String]> {
    let mut out: Vec<String> = Vec::with_capacity(rest.len() + 1);
    for engine in std::iter::once(first).chain(rest.iter().map(String::as_str)) {
        if !out.iter().any(|e| e == engine) {
            out.push(engine.to_owned());
        }
    }
    out.into()
}

/// What every check needs to build an error: where it is and which engines
/// exist.
struct Ctx<'a> {
    at: At,
    loaded: &'a [&'a str],
}

impl Ctx<'_> {
    fn engine(&self, field: &str, engine: &str) -> Result<(), PolicyError> {
        if self.loaded.contains(&engine) {
            return Ok(());
        }
        let loaded = if self.loaded.is_empty() {
            "none".to_owned()
        } else {
            self.loaded.join(", ")
        };
        Err(PolicyError::UnknownEngine {
            at: self.at.clone(),
            field: field.to_owned(),
            engine: engine.to_owned(),
            loaded,
        })
    }

    fn engines(&self, field: &str, engines: &[String]) -> Result<(), PolicyError> {
        engines
            .iter()
            .enumerate()
            .try_for_each(|(i, e)| self.engine(&format!("{field}[{i}]"), e))
    }

    /// A mapping of conditions, all of which must hold.
    fn condition(&self, value: &Value, field: &str) -> Result<Cond, PolicyError> {
        let map = value
            .as_mapping()
            .ok_or_else(|| self.wrong_type(field, "a mapping of conditions", value))?;
        if map.is_empty() {
            return Err(self.invalid(
                field,
                "empty condition (use the policy's `default` for a catch-all)",
            ));
        }
        let mut parts = Vec::with_capacity(map.len());
        for (key, value) in map {
            let key = key
                .as_str()
                .ok_or_else(|| self.wrong_type(field, "signal names as keys", key))?;
            parts.push(self.entry(key, value, &format!("{field}.{key}"))?);
        }
        Ok(match parts.len() {
            1 => parts.remove(0),
            _ => Cond::All(parts.into()),
        })
    }

    fn entry(&self, key: &str, value: &Value, field: &str) -> Result<Cond, PolicyError> {
        type R = Result<Cond, PolicyError>;
        let count = |signal| -> R {
            Ok(Cond::Count {
                signal,
                tests: self.count_tests(value, field)?,
            })
        };
        let fraction = |signal| -> R {
            Ok(Cond::Measure {
                signal,
                tests: self.measure_tests(value, field, Self::fraction)?,
            })
        };
        let ratio = |signal| -> R {
            Ok(Cond::Measure {
                signal,
                tests: self.measure_tests(value, field, Self::ratio)?,
            })
        };
        let flag = |signal| -> R {
            Ok(Cond::Flag {
                signal,
                value: self.flag(value, field)?,
            })
        };
        match key {
            "all" => Ok(Cond::All(self.list(value, field)?)),
            "any" => Ok(Cond::Any(self.list(value, field)?)),
            "not" => Ok(Cond::Not(Box::new(self.condition(value, field)?))),
            "greedy" => flag(Flag::Greedy),
            "has_tools" => flag(Flag::HasTools),
            "has_images" => flag(Flag::HasImages),
            "prompt_tokens" => count(Count::PromptTokens),
            "max_tokens" => count(Count::MaxTokens),
            "total_active" => count(Count::TotalActive),
            "total_queued" => count(Count::TotalQueued),
            "kv_pressure" => fraction(Measure::KvPressure),
            "model" => self.model(value, field),
            _ => match key.split_once('.') {
                Some(("engine_active", e)) => {
                    count(Count::EngineActive(self.signal_engine(field, e)?))
                }
                Some(("engine_queued", e)) => {
                    count(Count::EngineQueued(self.signal_engine(field, e)?))
                }
                Some(("engine_accept_rate", e)) => {
                    fraction(Measure::EngineAcceptRate(self.signal_engine(field, e)?))
                }
                Some(("engine_speedup", e)) => {
                    ratio(Measure::EngineSpeedup(self.signal_engine(field, e)?))
                }
                _ => Err(PolicyError::UnknownSignal {
                    at: self.at.clone(),
                    field: field.to_owned(),
                    signal: key.to_owned(),
                }),
            },
        }
    }

    fn signal_engine(&self, field: &str, engine: &str) -> Result<Box<str>, PolicyError> {
        if engine.is_empty() {
            return Err(self.invalid(field, "missing engine name after the `.`"));
        }
        self.engine(field, engine)?;
        Ok(engine.into())
    }

    fn list(&self, value: &Value, field: &str) -> Result<Box<[Cond]>, PolicyError> {
        let items = value
            .as_sequence()
            .ok_or_else(|| self.wrong_type(field, "a list of conditions", value))?;
        if items.is_empty() {
            return Err(self.invalid(field, "empty list of conditions"));
        }
        items
            .iter()
            .enumerate()
            .map(|(i, c)| self.condition(c, &format!("{field}[{i}]")))
            .collect()
    }

    fn flag(&self, value: &Value, field: &str) -> Result<bool, PolicyError> {
        value
            .as_bool()
            .ok_or_else(|| self.wrong_type(field, "true or false", value))
    }

    fn count_tests(&self, value: &Value, field: &str) -> Result<Box<[(Op, u64)]>, PolicyError> {
        match value {
            Value::Mapping(ops) => self.operators(ops, field, |v, f| self.count(v, f)),
            bare => {
                let n = bare.as_u64().ok_or_else(|| {
                    self.wrong_type(
                        field,
                        "a non-negative integer or a map of operators (eq, ne, lt, lte, gt, gte)",
                        bare,
                    )
                })?;
                Ok(Box::new([(Op::Eq, n)]))
            }
        }
    }

    fn count(&self, value: &Value, field: &str) -> Result<u64, PolicyError> {
        value
            .as_u64()
            .ok_or_else(|| self.wrong_type(field, "a non-negative integer", value))
    }

    fn measure_tests(
        &self,
        value: &Value,
        field: &str,
        bound: fn(&Self, &Value, &str) -> Result<f64, PolicyError>,
    ) -> Result<Box<[(Op, f64)]>, PolicyError> {
        match value {
            Value::Mapping(ops) => self.operators(ops, field, |v, f| bound(self, v, f)),
            bare => Ok(Box::new([(Op::Eq, bound(self, bare, field)?)])),
        }
    }

    /// A non-negative ratio such as a speedup (1.0 = no change).
    fn ratio(&self, value: &Value, field: &str) -> Result<f64, PolicyError> {
        let x = match value {
            Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
            other => {
                return Err(self.wrong_type(field, "a number >= 0 or a map of operators", other))
            }
        };
        if !(x >= 0.0 && x.is_finite()) {
            return Err(self.invalid(field, &format!("must be a finite number >= 0, got {x}")));
        }
        Ok(x)
    }

    fn fraction(&self, value: &Value, field: &str) -> Result<f64, PolicyError> {
        let x = match value {
            Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
            other => {
                return Err(self.wrong_type(
                    field,
                    "a number in 0..=1 or a map of operators",
                    other,
                ))
            }
        };
        // Catches percentages written as 85 instead of 0.85.
        if !(0.0..=1.0).contains(&x) {
            return Err(self.invalid(field, &format!("must be a fraction in 0..=1, got {x}")));
        }
        Ok(x)
    }

    /// An operator map such as `{ gte: 10, lt: 20 }`; every operator must hold.
    fn operators<T>(
        &self,
        ops: &Mapping,
        field: &str,
        bound: impl Fn(&Value, &str) -> Result<T, PolicyError>,
    ) -> Result<Box<[(Op, T)]>, PolicyError> {
        if ops.is_empty() {
            return Err(self.invalid(field, "empty operator map"));
        }
        ops.iter()
            .map(|(key, value)| {
                let name = key.as_str().unwrap_or_default();
                let op = match name {
                    "eq" => Op::Eq,
                    "ne" => Op::Ne,
                    "lt" => Op::Lt,
                    "lte" => Op::Lte,
                    "gt" => Op::Gt,
                    "gte" => Op::Gte,
                    _ => return Err(self.unknown_op(field, key, NUMERIC_OPS)),
                };
                Ok((op, bound(value, &format!("{field}.{name}"))?))
            })
            .collect()
    }

    /// `model: name` or `model: { in: [a, b] }`.
    fn model(&self, value: &Value, field: &str) -> Result<Cond, PolicyError> {
        const EXPECTED: &str = "a model name or { in: [names] }";
        match value {
            Value::String(name) => Ok(Cond::ModelIn(Box::new([name.clone()]))),
            Value::Mapping(ops) => {
                if ops.is_empty() {
                    return Err(self.invalid(field, "empty operator map"));
                }
                if let Some((key, _)) = ops.iter().find(|(k, _)| k.as_str() != Some("in")) {
                    return Err(self.unknown_op(field, key, "in"));
                }
                let field = format!("{field}.in");
                let names = ops["in"]
                    .as_sequence()
                    .ok_or_else(|| self.wrong_type(&field, "a list of model names", &ops["in"]))?;
                if names.is_empty() {
                    return Err(self.invalid(&field, "empty list of model names"));
                }
                let names = names
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        n.as_str().map(str::to_owned).ok_or_else(|| {
                            self.wrong_type(&format!("{field}[{i}]"), "a model name", n)
                        })
                    })
                    .collect::<Result<Box<[String]>, _>>()?;
                Ok(Cond::ModelIn(names))
            }
            other => Err(self.wrong_type(field, EXPECTED, other)),
        }
    }

    fn wrong_type(&self, field: &str, expected: &'static str, got: &Value) -> PolicyError {
        PolicyError::WrongType {
            at: self.at.clone(),
            field: field.to_owned(),
            expected,
            got: describe(got),
        }
    }

    fn invalid(&self, field: &str, reason: &str) -> PolicyError {
        PolicyError::InvalidValue {
            at: self.at.clone(),
            field: field.to_owned(),
            reason: reason.to_owned(),
        }
    }

    fn unknown_op(&self, field: &str, op: &Value, expected: &'static str) -> PolicyError {
        let op = op.as_str().map_or_else(|| describe(op), str::to_owned);
        PolicyError::UnknownOperator {
            at: self.at.clone(),
            field: field.to_owned(),
            op,
            expected,
        }
    }
}

/// A short description of a YAML value for "got ..." in messages.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Sequence(_) => "a list".to_owned(),
        Value::Mapping(_) => "a mapping".to_owned(),
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}
