//! One single-threaded tokio runtime per worker thread: a "shard".
//!
//! A TCP client is accepted by a shard on that shard's own listening
//! socket (`listen::bind_each`: the sockets share the address and the
//! kernel spreads connections over them), a Unix-socket client is handed
//! to one (round robin), and either lives there to the end: its login, its
//! session, the server connections it opens. Nothing a transaction does wakes another thread, which on a
//! multi-threaded scheduler it often did (a second worker cost 11-27% more
//! CPU per transaction, docs/benchmarks/2026-12-03-workers.md), and the
//! pools keep their idle connections per shard ([`current`]) so a client
//! mostly gets one that its own thread's reactor watches.
//!
//! The Unix-domain socket's accept loop, the signal handlers, the metrics
//! endpoint and the background work run on the runtime that calls
//! [`crate::Server::run`].

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// What [`current`] says off the shards (the main runtime's thread, hook
/// threads, tests' runtimes).
pub const NONE: usize = usize::MAX;

thread_local! {
    static SHARD: Cell<usize> = const { Cell::new(NONE) };
}

/// The shard the calling thread runs, or [`NONE`]: which idle list a pool
/// gives from first and returns to, and which reactor a server
/// connection's socket is registered with.
pub fn current() -> usize {
    SHARD.with(Cell::get)
}

/// How many shards `workers` asks for: 0 is one per CPU.
pub fn count_for(workers: usize) -> usize {
    match workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// The running shards. Dropping it stops them: each thread leaves its
/// runtime, and the tasks still on it (clients, when the server was not
/// shut down first) are dropped with it.
pub struct Shards {
    handles: Vec<Handle>,
    next: AtomicUsize,
    _stop: Vec<oneshot::Sender<()>>,
}

impl Shards {
    /// Starts `n` shards (at least one), each a thread named
    /// `usher-worker-{i}` running a current-thread runtime.
    pub fn start(n: usize) -> std::io::Result<Shards> {
        let n = n.max(1);
        let mut handles = Vec::with_capacity(n);
        let mut stops = Vec::with_capacity(n);
        for i in 0..n {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            stops.push(stop);
            std::thread::Builder::new()
                .name(format!("usher-worker-{i}"))
                .spawn(move || {
                    SHARD.with(|s| s.set(i));
                    // The runtime runs its tasks, I/O and timers only while
                    // this thread is in block_on.
                    let _ = runtime.block_on(stopped);
                })?;
        }
        Ok(Shards {
            handles,
            next: AtomicUsize::new(0),
            _stop: stops,
        })
    }

    /// How many shards there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Runs `task` on shard `i` (modulo their number).
    pub fn spawn_on<F>(&self, i: usize, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handles[i % self.handles.len()].spawn(task)
    }

    /// Runs `task` on the next shard in turn.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        self.handles[i].spawn(task)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_go_round_the_shards_and_know_which_they_are_on() {
        let shards = Shards::start(2).unwrap();
        assert_eq!(current(), NONE, "not a shard's thread");
        let mut seen = Vec::new();
        for _ in 0..4 {
            let on = shards
                .spawn(async { (current(), std::thread::current().name().map(String::from)) })
                .await
                .unwrap();
            seen.push(on);
        }
        let names: Vec<_> = seen.iter().map(|(_, n)| n.clone().unwrap()).collect();
        assert_eq!(
            names,
            [
                "usher-worker-0",
                "usher-worker-1",
                "usher-worker-0",
                "usher-worker-1"
            ]
        );
        assert_eq!(
            seen.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
    }

    #[tokio::test]
    async fn dropping_the_shards_ends_their_tasks() {
        let shards = Shards::start(1).unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        shards.spawn(async move {
            let _held = tx;
            std::future::pending::<()>().await
        });
        drop(shards);
        // The sender is dropped with the task when the runtime goes.
        assert!(rx.await.is_err());
    }
}
