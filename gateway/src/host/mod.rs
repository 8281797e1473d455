//! The plugin host: opens engine plugins, checks their versions, loads the
//! model once and builds one engine per `engines:` entry over it.

pub mod plugins;
pub mod registry;

pub use registry::{EngineEntry, Registry};
