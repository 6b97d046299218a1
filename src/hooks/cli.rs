//! `usher hooks check` and `usher hooks try`: for people writing hooks.

use super::builtin::Blocking;
use super::lua::{self, LuaServices};
use super::query::QueryPool;
use super::roles::RoleCache;
use super::shared::SharedStore;
use super::{ClientInfo, ConnectionCtx, Dispatcher, Event, Hook, SessionCtx, SessionReason, Vars};
use crate::client_addr::{ClientAddr, LocalPeer};
use crate::config::{Config, PoolMode};
use crate::hooks::lua::LuaSettings;
use clap::Subcommand;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// `hooks try --addr`: an IP address, or `unix`.
#[derive(Debug, Clone, Copy)]
pub enum ClientAddrArg {
    Ip(std::net::IpAddr),
    Unix,
}

fn made_up_addr(text: &str) -> Result<ClientAddrArg, String> {
    match text {
        "unix" => Ok(ClientAddrArg::Unix),
        ip => ip
            .parse()
            .map(ClientAddrArg::Ip)
            .map_err(|_| format!("expected an IP address or `unix`, got `{ip}`")),
    }
}

#[derive(Debug, Subcommand)]
pub enum HooksCommand {
    /// Compile every hook file and report errors with file and line.
    Check,
    /// Run the hooks of one event against a made-up client and print the decision.
    Try {
        /// client_connection or session_start.
        event: String,
        #[arg(long, default_value = "postgres")]
        user: String,
        #[arg(long, default_value = "postgres")]
        database: String,
        /// Client address, or `unix` for a client of the Unix-domain socket.
        #[arg(long, default_value = "127.0.0.1", value_parser = made_up_addr)]
        addr: ClientAddrArg,
        #[arg(long, default_value = "")]
        application_name: String,
        /// session or transaction (default: the configured pool mode).
        #[arg(long)]
        pool_mode: Option<String>,
    },
}

fn services(config: &Config) -> Arc<LuaServices> {
    let q = config.hooks.query.as_ref();
    Arc::new(LuaServices {
        shared: SharedStore::new(config.hooks.shared_max_keys, config.hooks.shared_max_bytes),
        roles: Arc::new(RoleCache::default()),
        query: Arc::new(QueryPool::new(
            config.hook_query_connection(),
            1,
            Duration::from_millis(q.map_or(1000, |q| q.timeout_ms)),
        )),
        threads: super::lua::HookThreads::new(),
        reconnects: Default::default(),
    })
}

