//! What every engine shares with the gateway: the [`Engine`] trait, the
//! validated request an engine receives, the events it streams back, and the
//! plugin ABI the gateway loads engines through. No MLX here.

pub mod engine;
pub mod event;
pub mod panic_barrier;
pub mod plugin;
pub mod request;

pub use engine::{Capabilities, Engine, EngineError, EngineLoad, Needs, Refusal, Unsupported};
pub use event::{
    Event, EventSender, EventSink, EventStream, Finish, FinishReason, SpecStats, StreamError,
    TokenEvent,
};
pub use plugin::{EngineContext, ModelFacts, TokenizerSource};
pub use request::{
    CancelFlag, CancelToken, GenerateRequest, Grammar, ImageInput, RequestId, SamplingDefaults,
    SamplingParams,
};
