//! The policy as written in YAML, before validation. These types accept
//! anything structurally plausible so that [`crate::Policy::compile`] can
//! reject mistakes with messages that name the rule and field; serde alone
//! would only name a path.

use serde::Deserialize;

/// A standalone policy document: exactly one top-level `policy:` key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPolicyDocument {
    pub policy: RawPolicy,
}

/// The body of the `policy:` section. Unknown keys are rejected so that a
/// typo such as `fallbacks:` does not silently do nothing.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    /// Engine used when no rule matches.
    pub default: String,
    /// Engines tried in order when the chosen engine refuses.
    #[serde(default)]
    pub fallback: Vec<String>,
    #[serde(default)]
    pub rules: Vec<RawRule>,
}

/// One rule as written. Fields are optional here only so that a missing one
/// is reported against the rule's name rather than a bare YAML path.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    pub name: Option<String>,
    /// A mapping of conditions; kept as YAML because its keys are signal
    /// names, which the compiler resolves.
    pub when: Option<serde_yaml::Value>,
    pub route: Option<String>,
    /// Replaces the policy-level `fallback` for this rule when present
    /// (an empty list means "no fallback").
    pub fallback: Option<Vec<String>>,
}
