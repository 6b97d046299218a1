//! The cost of a hook event: nobody handles it, hooks are switched off, or
//! one trivial Lua hook runs (on a hook thread: the hand-over is part of
//! it); and the CPU time, every thread's, of a login's two hook calls.
//! Targets (issue 5): no-hook dispatch under 50 ns; a trivial Lua hook
//! under 10 µs per call.
//!
//!     cargo bench --bench hooks

use criterion::{criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use std::time::Duration;
use usher::config::PoolMode;
use usher::hooks::lua::{HookThreads, LuaEngine, LuaServices, LuaSettings};
use usher::hooks::query::QueryPool;
use usher::hooks::roles::RoleCache;
use usher::hooks::shared::SharedStore;
use usher::hooks::{ClientInfo, ConnectionCtx, Dispatcher, SessionCtx, SessionReason, Vars};

fn client() -> ClientInfo {
    ClientInfo {
        id: 1,
        user: "alice".into(),
        database: "app".into(),
        application_name: "bench".into(),
        startup: vec![("user".to_string(), "alice".to_string())].into(),
        addr: usher::client_addr::ClientAddr::Tcp("127.0.0.1:5000".parse().unwrap()),
        tls: None,
        auth_method: "scram-sha-256",
        pool_mode: PoolMode::Transaction,
    }
}

fn trivial_lua(dir: &std::path::Path) -> Arc<LuaEngine> {
    std::fs::write(
        dir.join("10-trivial.lua"),
        "function client_connection(ctx) end\nfunction session_start(ctx) ctx:set('application_name', 'x') end\n",
    )
    .unwrap();
    let settings = LuaSettings {
        dir: dir.to_path_buf(),
        timeout: Duration::from_millis(100),
        memory_limit: 32 << 20,
        max_idle_vms: 4,
        vars_max_bytes: 65536,
    };
    let services = Arc::new(LuaServices {
        shared: SharedStore::new(100, 1 << 20),
        roles: Arc::new(RoleCache::default()),
        query: Arc::new(QueryPool::new(None, 1, Duration::from_secs(1))),
        threads: HookThreads::new(),
        reconnects: Default::default(),
    });
    LuaEngine::load(settings, services).expect("the trivial hook loads")
}

fn dispatch(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let engine = trivial_lua(dir.path());
    let info = client();

    let none = Dispatcher::new(true, false);
    let off = Dispatcher::new(false, false);
    off.set_hooks(engine.hooks());
    let lua = Dispatcher::new(true, false);
    lua.set_hooks(engine.hooks());

    let mut group = c.benchmark_group("client_connection");
    for (name, d) in [
        ("no hooks", &none),
        ("switch off", &off),
        ("trivial lua hook", &lua),
    ] {
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let mut vars = Vars::new();
                let mut ctx = ConnectionCtx {
                    client: &info,
                    vars: &mut vars,
                    reject: None,
                    params: vec![],
                    notices: vec![],
                    route: None,
                };
                d.client_connection(&mut ctx).await;
                assert!(ctx.reject.is_none());
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("session_start");
    for (name, d) in [
        ("no hooks", &none),
        ("switch off", &off),
        ("trivial lua hook", &lua),
    ] {
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let mut vars = Vars::new();
                let mut ctx = SessionCtx {
                    client: &info,
                    vars: &mut vars,
                    reason: SessionReason::NewSession,
                    server: None,
                    params: vec![],
                    exec: vec![],
                    notices: vec![],
                    warnings: vec![],
                };
                d.session_start(&mut ctx).await;
                ctx.params.len()
            })
        });
    }
    group.finish();
}

/// The process's CPU time so far (user + system, every thread: the hook
/// threads' share of a call too).
fn process_cpu() -> Duration {
    // SAFETY: getrusage writes the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// A trivial hook's client_connection and session_start, one after the
/// other as in a login, measured in CPU time rather than wall time: on a
/// loaded machine the wall time of a hand-over between threads is mostly
/// waiting for a core.
fn cpu_per_login(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let engine = trivial_lua(dir.path());
    let info = client();
    let lua = Dispatcher::new(true, false);
    lua.set_hooks(engine.hooks());
    let mut group = c.benchmark_group("cpu");
    group.bench_function("both hooks of a login (process CPU)", |b| {
        b.iter_custom(|iters| {
            let started = process_cpu();
            rt.block_on(async {
                for _ in 0..iters {
                    let mut vars = Vars::new();
                    let mut ctx = ConnectionCtx {
                        client: &info,
                        vars: &mut vars,
                        reject: None,
                        params: vec![],
                        notices: vec![],
                        route: None,
                    };
                    lua.client_connection(&mut ctx).await;
                    let mut ctx = SessionCtx {
                        client: &info,
                        vars: &mut vars,
                        reason: SessionReason::NewSession,
                        server: None,
                        params: vec![],
                        exec: vec![],
                        notices: vec![],
                        warnings: vec![],
                    };
                    lua.session_start(&mut ctx).await;
                }
            });
            process_cpu() - started
        })
    });
    group.finish();
}

criterion_group!(benches, dispatch, cpu_per_login);
criterion_main!(benches);
