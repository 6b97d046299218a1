//! The hook threads: the OS threads Lua runs on, never a runtime worker.
//!
//! A hook call is a job on a shared queue; an idle hook thread takes it,
//! runs it, and answers through a oneshot the client's task awaits until
//! the call's deadline. Lua code is stopped at its deadline by the
//! instruction-count hook (armed by the watchdog, see watchdog.rs), but a single C call (a catastrophic
//! `string.find`) is not: its client gets its timeout at the deadline all
//! the same, and the thread, still in the call, is set aside: its priority
//! is lowered to the least (nice 19), it no longer counts as a pool
//! thread, and it ends once the call returns (after throwing its VM away).
//! New jobs go to other threads; a call starts a thread when none is idle.
//!
//! Bounds: at most [`HookThreads::max_threads`] threads serve at once, and
//! while [`HookThreads::max_stuck`] or more are set aside no thread is
//! started to replace one (calls then wait for the threads left and fail
//! at their deadline). Idle threads beyond one end after a minute.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How long past its deadline a call's answer is awaited. An ordinary
/// overrun (Lua code stopped by the budget) answers within it, and keeps
/// its thread.
const SLACK: Duration = Duration::from_millis(5);

/// Hook threads set aside, still in a call past its deadline.
const STUCK_GAUGE: &str = crate::metrics::HOOK_THREADS_STUCK;

/// Set aside: the least priority there is.
const SET_ASIDE_NICE: i32 = 19;

thread_local! {
    /// True on hook threads.
    static ON_HOOK_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// An idle thread beyond the first ends after this long without a job.
const IDLE_EXIT: Duration = Duration::from_secs(60);

// A job's life (Ticket::state); changed under the queue's lock.
const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
/// Its caller left while it waited in the queue: skipped.
const DROPPED: u8 = 2;
/// Still running at its deadline: its thread is set aside.
const SET_ASIDE: u8 = 3;
const DONE: u8 = 4;

/// A job's state, shared by its caller and the thread running it.
struct Ticket {
    state: AtomicU8,
    /// The kernel's id of the thread running it (to lower its priority).
    tid: AtomicI32,
}

struct Job {
    /// None for work nobody waits for (dropping VMs).
    ticket: Option<Arc<Ticket>>,
    work: Box<dyn FnOnce() + Send>,
}

struct Queue {
    jobs: VecDeque<Job>,
    /// Threads waiting for a job.
    idle: usize,
    /// Threads serving (not set aside).
    serving: usize,
    /// Threads set aside, still in a call past its deadline.
    stuck: usize,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    max_threads: usize,
    max_stuck: usize,
}

/// The pool of hook threads (one per pooler, across reloads).
pub struct HookThreads {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for HookThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = self.shared.queue.lock();
        f.debug_struct("HookThreads")
            .field("serving", &q.serving)
            .field("stuck", &q.stuck)
            .finish_non_exhaustive()
    }
}

/// Why a job gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoAnswer {
    /// Its deadline passed.
    Late,
    /// The job ended without answering (it panicked).
    Lost,
}

impl Default for HookThreads {
    fn default() -> Self {
        HookThreads::new()
    }
}

