//! Routing policy: which engine serves a request, decided per request from
//! [`Signals`] by ordered rules written in YAML, hot-reloadable.
//!
//! # The `policy:` section
//!
//! ```yaml
//! policy:
//!   default: batched            # engine used when no rule matches (required)
//!   fallback: [batched]         # tried in order when the chosen engine refuses
//!   rules:                      # evaluated top to bottom; the first match wins
//!     - name: tools-need-batched
//!       when: { has_tools: true }
//!       route: batched
//!       fallback: [batched]     # replaces the policy-level fallback for this rule
//!     - name: long-context
//!       when: { prompt_tokens: { gte: 8192 } }
//!       route: batched
//!     - name: alone-and-greedy
//!       when: { greedy: true, total_active: { eq: 0 } }
//!       route: fastpath
//!     - name: speculate-when-quiet
//!       when:
//!         all:
//!           - { greedy: true }
//!           - { engine_active.dflash: { lt: 4 } }
//!           - not: { engine_accept_rate.dflash: { lt: 0.3 } }
//!       route: dflash
//! ```
//!
//! Every rule needs a unique, non-empty `name` (`default` is reserved: it is
//! what a decision reports when no rule matched), a `when` and a `route`.
//! `route`, `default` and every `fallback` entry must name a loaded engine.
//! A rule without its own `fallback` uses the policy's; `fallback: []` on a
//! rule means none. The chain a decision offers is the route then the
//! fallbacks, each engine once.
//!
//! ## Conditions
//!
//! A `when` is a mapping; every key in it must hold (a conjunction). Keys:
//!
//! | key | type | meaning |
//! |---|---|---|
//! | `prompt_tokens`, `max_tokens` | integer | request size |
//! | `total_active`, `total_queued` | integer | requests running / waiting on all engines |
//! | `engine_active.NAME`, `engine_queued.NAME` | integer | the same for engine `NAME` (missing data counts as 0) |
//! | `kv_pressure` | fraction 0..=1 | allocated KV blocks over total |
//! | `engine_accept_rate.NAME` | fraction 0..=1 | draft acceptance of speculative engine `NAME`; may be unknown |
//! | `engine_speedup.NAME` | ratio >= 0 | speculative engine `NAME`'s recent speed over plain decoding (tokens per target forward x decode-step cost / round cost); may be unknown |
//! | `greedy`, `has_tools`, `has_images` | `true` / `false` | request features |
//! | `model` | string or `{ in: [a, b] }` | the requested model |
//! | `all` / `any` | list of conditions | every one / at least one holds |
//! | `not` | one condition | it does not hold |
//!
//! Numeric keys take a bare number (equality) or a map of operators, all of
//! which must hold: `eq`, `ne`, `lt`, `lte`, `gt`, `gte`, e.g.
//! `prompt_tokens: { gte: 1024, lt: 8192 }`. Integer signals need integer
//! bounds; fraction bounds must lie in 0..=1 (so `85` for 85% is caught),
//! ratio bounds must be finite and >= 0.
//! Engine names inside dotted keys must be loaded engines.
//!
//! ## Unknown values
//!
//! An unknown `engine_accept_rate.NAME` (no drafts measured yet, or NaN)
//! makes every comparison on it false, `ne` included. `not` inverts that
//! like any false, so `not: { engine_accept_rate.dflash: { lt: 0.3 } }`
//! holds while the rate is unknown: "speculate until proven bad". Write
//! `engine_accept_rate.dflash: { gte: 0.3 }` instead for "only once proven
//! good". "Speculate while it pays" is one comparison:
//! `not: { engine_speedup.dflash: { lt: 1.0 } }`.
//!
//! # Use
//!
//! Build with [`Policy::from_config_yaml`] (or a sibling constructor) at
//! start, where an error is fatal; call [`Policy::decide`] per request; wrap
//! it in a [`PolicyHandle`] and [`PolicyHandle::spawn_watcher`] to pick up
//! edits, where a bad edit is logged and the old policy stays.

mod cases;
mod compile;
mod error;
mod eval;
mod policy;
mod reload;
mod schema;
mod signals;

pub use cases::{parse_cases, Case, CaseError, Outcome};
pub use error::{At, PolicyError};
pub use policy::{Decision, Policy, Verdict};
pub use reload::{ActivePolicy, PolicyHandle, Rejection, RuleHits};
pub use schema::{RawPolicy, RawRule};
pub use signals::Signals;
