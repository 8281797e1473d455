//! The plugin's `tracing` forwards to the host's. Each `cdylib` has its own
//! copy of `tracing` with its own global dispatcher, so the plugin installs
//! (once) a subscriber that formats each event and hands it to the host's
//! [`RawLog`] callback, which re-emits it in the host's log.

use std::fmt::Write;
use std::sync::Once;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::Level;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

use super::abi::{Bytes, RawLog};

pub fn level_code(level: Level) -> u8 {
    match level {
        Level::ERROR => 1,
        Level::WARN => 2,
        Level::INFO => 3,
        Level::DEBUG => 4,
        Level::TRACE => 5,
    }
}

fn filter_of(code: u8) -> LevelFilter {
    match code {
        0 => LevelFilter::OFF,
        1 => LevelFilter::ERROR,
        2 => LevelFilter::WARN,
        3 => LevelFilter::INFO,
        4 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// The host's most verbose recorded level, as a [`RawLog::max_level`] code.
pub fn max_level_code(filter: LevelFilter) -> u8 {
    filter.into_level().map_or(0, level_code)
}

struct Forward(RawLog);

// The host's callback is thread-safe (it logs through the host's tracing).
unsafe impl Send for Forward {}
unsafe impl Sync for Forward {}

#[derive(Default)]
struct Message {
    message: String,
    fields: String,
}

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={}", field.name(), value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={:?}", field.name(), value);
        }
    }
}

thread_local! {
    /// Set while a record is being forwarded: when host and plugin are one
    /// image (in-process tests), the host's re-emitted record would come
    /// back here.
    static FORWARDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl<S: tracing::Subscriber> Layer<S> for Forward {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if FORWARDING.with(|f| f.replace(true)) {
            return;
        }
        self.forward(event);
        FORWARDING.with(|f| f.set(false));
    }
}

impl Forward {
    fn forward(&self, event: &tracing::Event<'_>) {
        let meta = event.metadata();
        let mut m = Message::default();
        event.record(&mut m);
        m.message.push_str(&m.fields);
        // SAFETY: the host's callback lives for the process.
        unsafe {
            (self.0.log)(
                self.0.ctx,
                level_code(*meta.level()),
                Bytes::new(meta.target().as_bytes()),
                Bytes::new(m.message.as_bytes()),
            )
        }
    }
}

/// Installs the forwarding subscriber as this image's global default, once.
pub fn install(log: RawLog) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let subscriber = tracing_subscriber::registry()
            .with(filter_of(log.max_level))
            .with(Forward(log));
        let _ = tracing::subscriber::set_global_default(subscriber);
    });
}

/// The host's end: plugin records re-emitted under the `plugin` target, the
/// plugin's module path in `module`.
pub fn host_log() -> RawLog {
    unsafe extern "C" fn log(
        _ctx: *mut std::ffi::c_void,
        level: u8,
        target: Bytes,
        message: Bytes,
    ) {
        let target = String::from_utf8_lossy(target.as_slice());
        let message = String::from_utf8_lossy(message.as_slice());
        match level {
            1 => tracing::error!(target: "plugin", module = %target, "{message}"),
            2 => tracing::warn!(target: "plugin", module = %target, "{message}"),
            3 => tracing::info!(target: "plugin", module = %target, "{message}"),
            4 => tracing::debug!(target: "plugin", module = %target, "{message}"),
            _ => tracing::trace!(target: "plugin", module = %target, "{message}"),
        }
    }
    RawLog {
        ctx: std::ptr::null_mut(),
        log,
        max_level: max_level_code(LevelFilter::current()),
    }
}