impl HookThreads {
    /// A pool sized for this machine: at most four threads per core (at
    /// least 8) serving, calls waiting on `usher.query` included; at most
    /// two per core (at least 4) set aside before none is replaced.
    pub fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        HookThreads::with_bounds((4 * cores).max(8), (2 * cores).max(4))
    }

    pub fn with_bounds(max_threads: usize, max_stuck: usize) -> Self {
        HookThreads {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue {
                    jobs: VecDeque::new(),
                    idle: 0,
                    serving: 0,
                    stuck: 0,
                    closed: false,
                }),
                ready: Condvar::new(),
                max_threads: max_threads.max(1),
                max_stuck,
            }),
        }
    }

    pub fn max_threads(&self) -> usize {
        self.shared.max_threads
    }

    pub fn max_stuck(&self) -> usize {
        self.shared.max_stuck
    }

    /// Threads set aside, still in a call past its deadline.
    pub fn stuck(&self) -> usize {
        self.shared.queue.lock().stuck
    }

    /// Runs `work` on a hook thread and awaits its answer until `deadline`
    /// (and [`SLACK`]). `work` answers through the sender it is given, so
    /// it can go on after answering (throwing a VM away) without delaying
    /// the caller.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        deadline: Instant,
        work: impl FnOnce(oneshot::Sender<T>) + Send + 'static,
    ) -> Result<T, NoAnswer> {
        let (tx, rx) = oneshot::channel();
        let ticket = Arc::new(Ticket {
            state: AtomicU8::new(QUEUED),
            tid: AtomicI32::new(0),
        });
        self.submit(Job {
            ticket: Some(ticket.clone()),
            work: Box::new(move || work(tx)),
        });
        let mut waiting = Waiting {
            threads: self,
            ticket: &ticket,
            armed: true,
        };
        let answer = tokio::time::timeout_at((deadline + SLACK).into(), rx).await;
        waiting.armed = false;
        match answer {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(NoAnswer::Lost),
            Err(_) => {
                self.overrun(&ticket);
                Err(NoAnswer::Late)
            }
        }
    }

    /// Runs `work` on a hook thread, nobody waiting (dropping VMs).
    pub(super) fn spawn(&self, work: impl FnOnce() + Send + 'static) {
        self.submit(Job {
            ticket: None,
            work: Box::new(work),
        });
    }

    fn submit(&self, job: Job) {
        let start = {
            let mut q = self.shared.queue.lock();
            q.jobs.push_back(job);
            if q.idle >= q.jobs.len() {
                self.shared.ready.notify_one();
                false
            } else {
                self.shared.may_start(&mut q)
            }
        };
        if start {
            self.shared.clone().start_thread();
        }
    }

    /// The deadline passed without an answer. A job still queued is
    /// skipped; a job still running holds its thread in a C call (Lua code
    /// would have been stopped): the thread is set aside.
    fn overrun(&self, ticket: &Ticket) {
        let mut q = self.shared.queue.lock();
        match ticket.state.load(Ordering::Relaxed) {
            QUEUED => ticket.state.store(DROPPED, Ordering::Relaxed),
            RUNNING => {
                ticket.state.store(SET_ASIDE, Ordering::Relaxed);
                q.serving -= 1;
                q.stuck += 1;
                lower_priority(ticket.tid.load(Ordering::Relaxed), SET_ASIDE_NICE);
                let stuck = q.stuck;
                metrics::gauge!(STUCK_GAUGE).set(stuck as f64);
                let start = q.idle < q.jobs.len() && self.shared.may_start(&mut q);
                drop(q);
                tracing::warn!(
                    stuck,
                    "a hook call is still running past its deadline (one long C call, such as a \
                     string.find that backtracks): its client had its timeout; the thread is set \
                     aside at the lowest priority and ends when the call returns"
                );
                if stuck >= self.shared.max_stuck {
                    tracing::error!(
                        stuck,
                        "hook threads stuck past their deadline reached the bound: none is replaced \
                         until one returns, and hook calls may fail at their deadline; fix the hook \
                         (DISABLE HOOKS on the console stops calling it) and restart usher to end them"
                    );
                }
                if start {
                    self.shared.clone().start_thread();
                }
            }
            _ => {}
        }
    }
}

impl Drop for HookThreads {
    fn drop(&mut self) {
        self.shared.queue.lock().closed = true;
        self.shared.ready.notify_all();
    }
}

/// Drops a waiting caller's job from the queue if the caller goes away
/// first (its client left).
struct Waiting<'a> {
    threads: &'a HookThreads,
    ticket: &'a Ticket,
    armed: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _q = self.threads.shared.queue.lock();
            if self.ticket.state.load(Ordering::Relaxed) == QUEUED {
                self.ticket.state.store(DROPPED, Ordering::Relaxed);
            }
        }
    }
}

