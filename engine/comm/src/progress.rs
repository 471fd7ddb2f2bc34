//! The per-rank progress thread shared by every backend: started collectives (`start_*`) are
//! queued here and run in issue order on one thread owned by the communicator; a synchronous
//! call first [`ProgressQueue::drain`]s the queue so calls on one rank never reorder.

use crate::comm::{Completed, PendingOp, PendingWait};
use crate::error::{CallDesc, CommError};
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// A started collective: runs on the progress thread and yields its buffers.
pub(crate) type Job = Box<dyn FnOnce() -> Result<Completed, CommError> + Send>;

/// One-shot completion cell shared by the progress thread and a [`PendingOp`]: the result and
/// when the progress thread finished the job.
type Cell1 = Arc<(
    Mutex<Option<(Result<Completed, CommError>, Instant)>>,
    Condvar,
)>;

struct Pending {
    cell: Cell1,
}

impl PendingWait for Pending {
    fn wait(self: Box<Self>) -> Result<Completed, CommError> {
        self.wait_timed().0
    }
    fn wait_timed(self: Box<Self>) -> (Result<Completed, CommError>, Option<Instant>) {
        let (m, cv) = &*self.cell;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some((r, at)) = g.take() {
                return (r, Some(at));
            }
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
    fn is_complete(&self) -> bool {
        self.cell
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

struct Worker {
    tx: Option<mpsc::Sender<(Job, Cell1)>>,
    handle: Option<JoinHandle<()>>,
    /// Number of jobs finished, with a condvar to wait for a count.
    done: Arc<(Mutex<u64>, Condvar)>,
    issued: u64,
}

/// The queue of one rank's started collectives; its thread starts on first use.
pub(crate) struct ProgressQueue {
    backend: &'static str,
    rank: usize,
    thread_name: String,
    worker: RefCell<Option<Worker>>,
}

impl ProgressQueue {
    /// A queue for `rank` of `backend` (named in errors); `thread_name` names the OS thread.
    pub(crate) fn new(backend: &'static str, rank: usize, thread_name: String) -> Self {
        ProgressQueue {
            backend,
            rank,
            thread_name,
            worker: RefCell::new(None),
        }
    }

    /// Waits until every queued collective has finished.
    pub(crate) fn drain(&self) {
        let w = self.worker.borrow();
        if let Some(w) = w.as_ref() {
            let (m, cv) = &*w.done;
            let mut d = m.lock().unwrap_or_else(|e| e.into_inner());
            while *d < w.issued {
                d = cv.wait(d).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// Queues `job` (started thread on first use) and returns its handle. A job that panics
    /// completes with [`CommError::PeerFailed`] naming this rank.
    ///
    /// Errors: [`CommError::Unsupported`] if the thread cannot be spawned or has stopped.
    pub(crate) fn submit(&self, call: CallDesc, job: Job) -> Result<PendingOp, CommError> {
        let mut slot = self.worker.borrow_mut();
        if slot.is_none() {
            let (tx, rx) = mpsc::channel::<(Job, Cell1)>();
            let done = Arc::new((Mutex::new(0u64), Condvar::new()));
            let done2 = done.clone();
            let rank = self.rank;
            let handle = std::thread::Builder::new()
                .name(self.thread_name.clone())
                .spawn(move || {
                    for (job, cell) in rx {
                        let r = catch_unwind(AssertUnwindSafe(job)).unwrap_or_else(|p| {
                            Err(CommError::PeerFailed {
                                peer: rank,
                                reason: crate::thread::panic_message(&*p),
                            })
                        });
                        let at = Instant::now();
                        *cell.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((r, at));
                        cell.1.notify_all();
                        let (m, cv) = &*done2;
                        *m.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                        cv.notify_all();
                    }
                })
                .map_err(|e| CommError::Unsupported {
                    backend: self.backend,
                    what: format!("cannot spawn the progress thread of rank {rank}: {e}"),
                })?;
            *slot = Some(Worker {
                tx: Some(tx),
                handle: Some(handle),
                done,
                issued: 0,
            });
        }
        let w = slot.as_mut().expect("progress thread exists");
        let cell: Cell1 = Arc::new((Mutex::new(None), Condvar::new()));
        let sent =
            w.tx.as_ref()
                .map(|tx| tx.send((job, cell.clone())).is_ok())
                .unwrap_or(false);
        if !sent {
            return Err(CommError::Unsupported {
                backend: self.backend,
                what: format!("the progress thread of rank {} has stopped", self.rank),
            });
        }
        w.issued += 1;
        Ok(PendingOp::deferred(call, Box::new(Pending { cell })))
    }

    /// Finishes the queued collectives and joins the thread (used on drop).
    pub(crate) fn shutdown(&mut self) {
        if let Some(mut w) = self.worker.get_mut().take() {
            drop(w.tx.take());
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
    }
}
