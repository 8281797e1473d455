//! Any text as config.yaml's policy: a valid policy or an error naming the
//! problem, and a valid one decides on any signals without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use policies::{Policy, Signals};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let engines = ["batched", "fastpath", "dflash"];
    for parse in [Policy::from_config_yaml, Policy::from_yaml] {
        if let Ok(policy) = parse(text, &engines) {
            let mut signals = Signals::default();
            for (i, byte) in data.iter().take(8).enumerate() {
                signals.prompt_tokens = (*byte as u64) << i;
                signals.greedy = byte % 2 == 0;
                signals.total_active = *byte as u64 % 5;
                signals.kv_pressure = *byte as f64 / 255.0;
                let decision = policy.decide(&signals);
                assert!(!decision.chain().is_empty());
            }
        }
    }
});