pub fn run(config: &Config, command: HooksCommand) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let settings = LuaSettings::from_config(config);
        let sources = match lua::read_sources(&settings.dir) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        };
        match command {
            HooksCommand::Check => match lua::check(&sources, &settings, services(config)) {
                Ok(()) => {
                    println!(
                        "{} hook file(s) in {} compile:",
                        sources.len(),
                        settings.dir.display()
                    );
                    for s in &sources {
                        println!("  {}", s.name);
                    }
                    ExitCode::SUCCESS
                }
                Err(errors) => {
                    for e in errors {
                        eprintln!("{e}");
                    }
                    ExitCode::from(1)
                }
            },
            HooksCommand::Try {
                event,
                user,
                database,
                addr,
                application_name,
                pool_mode,
            } => {
                let services = services(config);
                let engine = match lua::LuaEngine::load(settings, services.clone()) {
                    Ok(e) => e,
                    Err(errors) => {
                        for e in errors {
                            eprintln!("{e}");
                        }
                        return ExitCode::from(1);
                    }
                };
                let dispatcher =
                    Dispatcher::new(true, config.hooks.on_error == crate::config::OnError::Allow);
                // The built-in blocking rules run first, as in the pooler.
                let mut hooks: Vec<Arc<dyn Hook>> = Vec::new();
                match Blocking::from_config(
                    &config.blocking,
                    services.roles.clone(),
                    services.query.clone(),
                ) {
                    Ok(b) if b.active() => hooks.push(Arc::new(b)),
                    Ok(_) => {}
                    Err(issue) => {
                        eprintln!("{}: {issue}", config.source);
                        return ExitCode::from(2);
                    }
                }
                hooks.extend(engine.hooks());
                dispatcher.set_hooks(hooks);
                let pool_mode = match pool_mode.as_deref() {
                    Some("session") => PoolMode::Session,
                    Some("transaction") => PoolMode::Transaction,
                    Some(other) => {
                        eprintln!("--pool-mode: expected session or transaction, got {other}");
                        return ExitCode::from(2);
                    }
                    None => config.pool_mode_for(&database, &user),
                };
                let client = ClientInfo {
                    id: 1,
                    user: user.as_str().into(),
                    database: database.as_str().into(),
                    application_name: application_name.as_str().into(),
                    startup: vec![
                        ("user".to_string(), user),
                        ("database".to_string(), database),
                        ("application_name".to_string(), application_name),
                    ]
                    .into(),
                    addr: match addr {
                        ClientAddrArg::Ip(ip) => std::net::SocketAddr::new(ip, 50000).into(),
                        ClientAddrArg::Unix => ClientAddr::Local(LocalPeer {
                            uid: 0,
                            gid: 0,
                            pid: None,
                            port: config.listen.port(),
                        }),
                    },
                    tls: None,
                    auth_method: config.auth.method.as_str(),
                    pool_mode,
                };
                let mut vars = Vars::new();
                match Event::from_name(&event) {
                    Some(Event::ClientConnection) => {
                        let mut ctx = ConnectionCtx {
                            client: &client,
                            vars: &mut vars,
                            reject: None,
                            params: vec![],
                            notices: vec![],
                            route: None,
                        };
                        dispatcher.client_connection(&mut ctx).await;
                        match &ctx.reject {
                            Some(r) => println!(
                                "decision: reject by {} ({}): {}{}{}",
                                r.hook,
                                r.sqlstate,
                                r.message,
                                r.detail
                                    .as_ref()
                                    .map(|d| format!("\n  detail: {d}"))
                                    .unwrap_or_default(),
                                r.hint
                                    .as_ref()
                                    .map(|h| format!("\n  hint: {h}"))
                                    .unwrap_or_default()
                            ),
                            None => println!("decision: allow"),
                        }
                        let mut rejected = ctx.reject.is_some();
                        if let (Some((route, hook)), false) = (&ctx.route, rejected) {
                            // As a login would see it: checked against routing.allow.
                            match route.resolve(config, &client.database, &client.user) {
                                Ok(r) => println!("route by {hook}: {} (user {})", r.shown, r.user),
                                Err(why) => {
                                    println!("route by {hook} not allowed (28000): {why}");
                                    rejected = true;
                                }
                            }
                        }
                        let (params, notices) = (ctx.params, ctx.notices);
                        print_outcome(&params, &[], &notices, &[], &vars);
                        if rejected {
                            return ExitCode::from(3);
                        }
                    }
                    Some(Event::SessionStart) => {
                        let mut ctx = SessionCtx {
                            client: &client,
                            vars: &mut vars,
                            reason: SessionReason::NewSession,
                            server: None,
                            params: vec![],
                            exec: vec![],
                            notices: vec![],
                            warnings: vec![],
                        };
                        dispatcher.session_start(&mut ctx).await;
                        let (params, exec, notices, warnings) =
                            (ctx.params, ctx.exec, ctx.notices, ctx.warnings);
                        print_outcome(&params, &exec, &notices, &warnings, &vars);
                    }
                    _ => {
                        eprintln!(
                            "event: expected client_connection or session_start, got {event}"
                        );
                        return ExitCode::from(2);
                    }
                }
                ExitCode::SUCCESS
            }
        }
    })
}

fn print_outcome(
    params: &[(String, String)],
    exec: &[String],
    notices: &[String],
    warnings: &[String],
    vars: &Vars,
) {
    for (k, v) in params {
        println!("set: {k} = {v}");
    }
    for sql in exec {
        println!("exec: {sql}");
    }
    for n in notices {
        println!("notice: {n}");
    }
    for w in warnings {
        println!("warning: {w}");
    }
    for (k, v) in vars {
        println!("var: {k} = {v:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_up_client_is_an_ip_or_unix() {
        assert!(matches!(made_up_addr("10.1.2.3"), Ok(ClientAddrArg::Ip(_))));
        assert!(matches!(made_up_addr("unix"), Ok(ClientAddrArg::Unix)));
        assert!(made_up_addr("localhost").is_err());
    }
}
