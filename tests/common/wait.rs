//! Waiting for events, not for time: poll a condition until it holds, and
//! fail (panic, naming what was awaited) once a deadline passes. The
//! deadline is generous (a loaded machine is slow, not wrong); a passing
//! wait returns as soon as the condition holds.
//!
//! A fixed sleep stays only where time passing is the point of the test
//! (a timeout must expire, a client stays idle, nothing may happen for a
//! while), with a comment saying so.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// The usual deadline of a wait.
pub const DEADLINE: Duration = Duration::from_secs(15);

/// The pause between two polls: short at first, then longer, so a quick
/// event is seen quickly and a slow one does not make the test spin.
fn backoff(pause: Duration) -> Duration {
    (pause * 2).min(Duration::from_millis(50))
}

const FIRST_PAUSE: Duration = Duration::from_millis(5);

/// Polls `f` until it returns `Ok`, and returns that value; panics after
/// `timeout` with `what` and the last `Err` (what was seen instead).
pub fn wait_for<T, E: Debug>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<T, E>,
) -> T {
    let deadline = Instant::now() + timeout;
    let mut pause = FIRST_PAUSE;
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() >= deadline => {
                panic!("{what}: not within {timeout:?}; last seen: {e:?}")
            }
            Err(_) => {}
        }
        std::thread::sleep(pause);
        pause = backoff(pause);
    }
}

/// Polls `cond` until it holds; panics after `timeout` naming `what`.
pub fn eventually(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    wait_for(timeout, what, || if cond() { Ok(()) } else { Err(()) })
}

/// [`wait_for`] for async conditions (it sleeps on the tokio timer, so
/// other tasks of the test run meanwhile).
pub async fn wait_for_async<T, E: Debug, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + timeout;
    let mut pause = FIRST_PAUSE;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() >= deadline => {
                panic!("{what}: not within {timeout:?}; last seen: {e:?}")
            }
            Err(_) => {}
        }
        tokio::time::sleep(pause).await;
        pause = backoff(pause);
    }
}

/// [`eventually`] for async conditions.
pub async fn eventually_async<F, Fut>(timeout: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for_async(timeout, what, || {
        let fut = cond();
        async move {
            if fut.await {
                Ok(())
            } else {
                Err(())
            }
        }
    })
    .await
}

/// Whether process `pid` has exited (gone, or a zombie not yet reaped):
/// its sockets are closed then.
pub fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat[stat.rfind(')').unwrap() + 2..].starts_with(['Z', 'X']),
        Err(_) => true,
    }
}

/// Whether process `pid` holds a TCP socket listening on 127.0.0.1:`port`
/// (from /proc: the listening socket's inode among the process's
/// descriptors), as opposed to any process answering on that port.
pub fn listens_on(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    let want = format!("0100007F:{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // local_address, st (0A = LISTEN), inode.
            (f.len() > 9 && f[1] == want && f[3] == "0A").then(|| format!("socket:[{}]", f[9]))
        })
        .collect();
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
}
