//! Everything textual lives here once, so every engine behaves the same on
//! the wire. Engines are token-in, token-out; this crate turns text into
//! tokens (tokenizer, chat template) and tokens back into API output
//! (streaming detokenizer, stop strings, reasoning split, tool calls).

pub mod detokenizer;
pub mod eos;
pub mod reasoning;
pub mod stop;
pub mod template;
pub mod tokenizer;
pub mod tools;

pub use detokenizer::StreamDecoder;
pub use template::{ChatTemplate, RenderOptions};
pub use tokenizer::Tokenizer;
