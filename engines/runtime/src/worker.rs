//! The thread behind an engine face that runs its requests on a thread of
//! its own: a job channel to it, the cancel handles of the requests it
//! holds (by id, for `Engine::cancel`), and shutdown: cancel them all,
//! close the channel, wait for the thread. std locks only: plugins do not
//! share parking_lot's global tables.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use engine_core::{CancelToken, EngineError, GenerateRequest, RequestId};

/// A job for the worker: carries its request.
pub trait Job: Send + 'static {
    fn request(&self) -> &GenerateRequest;
}

/// The cancel handles of the requests sent and not yet ended. The worker
/// removes a request's handle when it ends ([`Cancels::remove`]).
#[derive(Clone, Default)]
pub struct Cancels(Arc<Mutex<HashMap<RequestId, CancelToken>>>);

impl Cancels {
    fn lock(&self) -> MutexGuard<'_, HashMap<RequestId, CancelToken>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn remove(&self, id: RequestId) {
        self.lock().remove(&id);
    }

    /// Requests sent and not yet ended (queued or running).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub struct Worker<J> {
    jobs: Mutex<Option<Sender<J>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    cancels: Cancels,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<J: Job> Worker<J> {
    /// Starts the thread `{name}-worker` running `run` over the jobs sent.
    pub fn spawn(
        name: &str,
        run: impl FnOnce(Receiver<J>, Cancels) + Send + 'static,
    ) -> Result<Self, String> {
        let (tx, rx) = mpsc::channel();
        let cancels = Cancels::default();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-worker"))
            .spawn({
                let cancels = cancels.clone();
                move || run(rx, cancels)
            })
            .map_err(|e| format!("{name}: cannot start the worker thread: {e}"))?;
        Ok(Self {
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            cancels,
        })
    }

    /// Sends a job, its request cancellable by id until the worker removes
    /// it; after shutdown the job is dropped and the answer is
    /// `ShuttingDown`.
    pub fn send(&self, job: J) -> Result<(), EngineError> {
        let jobs = lock(&self.jobs);
        let jobs = jobs.as_ref().ok_or(EngineError::ShuttingDown)?;
        let (id, cancel) = (job.request().id, job.request().cancel.clone());
        self.cancels.lock().insert(id, cancel);
        jobs.send(job).map_err(|_| {
            self.cancels.remove(id);
            EngineError::ShuttingDown
        })
    }
}

impl<J> Worker<J> {
    pub fn cancel(&self, id: RequestId) {
        if let Some(c) = self.cancels.lock().get(&id) {
            c.cancel();
        }
    }

    /// The cancel handles, for what removes a request's handle when it
    /// ends outside the worker's loop (a guard dropped with it).
    pub fn cancels(&self) -> &Cancels {
        &self.cancels
    }

    /// Requests sent and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.cancels.len()
    }

    /// Whether it takes jobs: not shut down, the thread still running.
    pub fn is_alive(&self) -> bool {
        lock(&self.jobs).is_some()
            && lock(&self.thread)
                .as_ref()
                .is_some_and(|t| !t.is_finished())
    }

    /// Cancels every request it holds and waits for the thread to end, so
    /// no memory a request uses is freed under it.
    pub fn shutdown(&self) {
        lock(&self.jobs).take();
        for c in self.cancels.lock().values() {
            c.cancel();
        }
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl<J> Drop for Worker<J> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sleep(GenerateRequest);

    impl Job for Sleep {
        fn request(&self) -> &GenerateRequest {
            &self.0
        }
    }

    /// The worker loop every engine writes: take a job, run it until it
    /// ends or is cancelled, forget its handle.
    fn until_cancelled(rx: Receiver<Sleep>, cancels: Cancels) {
        for Sleep(req) in rx {
            while !req.cancel.is_cancelled() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            cancels.remove(req.id);
        }
    }

    #[test]
    fn cancel_reaches_the_running_request_and_shutdown_waits_for_it() {
        let worker = Worker::spawn("test", until_cancelled).unwrap();
        let (a, b) = (
            GenerateRequest::new(vec![1], 1),
            GenerateRequest::new(vec![2], 1),
        );
        let (a_cancel, b_cancel) = (a.cancel.clone(), b.cancel.clone());
        worker.send(Sleep(a.clone())).unwrap();
        worker.send(Sleep(b)).unwrap();
        assert_eq!(worker.in_flight(), 2);
        worker.cancel(a.id);
        assert!(a_cancel.is_cancelled() && !b_cancel.is_cancelled());
        assert!(worker.is_alive());
        worker.shutdown();
        assert!(b_cancel.is_cancelled());
        assert_eq!(worker.in_flight(), 0, "both ended before shutdown returned");
        assert!(!worker.is_alive());
        assert!(matches!(
            worker.send(Sleep(GenerateRequest::new(vec![3], 1))),
            Err(EngineError::ShuttingDown)
        ));
    }
}