impl Shared {
    /// Whether one more thread may start (and counts it if so). Only
    /// threads other than hook threads start one: a thread has its
    /// creator's priority, and a set-aside hook thread's is the least.
    fn may_start(&self, q: &mut Queue) -> bool {
        if q.closed
            || q.serving >= self.max_threads
            || q.stuck >= self.max_stuck
            || ON_HOOK_THREAD.get()
        {
            return false;
        }
        q.serving += 1;
        true
    }

    fn start_thread(self: Arc<Self>) {
        let shared = self.clone();
        let started = std::thread::Builder::new()
            .name("usher-hook".into())
            .spawn(move || shared.serve());
        if let Err(e) = started {
            self.queue.lock().serving -= 1;
            tracing::error!(error = %e, "could not start a hook thread");
        }
    }

    /// A hook thread: takes jobs until the pool closes, it has been idle
    /// long enough, or it was set aside.
    fn serve(self: Arc<Self>) {
        ON_HOOK_THREAD.set(true);
        let tid = thread_id();
        let mut q = self.queue.lock();
        loop {
            if let Some(job) = q.jobs.pop_front() {
                if let Some(t) = &job.ticket {
                    if t.state.load(Ordering::Relaxed) != QUEUED {
                        // Its caller is gone. Dropped unlocked: what it
                        // holds (the last Arc of an engine) may submit.
                        parking_lot::MutexGuard::unlocked(&mut q, || drop(job));
                        continue;
                    }
                    t.tid.store(tid, Ordering::Relaxed);
                    t.state.store(RUNNING, Ordering::Relaxed);
                }
                let started = Instant::now();
                parking_lot::MutexGuard::unlocked(&mut q, || {
                    // A panic loses this job's answer (its caller sees
                    // NoAnswer::Lost), not the thread.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job.work));
                });
                let Some(t) = &job.ticket else { continue };
                if t.state.swap(DONE, Ordering::Relaxed) == SET_ASIDE {
                    // Lowered in priority for good: this thread ends (the
                    // next call starts one in its place if none is idle).
                    q.stuck -= 1;
                    metrics::gauge!(STUCK_GAUGE).set(q.stuck as f64);
                    drop(q);
                    tracing::warn!(
                        ran_ms = started.elapsed().as_millis() as u64,
                        "a hook thread set aside at its call's deadline returned; it ends"
                    );
                    return;
                }
                continue;
            }
            if q.closed {
                q.serving -= 1;
                return;
            }
            q.idle += 1;
            let timed_out = self.ready.wait_for(&mut q, IDLE_EXIT).timed_out();
            q.idle -= 1;
            if timed_out && q.jobs.is_empty() && q.serving > 1 {
                q.serving -= 1;
                return;
            }
        }
    }
}

#[cfg(target_os = "linux")]
fn thread_id() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

#[cfg(not(target_os = "linux"))]
fn thread_id() -> i32 {
    0
}

