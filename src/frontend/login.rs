//! The startup phase of a client: startup packet (and SSL/GSSENC/cancel
//! requests), authentication, and the welcome (AuthenticationOk,
//! ParameterStatus, BackendKeyData, ReadyForQuery).

use super::close_with_error;
use super::params::SessionParams;
use super::session::Session;
use crate::app::App;
use crate::auth::{self, AuthAttempt, AuthOutcome};
use crate::hooks::{ClientInfo, ConnectionCtx, Event, Vars};
use crate::protocol::error::sqlstate;
use crate::protocol::messages;
use crate::protocol::startup::{read_startup, StartupPacket};
use crate::protocol::PgError;
use bytes::BytesMut;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// What the login has learnt so far, for the attempt record if it times out.
#[derive(Debug, Default)]
struct Progress {
    user: Option<String>,
    database: Option<String>,
}

/// What a successful login leads to.
enum LoggedIn {
    Session(Box<Session>),
    Admin(crate::admin::Console),
}

/// Runs one client connection from accept to close.
pub async fn handle_client(app: Arc<App>, mut stream: TcpStream, addr: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let (_connected, count) = app.clients.connect();
    let mut progress = Progress::default();
    let timeout = Duration::from_secs_f64(app.config.auth_timeout);
    let result = tokio::time::timeout(
        timeout,
        login(&app, &mut stream, addr, count, &mut progress),
    )
    .await;
    match result {
        Ok(Ok(Some(LoggedIn::Session(session)))) => session.serve(stream).await,
        Ok(Ok(Some(LoggedIn::Admin(console)))) => console.serve(stream).await,
        Ok(Ok(None)) => {}
        Ok(Err(e)) => close_with_error(&mut stream, &e).await,
        Err(_) => {
            let user = progress.user.unwrap_or_default();
            let attempt = AuthAttempt {
                user_exists: app.user_exists(&user),
                user,
                database: progress.database.unwrap_or_default(),
                client_addr: addr,
                method: app.config.auth.method.to_string(),
                outcome: AuthOutcome::Timeout,
            };
            report(&app, &attempt).await;
            let e = PgError::fatal(
                sqlstate::PROTOCOL_VIOLATION,
                "canceling authentication due to timeout",
            )
            .with_detail(format!("auth_timeout is {}s", app.config.auth_timeout));
            close_with_error(&mut stream, &e).await;
        }
    }
}

