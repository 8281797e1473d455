//! Any token ids (in vocabulary or not) through the gateway's whole text
//! pipeline: streaming detokenizer, stop strings, reasoning split and tool
//! calls, with a real generated tokenizer. Errors are fine; panics are not.
#![no_main]

use std::sync::OnceLock;

use gateway::pipeline::{Pipeline, PipelineOptions};
use libfuzzer_sys::fuzz_target;
use text::reasoning::ReasoningFormat;
use fixtures::tokenizer::write_tokenizer;
use fixtures::Family;
use text::tools::ToolFormat;
use text::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<(tempfile::TempDir, Tokenizer)> = OnceLock::new();
    &TOKENIZER
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            write_tokenizer(dir.path(), Family::Qwen3, 512).unwrap();
            let tok = Tokenizer::from_dir(dir.path()).unwrap();
            (dir, tok)
        })
        .1
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let ids: Vec<u32> = rest
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32 % 600)
        .collect();
    let (prompt, generated) = ids.split_at(ids.len().min(mode as usize % 4));
    let options = PipelineOptions {
        stop: if mode & 0x10 != 0 { vec!["e".into(), "</".into()] } else { vec![] },
        reasoning: match mode % 3 {
            0 => ReasoningFormat::None,
            1 => ReasoningFormat::Think,
            _ => ReasoningFormat::GemmaChannel,
        },
        starts_in_reasoning: mode & 0x20 != 0,
        tools: match (mode >> 6) % 4 {
            0 => None,
            1 => Some(ToolFormat::Hermes),
            2 => Some(ToolFormat::Llama3Json),
            _ => Some(ToolFormat::Gemma),
        },
    };
    let mut pipeline = Pipeline::new(tokenizer().clone(), prompt, &options);
    for &id in generated {
        match pipeline.push(id) {
            Ok(step) if step.stopped => break,
            Ok(_) => {}
            Err(_) => return,
        }
    }
    let _ = pipeline.finish();
});
