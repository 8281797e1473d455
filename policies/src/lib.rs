//! Routing policy: which engine serves a request, decided per request from
//! [`Signals`] by ordered rules written in YAML, hot-reloadable.
//!
//! # The `policy:` section
//!
//! ```yaml
//! policy:
//!   default: batched            # engine used when no rule matches (required)
//!   fallback: [batched]         # tried in order when the chosen engine is full
//!   rules:                      # evaluated top to bottom; the first match wins
//!     - name: long-context
//!       when: { prompt_tokens: { gte: 8192 } }
//!       route: batched
//!       fallback: []            # replaces the policy-level fallback for this rule
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
//! Rules need not say what engines can serve: the host knows each engine's
//! declared capabilities (`engine_core::Capabilities`: plain greedy only,
//! tools, images, grammars, logprobs, exclusive) and routes with
//! [`Policy::decide_where`], which passes over a rule whose engine cannot
//! take the request as if its condition did not hold; the next rule that
//! holds decides, else the default. In the chain, engines that cannot take
//! it are skipped ([`Decision::first_where`]); the fallbacks are for
//! engines that can but are full or out of service.
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
//! # Trying a policy before it ships
//!
//! `gateway policy test --config config.yaml --cases CASES.yaml` routes
//! each case's signals with this crate's evaluation ([`Case::check`], the
//! same [`Policy::decide_where`] requests get, over the config's engines
//! built for their capabilities) and exits non-zero when any case
//! lands elsewhere than it expects, so a policy change can be checked in
//! CI. A case file ([`parse_cases`]):
//!
//! ```yaml
//! cases:
//!   - name: a request with images is batched
//!     signals: { has_images: true, greedy: true }
//!     engine: batched
//!     rule: default              # optional: the rule that must decide
//!   - name: one greedy request alone takes the fast path
//!     signals: { greedy: true, prompt_tokens: 40, max_tokens: 200 }
//!     engine: fastpath
//! ```
//!
//! `signals` takes the condition keys above with values. Unset ones are
//! an idle server (nothing running or queued, `kv_pressure` 0, no
//! speculative measurement yet: `engine_accept_rate` and `engine_speedup`
//! unknown) and a request of zero tokens, sampled (`greedy: false`),
//! without tools or images, naming no model. A name that is no signal
//! fails the run with its line (`line 5: cases[0].signals: unknown signal
//! `total_actve``), as does an engine the config does not have.
//! `policies/examples/config-cases.yaml` holds the cases of the
//! repository's config.yaml; CI runs them (`tests/tests/policy_cli.rs`):
//!
//! ```text
//! $ gateway policy test --config config.yaml --cases policies/examples/config-cases.yaml
//! ok    a request with tools alone is speculated by prompt lookup: lookup (rule `speculate-while-it-pays`)
//! ...
//! ok    drafts rejected lately, one sampled request alone takes the fast path: fastpath (rule `alone`)
//! 11 cases, 0 failed
//! ```
//!
//! `gateway policy explain --config config.yaml --request REQUEST.json`
//! takes an API request body (chat, completions or responses) and prints
//! the signals the gateway reads from it, every rule's verdict
//! ([`Policy::verdicts`]) and the engine chosen. `model`, `greedy`,
//! `has_tools`, `has_images` and `max_tokens` come from the body as the
//! gateway parses it (`greedy` after the checkpoint's sampling defaults,
//! `model.generation_config`); `prompt_tokens` from the model's tokenizer
//! and chat template (the model and the engines load, a few seconds: the
//! engines for their capabilities; images need a given count). An optional
//! `"signals"` object in the file sets live load and overrides any of them
//! (`prompt_tokens` there spares counting;
//! `max_tokens` then defaults to `default_max_tokens` unbounded by the
//! context, and `greedy` is the body's own, the checkpoint unread); unset live load is an idle server.
//! `policies/examples/explain-request.json`:
//!
//! ```text
//! $ gateway policy explain --config config.yaml --request policies/examples/explain-request.json
//! request: chat completion
//! signals:
//!   model: "smollm2-135m-instruct"
//!   prompt_tokens: 37
//!   max_tokens: 64
//!   greedy: true
//!   ...
//! rules (the first that holds, routing to an engine that accepts the request, decides):
//!   long-context             -      route batched
//!   ...
//!   busy                     -      route batched
//!   speculate-while-it-pays  holds  route lookup  <- decides
//!   ...
//! engine: lookup (rule `speculate-while-it-pays`, then batched)
//! ```
//!
//! A rule that holds but whose engine cannot take the request is marked
//! `<- passed over: fastpath: it does not serve requests with tools`.
//!
//! A running gateway shows its policy at `GET /v1/policy` (behind the API
//! keys when they are set): the `policy:` section in force, a hash of it,
//! when it loaded, each rule's route and hits since then (the default
//! last), and the last reload refused since then with its error
//! ([`PolicyHandle::active`], [`PolicyHandle::last_rejected`]).
//!
//! # Use
//!
//! Build with [`Policy::from_config_yaml`] (or a sibling constructor) at
//! start, where an error is fatal; call [`Policy::decide_where`] per request; wrap
//! it in a [`PolicyHandle`] and [`PolicyHandle::spawn_watcher`] to pick up
//! edits, where a bad edit is logged and the old policy stays; route
//! through [`ActivePolicy::decide_where`] to count hits per rule.

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