/// The startup phase. `Ok(None)`: nothing more to do (cancel request, or the
/// client left); `Err`: send this error and close.
async fn login(
    app: &Arc<App>,
    stream: &mut TcpStream,
    addr: SocketAddr,
    count: usize,
    progress: &mut Progress,
) -> Result<Option<LoggedIn>, PgError> {
    let params = loop {
        match read_startup(stream).await? {
            None => return Ok(None),
            Some(StartupPacket::SslRequest) | Some(StartupPacket::GssEncRequest) => {
                // TLS is not offered (yet): 'N' tells the client to go on in plaintext.
                stream
                    .write_all(b"N")
                    .await
                    .map_err(|_| PgError::protocol("client went away"))?;
            }
            Some(StartupPacket::Cancel { pid, secret }) => {
                if let Some(target) = app.clients.cancel_target(pid, secret) {
                    if let Err(e) = target.send().await {
                        tracing::warn!(error = %e, "could not forward cancel request");
                    }
                }
                return Ok(None);
            }
            Some(StartupPacket::Startup(params)) => break params,
        }
    };
    let user = StartupPacket::param(&params, "user")
        .unwrap_or_default()
        .to_string();
    let database = StartupPacket::param(&params, "database")
        .filter(|d| !d.is_empty())
        .unwrap_or(&user)
        .to_string();
    progress.user = Some(user.clone());
    progress.database = Some(database.clone());

    let config = &app.config;
    let attempt = |outcome| AuthAttempt {
        user: user.clone(),
        user_exists: app.user_exists(&user),
        database: database.clone(),
        client_addr: addr,
        method: config.auth.method.to_string(),
        outcome,
    };
    if count > config.max_client_conn {
        report(app, &attempt(AuthOutcome::Refused)).await;
        return Err(PgError::fatal(
            sqlstate::TOO_MANY_CONNECTIONS,
            format!(
                "sorry, too many clients already (max_client_conn is {})",
                config.max_client_conn
            ),
        ));
    }
    if StartupPacket::param(&params, "replication")
        .is_some_and(|r| r != "false" && r != "0" && r != "off")
    {
        report(app, &attempt(AuthOutcome::Refused)).await;
        return Err(PgError::fatal(
            sqlstate::FEATURE_NOT_SUPPORTED,
            "usher does not support replication connections",
        ));
    }

    let secret = app.secrets.get(&user);
    let known = app.user_exists(&user);
    let authenticated = match auth::authenticate(
        stream,
        config.auth.method,
        &user,
        known,
        secret,
        &app.mock_key,
    )
    .await
    {
        Ok(a) => a,
        Err(failure) => {
            report(app, &attempt(failure.outcome)).await;
            return Err(failure.error);
        }
    };
    let _ = authenticated;
    report(app, &attempt(AuthOutcome::Success)).await;

    if crate::admin::is_admin_database(&database) {
        return crate::admin::Console::login(app.clone(), stream, &user)
            .await
            .map(|c| Some(LoggedIn::Admin(c)));
    }
    let pool = app
        .pools
        .get_or_create(config, &database, &user, app.secrets.get(&user))
        .ok_or_else(|| {
            PgError::fatal(
                sqlstate::INVALID_CATALOG_NAME,
                format!("database \"{database}\" does not exist"),
            )
        })?;
    let mut session_params = SessionParams::from_startup(&params)?;
    let registration = app.clients.register();
    let client = ClientInfo {
        id: registration.handle.pid,
        application_name: StartupPacket::param(&params, "application_name")
            .unwrap_or_default()
            .to_string(),
        user,
        database,
        startup: params,
        addr,
        tls: None,
        auth_method: config.auth.method.to_string(),
        pool_mode: pool.mode(),
    };

    // client_connection hooks: before the client is told it is in, and
    // before any server connection is used for it.
    let mut vars = Vars::new();
    let mut notices = Vec::new();
    if app.hooks.handles(Event::ClientConnection) {
        let mut ctx = ConnectionCtx {
            client: &client,
            vars: &mut vars,
            reject: None,
            params: Vec::new(),
            notices: Vec::new(),
        };
        app.hooks.client_connection(&mut ctx).await;
        if let Some(r) = ctx.reject {
            tracing::info!(user = %client.user, database = %client.database, addr = %addr, hook = %r.hook, sqlstate = %r.sqlstate, "client rejected by hook");
            let mut e = PgError::fatal(&r.sqlstate, r.message);
            e.detail = r.detail;
            e.hint = r.hint;
            return Err(e);
        }
        session_params.add_startup(ctx.params);
        notices = ctx.notices;
    }

    let server_params = pool.server_params().await?;
    let mut out = BytesMut::with_capacity(512);
    messages::authentication_ok(&mut out);
    for (name, value) in session_params.initial_report(&server_params) {
        messages::parameter_status(&mut out, &name, &value);
    }
    messages::backend_key_data(
        &mut out,
        registration.handle.pid,
        registration.handle.secret,
    );
    for n in notices {
        PgError::notice(n).encode(&mut out);
    }
    messages::ready_for_query(&mut out, b'I');
    stream
        .write_all(&out)
        .await
        .map_err(|_| PgError::protocol("client went away"))?;
    Ok(Some(LoggedIn::Session(Box::new(Session::new(
        app.clone(),
        pool,
        session_params,
        server_params,
        registration,
        client,
        vars,
    )))))
}

/// Logs an authentication attempt and hands it to the auth_attempt hooks.
async fn report(app: &App, attempt: &AuthAttempt) {
    attempt.log();
    app.hooks.auth_attempt(attempt).await;
}