/// Lowers thread `tid`'s priority by `by` (nice; at most to 19). A
/// thread's priority cannot be raised again without privileges.
#[cfg(target_os = "linux")]
fn lower_priority(tid: i32, by: i32) {
    if tid <= 0 {
        return;
    }
    // SAFETY: getpriority/setpriority on a thread id of this process; errno
    // is this thread's. An error (the thread just ended) changes nothing.
    unsafe {
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        if now == -1 && *libc::__errno_location() != 0 {
            return;
        }
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, (now + by).min(19));
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority(_tid: i32, _by: i32) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[tokio::test]
    async fn a_job_runs_on_a_hook_thread_and_answers() {
        let threads = HookThreads::with_bounds(2, 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        let name = threads
            .run(deadline, |tx| {
                let _ = tx.send(std::thread::current().name().map(str::to_string));
            })
            .await;
        assert_eq!(name, Ok(Some("usher-hook".to_string())));
    }

    #[tokio::test]
    async fn a_job_stuck_past_its_deadline_holds_no_other_caller() {
        let threads = HookThreads::with_bounds(2, 2);
        let release = Arc::new(AtomicBool::new(false));
        let r = release.clone();
        let stuck = threads
            .run(Instant::now() + Duration::from_millis(50), move |tx| {
                while !r.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let _ = tx.send(());
            })
            .await;
        assert_eq!(stuck, Err(NoAnswer::Late));
        assert_eq!(threads.stuck(), 1);
        // Two more calls, each on a thread of its own.
        for _ in 0..2 {
            let answer = threads
                .run(Instant::now() + Duration::from_secs(5), |tx| {
                    let _ = tx.send(7);
                })
                .await;
            assert_eq!(answer, Ok(7));
        }
        release.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while threads.stuck() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            threads.stuck(),
            0,
            "the set-aside thread returned and ended"
        );
    }

    #[tokio::test]
    async fn past_the_bound_of_stuck_threads_none_is_replaced() {
        let threads = HookThreads::with_bounds(1, 1);
        let release = Arc::new(AtomicBool::new(false));
        let r = release.clone();
        let first = threads
            .run(Instant::now() + Duration::from_millis(20), move |tx| {
                while !r.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let _ = tx.send(());
            })
            .await;
        assert_eq!(first, Err(NoAnswer::Late));
        // No thread serves and none may start: the call fails at its deadline.
        let second = threads
            .run(Instant::now() + Duration::from_millis(20), |tx| {
                let _ = tx.send(());
            })
            .await;
        assert_eq!(second, Err(NoAnswer::Late));
        release.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let answer = threads
                .run(Instant::now() + Duration::from_millis(200), |tx| {
                    let _ = tx.send(());
                })
                .await;
            if answer.is_ok() {
                break;
            }
            assert!(Instant::now() < deadline, "a thread serves again");
        }
    }

    #[tokio::test]
    async fn a_skipped_job_may_submit_when_dropped() {
        // What a job holds can submit work when dropped (an engine's last
        // Arc drops its idle VMs on a hook thread); a job skipped because
        // its caller left is dropped outside the queue's lock.
        struct SubmitsOnDrop(Arc<HookThreads>);
        impl Drop for SubmitsOnDrop {
            fn drop(&mut self) {
                self.0.spawn(|| ());
            }
        }
        let threads = Arc::new(HookThreads::with_bounds(1, 1));
        let release = Arc::new(AtomicBool::new(false));
        let r = release.clone();
        let busy = {
            let threads = threads.clone();
            tokio::spawn(async move {
                threads
                    .run(Instant::now() + Duration::from_secs(10), move |tx| {
                        while !r.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        let _ = tx.send(());
                    })
                    .await
            })
        };
        while threads.shared.queue.lock().serving == 0 || threads.shared.queue.lock().idle > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let held = SubmitsOnDrop(threads.clone());
        let skipped = threads
            .run(Instant::now() + Duration::from_millis(20), move |tx| {
                let _held = held;
                let _ = tx.send(());
            })
            .await;
        assert_eq!(skipped, Err(NoAnswer::Late));
        release.store(true, Ordering::Relaxed);
        assert_eq!(busy.await.unwrap(), Ok(()));
        // The thread takes the skipped job and the one its drop submitted.
        loop {
            let settled = {
                let q = threads.shared.queue.try_lock_for(Duration::from_secs(5));
                let q = q.expect("the queue's lock is free (no thread deadlocked on it)");
                q.jobs.is_empty() && q.idle == 1
            };
            if settled {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let answer = threads
            .run(Instant::now() + Duration::from_secs(10), |tx| {
                let _ = tx.send(3);
            })
            .await;
        assert_eq!(answer, Ok(3), "the thread is not stuck on the queue's lock");
    }

    #[tokio::test]
    async fn a_panicking_job_loses_its_answer_not_the_thread() {
        let threads = HookThreads::with_bounds(1, 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        let lost = threads.run::<()>(deadline, |_tx| panic!("in a job")).await;
        assert_eq!(lost, Err(NoAnswer::Lost));
        let answer = threads
            .run(deadline, |tx| {
                let _ = tx.send(1);
            })
            .await;
        assert_eq!(answer, Ok(1));
    }
}
