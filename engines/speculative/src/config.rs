//! The YAML options both speculative engines share.
//!
//! ```yaml
//! dflash:
//!   kind: dflash
//!   drafter: models/tiny-qwen3-dflash   # relative to config.yaml
//!   draft: drafter                      # or `ngram` (prompt lookup, no weights), or
//!                                       # `checkpoint` (mtp: the model's own MTP head)
//!   max_concurrent: 4
//!   lazy_drafter: false
//!   ngram: { max_ngram: 3, min_ngram: 1, draft_tokens: 8 }
//!   accept_window: { rounds: 256, seconds: 120, min_drafted: 16 }
//!   adaptive: true                      # draft only what pays (false: always the full block)
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::ngram::PromptLookup;

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DraftChoice {
    /// The engine's trained drafter checkpoint (`drafter:`).
    #[default]
    Drafter,
    /// Prompt lookup: no drafter weights.
    Ngram,
    /// The target checkpoint's own multi-token-prediction head (Qwen 3.5's
    /// `mtp.*` weights; the mtp engine): no drafter directory.
    Checkpoint,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NgramOptions {
    pub max_ngram: usize,
    pub min_ngram: usize,
    pub draft_tokens: usize,
}

impl Default for NgramOptions {
    fn default() -> Self {
        let d = PromptLookup::default();
        Self {
            max_ngram: d.max_ngram,
            min_ngram: d.min_ngram,
            draft_tokens: d.draft_tokens,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WindowOptions {
    pub rounds: usize,
    pub seconds: u64,
    /// Drafted tokens the window needs before `engine_accept_rate` is known.
    pub min_drafted: u64,
}

impl Default for WindowOptions {
    fn default() -> Self {
        Self {
            rounds: 256,
            seconds: 120,
            min_drafted: 16,
        }
    }
}

/// The engine section, parsed. Engine-specific keys (`draft_tokens`,
/// `max_batch`, `block_size`) are read by each engine through `extra`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecSettings {
    /// Plugin kind; read by the host.
    pub kind: Option<String>,
    pub drafter: Option<PathBuf>,
    #[serde(default)]
    pub draft: DraftChoice,
    pub max_concurrent: usize,
    #[serde(default)]
    pub lazy_drafter: bool,
    #[serde(default)]
    pub ngram: NgramOptions,
    #[serde(default)]
    pub accept_window: WindowOptions,
    /// Speculate only while at most this many sequences are running; plain
    /// decode above (default: no limit; adaptive sizing stops drafting
    /// where it does not pay at the batch's size).
    pub max_batch: Option<usize>,
    /// Tokens drafted per round by the trained drafter (mtp; dflash uses
    /// its checkpoint's block size unless this is set lower).
    pub draft_tokens: Option<usize>,
    /// Size each round's draft by measured acceptance and round cost
    /// ([`crate::adaptive`]); `false` verifies every full block.
    #[serde(default = "yes")]
    pub adaptive: bool,
    /// Hand running sequences over to the batched engine when it has work
    /// of its own, as the fast path does: one sequence speculating beside
    /// a batch would take turns with it on the device.
    #[serde(default)]
    pub hand_over: bool,
}

fn yes() -> bool {
    true
}

impl SpecSettings {
    /// Parses `section`, filling what it leaves out from `defaults`, and
    /// resolves `drafter` against `config_dir`.
    pub fn from_yaml(
        engine: &str,
        section: &serde_yaml::Value,
        config_dir: &Path,
        defaults: SpecSettings,
    ) -> Result<Self, String> {
        let mut merged = serde_yaml::to_value(DefaultsView::from(&defaults))
            .map_err(|e| format!("{engine} engine config: {e}"))?;
        if let (Some(base), Some(over)) = (merged.as_mapping_mut(), section.as_mapping()) {
            for (k, v) in over {
                base.insert(k.clone(), v.clone());
            }
        }
        let mut cfg: Self =
            serde_yaml::from_value(merged).map_err(|e| format!("{engine} engine config: {e}"))?;
        if cfg.max_concurrent == 0 {
            return Err(format!(
                "{engine} engine config: max_concurrent must be at least 1"
            ));
        }
        if cfg.max_batch == Some(0) || cfg.draft_tokens == Some(0) {
            return Err(format!(
                "{engine} engine config: max_batch and draft_tokens must be at least 1"
            ));
        }
        let n = &cfg.ngram;
        if n.min_ngram == 0 || n.min_ngram > n.max_ngram || n.draft_tokens == 0 {
            return Err(format!(
                "{engine} engine config: ngram needs 1 <= min_ngram <= max_ngram and draft_tokens >= 1"
            ));
        }
        if cfg.draft == DraftChoice::Drafter && cfg.drafter.is_none() {
            return Err(format!(
                "{engine} engine config: `drafter:` (a drafter checkpoint directory) is required unless `draft: ngram` or `draft: checkpoint`"
            ));
        }
        if cfg.draft == DraftChoice::Checkpoint && cfg.drafter.is_some() {
            return Err(format!(
                "{engine} engine config: `draft: checkpoint` drafts with the model's own MTP head; drop `drafter:`"
            ));
        }
        cfg.drafter = cfg.drafter.map(|p| {
            if p.is_absolute() {
                p
            } else {
                config_dir.join(p)
            }
        });
        Ok(cfg)
    }

    pub fn defaults(max_concurrent: usize, max_batch: Option<usize>) -> Self {
        Self {
            kind: None,
            drafter: None,
            draft: DraftChoice::Drafter,
            max_concurrent,
            lazy_drafter: false,
            ngram: NgramOptions::default(),
            accept_window: WindowOptions::default(),
            max_batch,
            draft_tokens: None,
            adaptive: true,
            hand_over: false,
        }
    }

    pub fn prompt_lookup(&self) -> PromptLookup {
        PromptLookup {
            max_ngram: self.ngram.max_ngram,
            min_ngram: self.ngram.min_ngram,
            draft_tokens: self.ngram.draft_tokens,
        }
    }

    pub fn window_age(&self) -> Duration {
        Duration::from_secs(self.accept_window.seconds)
    }
}

/// The defaults as YAML keys, so a section's keys override them one by one.
#[derive(serde::Serialize)]
struct DefaultsView {
    max_concurrent: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_batch: Option<usize>,
}

impl From<&SpecSettings> for DefaultsView {
    fn from(s: &SpecSettings) -> Self {
        Self {
            max_concurrent: s.max_concurrent,
            max_batch: s.max_batch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<SpecSettings, String> {
        SpecSettings::from_yaml(
            "dflash",
            &serde_yaml::from_str(yaml).unwrap(),
            Path::new("/etc/gw"),
            SpecSettings::defaults(4, None),
        )
    }

    #[test]
    fn defaults_fill_in_and_paths_resolve() {
        let c = parse("{ kind: dflash, drafter: d }").unwrap();
        assert_eq!(c.max_concurrent, 4);
        assert_eq!(c.max_batch, None);
        assert_eq!(c.drafter.as_deref(), Some(Path::new("/etc/gw/d")));
        assert_eq!(c.draft, DraftChoice::Drafter);
        let c =
            parse("{ kind: dflash, draft: ngram, max_concurrent: 2, ngram: { draft_tokens: 4 } }")
                .unwrap();
        assert_eq!(
            (c.max_concurrent, c.ngram.draft_tokens, c.ngram.max_ngram),
            (2, 4, 3)
        );
    }

    #[test]
    fn rejects_what_cannot_work() {
        assert!(parse("{ kind: dflash }").unwrap_err().contains("drafter"));
        assert!(parse("{ kind: dflash, draft: ngram, max_concurrent: 0 }").is_err());
        assert!(parse("{ kind: dflash, draft: ngram, ngram: { min_ngram: 4 } }").is_err());
        assert!(parse("{ kind: mtp, draft: checkpoint, drafter: d }")
            .unwrap_err()
            .contains("drop `drafter:`"));
        assert!(parse("{ kind: dflash, draft: ngram, bogus: 1 }")
            .unwrap_err()
            .contains("bogus"));
    }
}
