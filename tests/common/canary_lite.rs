//! A client beside a failure-path test, until the lead's canary.rs is on
//! main (the same API: `Canary::start(port)`, `check()`; swap the `use`).

use std::time::Duration;

/// `select 1` every 10 ms through usher as bob (a pool of his own), on a
/// thread and runtime of its own, failing the test on a stall over 250 ms.
pub struct Canary {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Result<Duration, String>>,
}

impl Canary {
    pub fn start(port: u16) -> Canary {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let (ready, connected) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let conn = format!(
                    "host=127.0.0.1 port={port} user=bob password={} dbname=app",
                    super::BOB_PASSWORD
                );
                let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
                    .await
                    .map_err(|e| format!("connect: {e}"))?;
                tokio::spawn(driver);
                // Warm: bob's pool opens its server connection now, not
                // during the first measured query.
                c.simple_query("select 1")
                    .await
                    .map_err(|e| format!("first select 1: {e}"))?;
                let _ = ready.send(());
                let mut slowest = Duration::ZERO;
                while !stopping.load(Ordering::Relaxed) {
                    let started = std::time::Instant::now();
                    tokio::time::timeout(Duration::from_secs(10), c.simple_query("select 1"))
                        .await
                        .map_err(|_| "select 1 hung".to_string())?
                        .map_err(|e| format!("select 1: {e}"))?;
                    slowest = slowest.max(started.elapsed());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Ok(slowest)
            })
        });
        connected
            .recv_timeout(Duration::from_secs(10))
            .expect("the canary connects");
        Canary { stop, thread }
    }

    pub fn check(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let slowest = self.thread.join().unwrap().expect("the canary");
        assert!(
            slowest <= Duration::from_millis(250),
            "the canary stalled {slowest:?}"
        );
    }
}
