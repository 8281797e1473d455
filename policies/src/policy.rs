//! The validated policy, how to build one, and the routing decision.

use serde::Deserialize;
use serde_yaml::Value;

use crate::compile::{compile, DEFAULT_RULE};
use crate::error::PolicyError;
use crate::eval::Cond;
use crate::schema::{RawPolicy, RawPolicyDocument};
use crate::signals::Signals;

/// A validated routing policy: ordered rules, first match wins, then the
/// default. Only the constructors below make one, so every engine it names
/// was loaded when it was built and every condition is well-typed.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    rules: Box<[Rule]>,
    default_chain: Box<[String]>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rule {
    pub name: String,
    pub when: Cond,
    /// Route then fallbacks, deduplicated at load time so decisions only
    /// borrow it.
    pub chain: Box<[String]>,
}

/// Where a request goes and why. Borrows from the [`Policy`] that made it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision<'a> {
    /// The engine to try first.
    pub engine: &'a str,
    /// The rule that matched, or `"default"` when none did.
    pub rule: &'a str,
    /// Engines to try, in order, when `engine` refuses (capability mismatch
    /// or full). Never contains `engine` or repeats.
    pub fallback: &'a [String],
    chain: &'a [String],
    /// The matched rule's place in the rules, `None` for the default.
    pub(crate) index: Option<usize>,
}

/// One rule's verdict on a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict<'a> {
    pub rule: &'a str,
    /// Whether its condition holds.
    pub holds: bool,
    /// The engine it routes to.
    pub route: &'a str,
}

impl<'a> Decision<'a> {
    /// `engine` followed by `fallback`: every engine to try, in order, once.
    pub fn chain(&self) -> &'a [String] {
        self.chain
    }

    /// The first engine of the chain that `takes` the request: where it
    /// goes while every engine has room. `None` when none can.
    pub fn first_where(&self, takes: impl Fn(&str) -> bool) -> Option<&'a str> {
        self.chain.iter().map(String::as_str).find(|e| takes(e))
    }
}

/// The whole gateway config, of which only `policy:` is read here.
#[derive(Deserialize)]
struct RawConfig {
    policy: Option<RawPolicy>,
}

impl Policy {
    pub(crate) fn new(rules: Box<[Rule]>, default_chain: Box<[String]>) -> Self {
        Policy {
            rules,
            default_chain,
        }
    }

    /// Parses a standalone policy document whose only top-level key is
    /// `policy:`, and validates it against the loaded engine names.
    pub fn from_yaml(text: &str, loaded_engines: &[&str]) -> Result<Policy, PolicyError> {
        let doc: RawPolicyDocument = serde_yaml::from_str(text)?;
        Policy::compile(&doc.policy, loaded_engines)
    }

    /// Reads the `policy:` section of a whole gateway config (`model:`,
    /// `engines:`, `server:` and other keys are ignored).
    pub fn from_config_yaml(text: &str, loaded_engines: &[&str]) -> Result<Policy, PolicyError> {
        let config: RawConfig = serde_yaml::from_str(text)?;
        Policy::compile(
            &config.policy.ok_or(PolicyError::MissingPolicy)?,
            loaded_engines,
        )
    }

    /// Like [`Policy::from_config_yaml`], for a config already parsed to YAML.
    pub fn from_config_value(
        config: &Value,
        loaded_engines: &[&str],
    ) -> Result<Policy, PolicyError> {
        let section = config.get("policy").ok_or(PolicyError::MissingPolicy)?;
        Policy::from_policy_value(section, loaded_engines)
    }

    /// Builds a policy from the body of a `policy:` section.
    pub fn from_policy_value(
        section: &Value,
        loaded_engines: &[&str],
    ) -> Result<Policy, PolicyError> {
        let raw = RawPolicy::deserialize(section)?;
        Policy::compile(&raw, loaded_engines)
    }

    /// Validates an already-deserialized policy section, for callers that
    /// embed [`RawPolicy`] in their own config type.
    pub fn compile(raw: &RawPolicy, loaded_engines: &[&str]) -> Result<Policy, PolicyError> {
        compile(raw, loaded_engines)
    }

    /// Routes one request that every engine can take. Pure and
    /// allocation-free: the first rule whose condition holds wins,
    /// otherwise the default.
    pub fn decide(&self, signals: &Signals) -> Decision<'_> {
        self.decide_where(signals, |_| true)
    }

    /// Routes one request among the engines that `takes` it (the host asks
    /// each engine's declared capabilities): the first rule whose condition
    /// holds and whose route takes the request wins; a rule routing to an
    /// engine that cannot is passed over as if its condition did not hold.
    /// Otherwise the default. The decision's chain may still name engines
    /// that cannot take it (fallbacks, the default): callers skip those.
    pub fn decide_where(&self, signals: &Signals, takes: impl Fn(&str) -> bool) -> Decision<'_> {
        let index = self
            .rules
            .iter()
            .position(|r| r.when.matches(signals) && takes(&r.chain[0]));
        let (rule, chain) = index.map_or((DEFAULT_RULE, &*self.default_chain), |i| {
            (self.rules[i].name.as_str(), &*self.rules[i].chain)
        });
        Decision {
            engine: &chain[0],
            rule,
            fallback: &chain[1..],
            chain,
            index,
        }
    }

    /// Every rule's verdict on `signals`, in order, each evaluated (the
    /// decision is the first that holds): for explaining a route.
    pub fn verdicts<'a>(&'a self, signals: &'a Signals) -> impl Iterator<Item = Verdict<'a>> + 'a {
        self.rules.iter().map(move |r| Verdict {
            rule: &r.name,
            holds: r.when.matches(signals),
            route: &r.chain[0],
        })
    }

    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// Rule names in evaluation order (not including `"default"`), e.g. to
    /// pre-register metric labels.
    pub fn rule_names(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|r| r.name.as_str())
    }

    /// Each rule's name and the engine it routes to, in order.
    pub fn routes(&self) -> impl Iterator<Item = (&str, &str)> {
        self.rules
            .iter()
            .map(|r| (r.name.as_str(), r.chain[0].as_str()))
    }

    pub fn default_engine(&self) -> &str {
        &self.default_chain[0]
    }
}
