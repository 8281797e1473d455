//! The thread behind an engine face that runs its requests on a thread of
//! its own: a job channel to it, the cancel handles of the requests it
//! holds (by id, for `Engine::cancel`), and shutdown: cancel them all,
//! close the channel, wait for the thread. Optionally supervised (a run
//! that panics is started again over the same channel), a handover sink
//! (sequences other engines hand over arrive as its jobs), and woken at
//! each job and cancellation where it waits on something besides its
//! channel (the KV pool). std locks only: plugins do not share
//! parking_lot's global tables.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;

pub use crossbeam_channel::Receiver;
use crossbeam_channel::Sender;
use engine_core::{CancelToken, EngineError, GenerateRequest, RequestId};

use crate::handover::{Handover, HandoverSink};

/// A job for the worker: carries its request.
pub trait Job: Send + 'static {
    fn request(&self) -> &GenerateRequest;
}

/// A job that can carry a sequence another engine hands over
/// ([`Worker::handover_sink`]).
pub trait Adopt: Job + Sized {
    fn adopt(handover: Handover) -> Self;
    /// The handover of a job the worker could not take, to give back.
    fn into_handover(self) -> Option<Handover>;
}

/// The cancel handles of the requests sent and not yet ended. The worker
/// removes a request's handle when it ends ([`Cancels::remove`], or a
/// [`Cancels::guard`] dropped with it).
#[derive(Clone, Default)]
pub struct Cancels(Arc<Mutex<HashMap<RequestId, CancelToken>>>);

impl Cancels {
    fn lock(&self) -> MutexGuard<'_, HashMap<RequestId, CancelToken>> {
        lock(&self.0)
    }

    pub fn remove(&self, id: RequestId) {
        self.lock().remove(&id);
    }

    /// Removes `id`'s handle when dropped: held by a request that ends
    /// in many places (a batch row).
    pub fn guard(&self, id: RequestId) -> CancelGuard {
        CancelGuard(self.clone(), id)
    }

    /// Requests sent and not yet ended (queued or running).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// See [`Cancels::guard`].
pub struct CancelGuard(Cancels, RequestId);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.0.remove(self.1);
    }
}

/// What wakes a worker that waits on something besides its channel.
type Wake = Arc<OnceLock<Box<dyn Fn() + Send + Sync>>>;

/// The way in: the channel (closed at shutdown), the cancel handles of
/// what was sent through it, and the worker's wake. The worker and its
/// handover sink share it.
struct Jobs<J> {
    tx: Arc<Mutex<Option<Sender<J>>>>,
    cancels: Cancels,
    wake: Wake,
}

impl<J> Clone for Jobs<J> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            cancels: self.cancels.clone(),
            wake: self.wake.clone(),
        }
    }
}

impl<J> Jobs<J> {
    fn wake(&self) {
        if let Some(wake) = self.wake.get() {
            wake();
        }
    }
}

impl<J: Job> Jobs<J> {
    /// Sends `job`, its request cancellable by id; the job back when the
    /// channel is closed.
    fn send(&self, job: J) -> Result<(), J> {
        let tx = lock(&self.tx);
        let Some(tx) = tx.as_ref() else {
            return Err(job);
        };
        let (id, cancel) = (job.request().id, job.request().cancel.clone());
        self.cancels.lock().insert(id, cancel);
        tx.send(job).map_err(|e| {
            self.cancels.remove(id);
            e.0
        })?;
        self.wake();
        Ok(())
    }
}

