//! What an idle client costs usher in memory (DESIGN.md: PgBouncer keeps an
//! idle client in about 1.2 KB; usher aims to match it).

mod common;

use common::{PgCluster, UsherProcess};

/// Resident memory of a process now, from /proc.
fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/pid/status")
}

/// Opens `n` clients that each ran a query and now sit idle.
async fn idle_clients(usher: &UsherProcess, n: usize) -> Vec<tokio_postgres::Client> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        let (c, _driver) = usher.alice().await;
        c.batch_execute("SELECT 1").await.unwrap();
        clients.push(c);
    }
    clients
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_client_costs_a_few_kilobytes() {
    let pg = PgCluster::shared();
    // trust: thousands of SCRAM logins would only measure PBKDF2.
    let usher = UsherProcess::start(
        pg,
        "pool_mode: transaction\npool_size: 2\nauth:\n  method: trust\n",
    );
    let pid = usher.child.id();
    // Warm up: the pool, its server connections, the allocator's arenas.
    let warm = idle_clients(&usher, 100).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let before = rss_kb(pid);
    let n = 2000;
    let more = idle_clients(&usher, n).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let after = rss_kb(pid);
    let per_client = (after.saturating_sub(before)) as f64 / n as f64;
    eprintln!(
        "idle clients: {before} KB with 100, {after} KB with {}: {per_client:.1} KB each",
        n + 100
    );
    // 5.5 KB measured (debug and release builds); the bound catches a
    // regression such as a buffer kept while idle or a large array in the
    // serve future.
    assert!(per_client < 8.0, "{per_client:.1} KB per idle client");
    drop((warm, more));
}
