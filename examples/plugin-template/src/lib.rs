//! `engine-template`: the smallest real engine plugin, kept as the starting
//! point for third-party authors (docs/plugins.md). One plain greedy request
//! at a time on its own thread, over the gateway's shared model: it reserves
//! its KV blocks in the shared pool at submit (or refuses, so the router
//! tries another engine), takes the shared device lock, and leaves the
//! prefix cache (a repeated prompt's longest kept prefix is not computed
//! again) and every per-token rule (stop tokens, cancellation,
//! `max_tokens`, usage counts, one final event after the blocks go back)
//! to the runtime's `Sequence`.
//!
//! ```yaml
//! plugins: [path/to/libengine_template.so]
//! engines:
//!   tmpl: { kind: template }
//! ```

use std::sync::Arc;

use engine_core::{
    Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender, GenerateRequest,
    RequestId, StreamError,
};
use runtime::sequence::Sequence;
use runtime::worker::{self, Worker};
use runtime::{Reservation, SharedModel};

struct Job {
    request: GenerateRequest,
    events: EventSender,
    reservation: Reservation,
}

impl worker::Job for Job {
    fn request(&self) -> &GenerateRequest {
        &self.request
    }
}

struct Template {
    name: String,
    shared: Arc<SharedModel>,
    worker: Worker<Job>,
}

fn create(ctx: EngineContext) -> Result<Box<dyn Engine>, String> {
    let shared = SharedModel::from_context(&ctx)?;
    let worker = Worker::<Job>::spawn(&ctx.name, {
        let shared = shared.clone();
        move |jobs, cancels| {
            for job in jobs {
                let id = job.request.id;
                serve(&shared, job);
                cancels.remove(id);
            }
        }
    })?;
    tracing::info!(engine = %ctx.name, model = %shared.model.name, "template engine ready");
    Ok(Box::new(Template {
        name: ctx.name,
        shared,
        worker,
    }))
}

/// Generates one request start to finish; its stream ends with exactly one
/// `Finished` or `Error`.
fn serve(shared: &SharedModel, job: Job) {
    let Job {
        request,
        events,
        reservation,
    } = job;
    // An invalid request (say, its sampling) ends here with its error.
    let Some(mut seq) = Sequence::start_on(shared, request, events, reservation) else {
        return;
    };
    // Greedy decoding from the prefix cache's longest hit, each step
    // queued before the previous token is read; the sequence decides when
    // it ends and keeps its prompt and answer for the next turn.
    let decoded = {
        let _device = shared.lock_device();
        seq.decode(shared, || {})
    };
    match decoded {
        Ok(reason) => seq.finish(reason, None),
        Err(e) => seq.fail(StreamError::Internal(format!("generation failed: {e}"))),
    }
}

impl Engine for Template {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        // Plain greedy text; no tools, images, grammars or logprobs.
        Capabilities {
            greedy_only: true,
            ..Capabilities::default()
        }
    }

    fn submit_to(&self, req: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        // What `capabilities` leaves out never arrives: the gateway applies
        // it. This checks only what the engine itself must hold true.
        runtime::admission::check_request(&req, &self.shared.model)?;
        // KV for the whole answer, now: a full pool refuses the request
        // (the router tries the next engine) rather than queueing it.
        let tokens = req.prompt.len() + req.max_tokens as usize;
        let per_token = self.shared.model.model.kv_bytes_per_token();
        let reservation =
            runtime::admission::reserve(&self.shared.kv_pool, &req, tokens, per_token)?;
        self.worker.send(Job {
            request: req,
            events,
            reservation,
        })
    }

    fn cancel(&self, id: RequestId) {
        self.worker.cancel(id);
    }

    fn load(&self) -> EngineLoad {
        let in_flight = self.worker.in_flight();
        EngineLoad {
            active: in_flight.min(1),
            queued: in_flight.saturating_sub(1),
            kv_blocks_held: 0,
            healthy: self.worker.is_alive(),
            // accept_rate and expected_speedup are for speculative engines.
            ..EngineLoad::default()
        }
    }

    fn shutdown(&self) {
        self.worker.shutdown();
    }
}

runtime::export_engine!("template", create);