pub struct Worker<J> {
    jobs: Jobs<J>,
    thread: Mutex<Option<JoinHandle<()>>>,
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
        let (tx, rx) = crossbeam_channel::unbounded();
        let cancels = Cancels::default();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-worker"))
            .spawn({
                let cancels = cancels.clone();
                move || run(rx, cancels)
            })
            .map_err(|e| format!("{name}: cannot start the worker thread: {e}"))?;
        Ok(Self {
            jobs: Jobs {
                tx: Arc::new(Mutex::new(Some(tx))),
                cancels,
                wake: Wake::default(),
            },
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Has `wake` run after each job sent (its handover sink's too) and
    /// each cancellation, by id or at shutdown: what wakes a worker that
    /// waits on something besides its channel, such as the KV pool
    /// (`KvPool::wake`). Set once.
    pub fn waking(self, wake: impl Fn() + Send + Sync + 'static) -> Self {
        let _ = self.jobs.wake.set(Box::new(wake));
        self
    }

    /// [`Worker::spawn`], with `run` started again over the same channel
    /// when it panics: the requests it held are lost (their streams end
    /// without a final event, which benches the engine until the host's
    /// probe finds it serving again), what is still queued is not;
    /// `restarted` runs before each new start. Ends when `run` returns.
    pub fn supervised(
        name: &str,
        mut run: impl FnMut(Receiver<J>, Cancels) + Send + 'static,
        restarted: impl Fn() + Send + 'static,
    ) -> Result<Self, String> {
        let label = name.to_owned();
        Self::spawn(name, move |jobs, cancels| loop {
            let ran = catch_unwind(AssertUnwindSafe(|| run(jobs.clone(), cancels.clone())));
            if ran.is_ok() {
                return;
            }
            tracing::error!(engine = %label, "the worker panicked; its requests are lost; starting it again");
            restarted();
        })
    }

    /// Sends a job, its request cancellable by id until the worker removes
    /// it; after shutdown the job is dropped and the answer is
    /// `ShuttingDown`.
    pub fn send(&self, job: J) -> Result<(), EngineError> {
        self.jobs.send(job).map_err(|_| EngineError::ShuttingDown)
    }
}

impl<J: Adopt> Worker<J> {
    /// A sink that takes sequences other engines hand over as jobs of this
    /// worker (cancellable by id as the rest); `busy` says whether the
    /// engine has work of its own. After shutdown it gives them back.
    pub fn handover_sink(
        &self,
        busy: impl Fn() -> bool + Send + Sync + 'static,
    ) -> Arc<dyn HandoverSink> {
        Arc::new(Sink {
            jobs: self.jobs.clone(),
            busy,
        })
    }
}

struct Sink<J, B> {
    jobs: Jobs<J>,
    busy: B,
}

impl<J: Adopt, B: Fn() -> bool + Send + Sync> HandoverSink for Sink<J, B> {
    fn adopt(&self, handover: Handover) -> Result<(), Box<Handover>> {
        self.jobs.send(J::adopt(handover)).map_err(|job| {
            Box::new(
                job.into_handover()
                    .expect("an adopted job carries its handover"),
            )
        })
    }

    fn busy(&self) -> bool {
        (self.busy)()
    }
}

impl<J> Worker<J> {
    pub fn cancel(&self, id: RequestId) {
        if let Some(c) = self.jobs.cancels.lock().get(&id) {
            c.cancel();
        }
        self.jobs.wake();
    }

    /// The cancel handles, for what removes a request's handle when it
    /// ends outside the worker's loop (a guard dropped with it).
    pub fn cancels(&self) -> &Cancels {
        &self.jobs.cancels
    }

    /// Requests sent and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.jobs.cancels.len()
    }

    /// Whether it takes jobs: not shut down, the thread still running.
    pub fn is_alive(&self) -> bool {
        lock(&self.jobs.tx).is_some()
            && lock(&self.thread)
                .as_ref()
                .is_some_and(|t| !t.is_finished())
    }

    /// Cancels every request it holds and waits for the thread to end, so
    /// no memory a request uses is freed under it.
    pub fn shutdown(&self) {
        lock(&self.jobs.tx).take();
        for c in self.jobs.cancels.lock().values() {
            c.cancel();
        }
        self.jobs.wake();
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

    #[test]
    fn a_supervised_worker_starts_again_after_a_panic_with_what_was_queued() {
        let (done, finished) = crossbeam_channel::unbounded();
        let restarts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let worker = Worker::supervised(
            "test",
            move |jobs: Receiver<Sleep>, cancels| {
                for Sleep(req) in jobs {
                    let _handle = cancels.guard(req.id);
                    assert!(req.prompt != [0], "injected panic");
                    done.send(req.id).unwrap();
                }
            },
            {
                let restarts = restarts.clone();
                move || {
                    restarts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            },
        )
        .unwrap();
        let (lost, kept) = (
            GenerateRequest::new(vec![0], 1),
            GenerateRequest::new(vec![1], 1),
        );
        worker.send(Sleep(lost)).unwrap();
        worker.send(Sleep(kept.clone())).unwrap();
        let timeout = std::time::Duration::from_secs(10);
        assert_eq!(finished.recv_timeout(timeout).unwrap(), kept.id);
        assert_eq!(restarts.load(std::sync::atomic::Ordering::SeqCst), 1);
        worker.shutdown();
        assert_eq!(
            worker.in_flight(),
            0,
            "both handles gone with their requests"
        );
    }

    enum Task {
        Run(Box<GenerateRequest>),
        Adopted(Box<Handover>),
    }

    impl Job for Task {
        fn request(&self) -> &GenerateRequest {
            match self {
                Task::Run(r) => r,
                Task::Adopted(h) => &h.request,
            }
        }
    }

    impl Adopt for Task {
        fn adopt(handover: Handover) -> Self {
            Task::Adopted(Box::new(handover))
        }

        fn into_handover(self) -> Option<Handover> {
            match self {
                Task::Adopted(h) => Some(*h),
                Task::Run(_) => None,
            }
        }
    }

    fn handover(pool: &crate::KvPool) -> Handover {
        let (events, _stream) = engine_core::event::event_channel();
        Handover {
            request: GenerateRequest::new(vec![1, 2], 4),
            cache: crate::KvCache::new(0, 1),
            last_token: 3,
            generated: vec![3],
            cached_tokens: 0,
            reservation: pool.try_reserve(1).unwrap(),
            events,
        }
    }

    #[test]
    fn handed_over_sequences_arrive_as_jobs_cancellable_by_id_until_shutdown() {
        let pool = crate::KvPool::new(4, 16, 1);
        let (seen, arrived) = crossbeam_channel::unbounded();
        let worker = Worker::spawn("test", move |jobs: Receiver<Task>, _| {
            for task in jobs {
                seen.send(task).unwrap();
            }
        })
        .unwrap();
        let sink = worker.handover_sink(|| true);
        assert!(sink.busy());
        let h = handover(&pool);
        let (id, cancel) = (h.request.id, h.request.cancel.clone());
        assert!(sink.adopt(h).is_ok());
        let timeout = std::time::Duration::from_secs(10);
        let task = arrived.recv_timeout(timeout).unwrap();
        assert!(matches!(&task, Task::Adopted(h) if h.request.id == id));
        worker.cancel(id);
        assert!(cancel.is_cancelled(), "cancelled by id like a request sent");
        drop(task);
        worker.shutdown();
        let Err(back) = sink.adopt(handover(&pool)) else {
            panic!("a sink adopted after shutdown");
        };
        assert_eq!(back.reservation.blocks(), 1, "given back with its blocks");
        assert!(matches!(
            worker.send(Task::Run(Box::new(GenerateRequest::new(vec![1], 1)))),
            Err(EngineError::ShuttingDown)
        ));
    }

    #[test]
    fn a_job_waiting_for_kv_blocks_wakes_at_its_cancellation_and_at_shutdown() {
        let pool = crate::KvPool::new(2, 16, 1);
        let _full = pool.try_reserve(2).unwrap();
        let (ended, ends) = crossbeam_channel::unbounded();
        let worker = Worker::spawn("test", {
            let pool = pool.clone();
            move |jobs: Receiver<Sleep>, cancels| {
                for Sleep(req) in jobs {
                    let reserved = pool.reserve_waiting(1, || req.cancel.is_cancelled());
                    ended.send((req.id, reserved.unwrap().is_some())).unwrap();
                    cancels.remove(req.id);
                }
            }
        })
        .unwrap()
        .waking({
            let pool = pool.clone();
            move || pool.wake()
        });
        let (a, b) = (
            GenerateRequest::new(vec![1], 1),
            GenerateRequest::new(vec![2], 1),
        );
        worker.send(Sleep(a.clone())).unwrap();
        worker.send(Sleep(b.clone())).unwrap();
        worker.cancel(a.id);
        let timeout = std::time::Duration::from_secs(10);
        assert_eq!(ends.recv_timeout(timeout).unwrap(), (a.id, false));
        worker.shutdown();
        assert_eq!(
            ends.try_recv().unwrap(),
            (b.id, false),
            "ended before shutdown returned"
        );
    }
}
