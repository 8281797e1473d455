//! The plugin host: opens engine plugins, checks their versions, loads the
//! model once and builds one engine per `engines:` entry over it.

pub mod entry;
pub mod memory;
pub mod plugins;
pub mod probe;
pub mod registry;
pub mod warm;

pub use entry::{takes, EngineEntry, FaultKind};
pub use registry::Registry;
