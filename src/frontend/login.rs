//! The startup phase of a client: startup packet (and SSL/GSSENC/cancel
//! requests, with the TLS handshake), the TLS requirement, HBA rules, the
//! credential lookup, authentication, and the welcome (AuthenticationOk,
//! ParameterStatus, BackendKeyData, ReadyForQuery).
//!
//! The whole phase runs under `auth_timeout` and holds one of the
//! `max_auth_clients` login slots (at most `max_auth_clients_per_address`
//! of them per address, see [`super::slots`]). Every outcome is recorded as an
//! [`AuthAttempt`].

use super::client_registry::{ClientFacts, Connected, Registration};
use super::client_stream::ClientStream;
use super::close_with_error;
use super::deps::{ConfigSnapshot, SessionDeps};
use super::login_slots::NoSlot;
use super::params::SessionParams;
use super::session::{left_while_waiting, Session};
use crate::auth::hba::{Connection, Decision};
use crate::auth::{self, AuthAttempt, AuthOutcome, Authenticated, Challenge, Secret};
use crate::backend::ServerCredential;
use crate::client_addr::{ClientAddr, ClientHost};
use crate::config::{AuthMethod, PoolMode, TlsMode};
use crate::hooks::{ClientInfo, ConnectionCtx, Event, Vars};
use crate::metrics::ClientConnected;
use crate::pool::{Pool, Pools};
use crate::protocol::error::{shown_name, sqlstate};
use crate::protocol::messages;
use crate::protocol::scram_client::ScramKeys;
use crate::protocol::startup::{
    old_format_error, read_startup, unsupported_version, StartupPacket, GSSENC_REQUEST, SSL_REQUEST,
};
use crate::protocol::tags::status;
use crate::protocol::PgError;
use bytes::BytesMut;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// What the login has learnt so far: what the attempt record says, however
/// the login ends.
#[derive(Debug)]
struct Progress {
    addr: ClientAddr,
    user: Option<String>,
    database: Option<String>,
    user_exists: bool,
    method: Option<AuthMethod>,
    /// The outcome has been recorded (each login records one).
    recorded: bool,
}

impl Progress {
    fn new(addr: ClientAddr) -> Self {
        Progress {
            addr,
            user: None,
            database: None,
            user_exists: false,
            method: None,
            recorded: false,
        }
    }

    /// Records the outcome of this login, once.
    async fn record(&mut self, deps: &SessionDeps, outcome: AuthOutcome) {
        if std::mem::replace(&mut self.recorded, true) {
            return;
        }
        deps.record(AuthAttempt {
            user: self.user.clone().unwrap_or_default(),
            user_exists: self.user_exists,
            database: self.database.clone().unwrap_or_default(),
            client_addr: self.addr,
            method: self.method.unwrap_or(deps.config().auth.method).to_string(),
            outcome,
        })
        .await;
    }
}

/// Records a refusal and returns its error.
async fn refuse<T>(
    deps: &SessionDeps,
    progress: &mut Progress,
    outcome: AuthOutcome,
    error: PgError,
) -> Result<T, PgError> {
    progress.record(deps, outcome).await;
    Err(error)
}

/// What a successful login leads to.
pub enum LoggedIn {
    /// A client of a database, to be served by its session.
    Session(Box<Session>),
    /// A client of the admin console (the `usher`/`pgbouncer` database),
    /// authenticated and registered; the console takes it from here.
    Console(Registration),
}

/// A client that logged in: its connection, its place in the count of
/// connected clients (held until it leaves), and what serves it.
pub struct Admitted {
    pub stream: ClientStream,
    pub counted: (Connected, ClientConnected),
    pub logged_in: LoggedIn,
}

/// Runs the startup phase of one client connection, from accept to
/// ReadyForQuery (or to the console's welcome). `None`: the client was
/// refused, timed out or left, and has been told why.
pub async fn admit(
    deps: &Arc<SessionDeps>,
    mut stream: ClientStream,
    addr: ClientAddr,
) -> Option<Admitted> {
    let (connected, count) = deps.clients.connect();
    let gauge = ClientConnected::new();
    // One snapshot of the configuration for the whole login.
    let snapshot = deps.snapshot();
    if snapshot.config.log.connections {
        tracing::info!(addr = %addr, "connection accepted");
    }
    let mut progress = Progress::new(addr);
    // Clients that have not finished logging in are bounded: each costs a
    // task, buffers and maybe a TLS handshake, and silent ones hold theirs
    // until auth_timeout. One address gets a share, so that it cannot hold
    // every slot.
    let config = &snapshot.config;
    let slot = match deps
        .login_slots
        .try_acquire(&addr, config.max_auth_clients_per_address)
    {
        Ok(slot) => slot,
        Err(no) => {
            progress.record(deps, AuthOutcome::Refused).await;
            let message = match no {
                NoSlot::All => format!(
                    "sorry, too many clients are logging in already (max_auth_clients is {})",
                    config.max_auth_clients
                ),
                NoSlot::Address(key) => format!(
                    "sorry, too many clients from {key} are logging in already (max_auth_clients_per_address is {})",
                    config.max_auth_clients_per_address
                ),
            };
            let e = PgError::fatal(sqlstate::TOO_MANY_CONNECTIONS, message);
            close_with_error(&mut stream, &e).await;
            return None;
        }
    };
    let timeout = Duration::from_secs_f64(snapshot.config.auth_timeout);
    let result = tokio::time::timeout(
        timeout,
        login(deps, &snapshot, &mut stream, count, &mut progress),
    )
    .await;
    drop(slot);
    let counted = (connected, gauge);
    match result {
        Ok(Ok(Some(Step::Done(logged_in)))) => {
            return Some(Admitted {
                stream,
                counted,
                logged_in,
            });
        }
        Ok(Ok(Some(Step::Welcome(w)))) => match welcome(deps, &mut stream, *w).await {
            Ok(session) => {
                return Some(Admitted {
                    stream,
                    counted,
                    logged_in: LoggedIn::Session(session),
                })
            }
            Err(e) => close_with_error(&mut stream, &e).await,
        },
        Ok(Ok(None)) => {}
        Ok(Err(e)) => {
            // Refusals were recorded with their own outcome; what is left
            // is bad input (or a failure after a recorded success).
            progress.record(deps, AuthOutcome::ProtocolError).await;
            close_with_error(&mut stream, &e).await
        }
        Err(_) => {
            progress.record(deps, AuthOutcome::Timeout).await;
            let e = PgError::fatal(
                sqlstate::PROTOCOL_VIOLATION,
                "canceling authentication due to timeout",
            )
            .with_detail(format!("auth_timeout is {}s", snapshot.config.auth_timeout));
            close_with_error(&mut stream, &e).await;
        }
    }
    None
}

/// The startup phase. `Ok(None)`: nothing more to do (cancel request, or the
/// client left); `Err`: send this error and close.
async fn login<'a>(
    deps: &'a Arc<SessionDeps>,
    snapshot: &ConfigSnapshot,
    stream: &mut ClientStream,
    count: usize,
    progress: &mut Progress,
) -> Result<Option<Step<'a>>, PgError> {
    let Some(params) = startup(snapshot, deps, stream, progress.addr).await? else {
        return Ok(None);
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
    progress.user_exists = snapshot.credentials.is_listed(&user);

    let config = &snapshot.config;
    let addr = progress.addr;
    if count > config.max_client_conn {
        return refuse(
            deps,
            progress,
            AuthOutcome::Refused,
            PgError::fatal(
                sqlstate::TOO_MANY_CONNECTIONS,
                format!(
                    "sorry, too many clients already (max_client_conn is {})",
                    config.max_client_conn
                ),
            ),
        )
        .await;
    }
    if StartupPacket::param(&params, "replication")
        .is_some_and(|r| r != "false" && r != "0" && r != "off")
    {
        return refuse(
            deps,
            progress,
            AuthOutcome::Refused,
            PgError::fatal(
                sqlstate::FEATURE_NOT_SUPPORTED,
                "usher does not support replication connections",
            ),
        )
        .await;
    }
    // The lockout is decided before anything about the password: a locked
    // user's right password is refused too, and the lookup is not even run.
    if let Some(e) = deps.lockout_check(&user, addr.host()) {
        return refuse(deps, progress, AuthOutcome::Locked, e).await;
    }
    let lookup = match snapshot.credentials.lookup(&database, &user).await {
        Ok(l) => l,
        Err(e) => {
            // The detail (which server, why) is for the operator, not the client.
            tracing::warn!(user = %user, database = %database, error = %e, detail = e.detail.as_deref().unwrap_or(""), "credential lookup failed");
            return refuse(
                deps,
                progress,
                AuthOutcome::Refused,
                PgError::fatal(
                    sqlstate::CONNECTION_FAILURE,
                    "authentication is unavailable: usher could not look up the user",
                ),
            )
            .await;
        }
    };
    progress.user_exists = lookup.exists;

    let (method, map) =
        match choose_method(snapshot, stream.is_tls(), addr.host(), &user, &database).await {
            Ok(chosen) => chosen,
            Err((outcome, error)) => return refuse(deps, progress, outcome, error).await,
        };
    progress.method = Some(method);
    // peer: the operating-system user of the socket's peer.
    let local = addr.local_peer().filter(|_| method == AuthMethod::Peer);
    let system_user = match local {
        Some(p) => auth::peer::system_user(p.uid).await,
        None => None,
    };
    let peer = local.map(|p| auth::peer::PeerIdentity {
        uid: p.uid,
        system_user: system_user.as_deref(),
        map: map.as_deref().map(|m| (m, &snapshot.ident)),
    });

    // Cloned: authentication borrows the stream while it reads the certificate.
    let certificate = stream.peer_certificate().cloned();
    let challenge = Challenge {
        method,
        user: &user,
        known: lookup.exists,
        secret: lookup.secret.as_ref(),
        certificate: certificate.as_ref(),
        peer,
        mock_key: &deps.mock_key,
    };
    // The lockout again when the password or proof arrives: logins that
    // started together must not all get their guess checked.
    let recheck = || deps.lockout_check(&user, addr.host());
    let authenticated = match auth::authenticate(stream, &challenge, recheck).await {
        Ok(a) => a,
        Err(failure) => {
            progress.record(deps, failure.outcome).await;
            return Err(failure.error);
        }
    };
    progress.record(deps, AuthOutcome::Success).await;

    let tls = stream.tls_info();
    // One copy of each, shared by the registry entry and the hook context.
    let user: Arc<str> = user.into();
    let database: Arc<str> = database.into();
    let application_name: Arc<str> = StartupPacket::param(&params, "application_name")
        .unwrap_or_default()
        .into();
    let facts = ClientFacts {
        user: user.clone(),
        database: database.clone(),
        addr,
        local: stream.local_addr(),
        application_name: application_name.clone(),
        tls: tls
            .as_ref()
            .map(|t| format!("{}/{}", t.version, t.cipher))
            .unwrap_or_default()
            .into(),
    };
    if crate::config::is_admin_database(&database) {
        return Ok(Some(Step::Done(LoggedIn::Console(
            deps.clients.register(facts),
        ))));
    }
    let unknown_database = |name: &str| {
        PgError::fatal(
            sqlstate::INVALID_CATALOG_NAME,
            format!("database \"{}\" does not exist", shown_name(name)),
        )
    };
    // A listed database's entry, else the fallback entry's ("*"): then
    // the server says whether it has the database. Its pool is taken after
    // the client_connection hooks, which may route the client elsewhere.
    let server_tls = snapshot
        .server_tls_for(&database)
        .ok_or_else(|| unknown_database(&database))?;
    let pool_mode = config.pool_mode_for(&database, &user);
    let mut session_params = SessionParams::from_startup(&params)?;
    let mut registration = deps.clients.register(facts);
    let mut client = ClientInfo {
        id: registration.handle.pid(),
        application_name,
        user,
        database,
        startup: params.into(),
        addr,
        tls: tls.map(Box::new),
        auth_method: method.as_str(),
        pool_mode,
    };

    // client_connection hooks: before the client is told it is in, and
    // before any server connection is used for it.
    let mut vars = Vars::new();
    let mut notices = Vec::new();
    let mut route = None;
    if deps.hooks.handles(Event::ClientConnection) {
        let mut ctx = ConnectionCtx {
            client: &client,
            vars: &mut vars,
            reject: None,
            params: Vec::new(),
            notices: Vec::new(),
            route: None,
        };
        deps.hooks.client_connection(&mut ctx).await;
        route = ctx.route.take();
        if let Some(r) = ctx.reject {
            tracing::info!(user = %client.user, database = %client.database, addr = %addr, hook = %r.hook, sqlstate = %r.sqlstate, "client rejected by hook");
            deps.client_rejected(&client.user, progress.user_exists, addr.host());
            let mut e = PgError::fatal(&r.sqlstate, r.message);
            e.detail = r.detail;
            e.hint = r.hint;
            return Err(e);
        }
        session_params.add_startup(ctx.params);
        notices = ctx.notices;
    }
    // The pool: the routed one, else the database asked for (whose pool a
    // routed login never creates, nor holds). Given back if the login
    // fails from here on (a database the server does not have leaves no
    // auto database's pool behind).
    let pool = match route {
        Some((route, hook)) => {
            let to = RouteTo {
                route,
                hook: &hook,
                client_secret: lookup.secret.as_ref(),
                authenticated: &authenticated,
            };
            match routed_pool(deps, snapshot, &client, to).await {
                Ok(p) => p,
                Err(e) => {
                    deps.client_rejected(&client.user, progress.user_exists, addr.host());
                    return Err(e);
                }
            }
        }
        None => {
            let credential = server_credential(lookup.secret.as_ref(), &authenticated);
            let pool = deps
                .pools
                .get_or_create(
                    config,
                    &client.database,
                    &client.user,
                    server_tls,
                    credential,
                )
                .ok_or_else(|| unknown_database(&client.database))?;
            PoolClaim {
                pools: &deps.pools,
                pool: Some(pool),
            }
        }
    };
    // The client counts under its pool's database's (a route's base
    // entry's) and user's client caps.
    let limits = pool.settings();
    let (db_limit, user_limit) = (
        limits.max_db_client_connections,
        limits.max_user_client_connections,
    );
    let place = pool.caps.client(db_limit, user_limit).map_err(|which| {
        client_capped(which, &pool.database, &client.user, db_limit, user_limit)
    })?;
    registration.keep_place(place);
    client.pool_mode = pool.mode();
    if let Some(route) = &pool.route {
        registration.routed(route.shown.clone());
    }

    Ok(Some(Step::Welcome(Box::new(Welcome {
        pool,
        params: session_params,
        registration,
        client,
        vars,
        notices,
    }))))
}

/// What a client_connection hook's `ctx:route{...}` asked, and what the
/// login knows of the client's secret.
struct RouteTo<'r> {
    route: crate::config::Route,
    hook: &'r str,
    client_secret: Option<&'r Secret>,
    authenticated: &'r Authenticated,
}

/// The pool a hook routed the client to: the route checked against
/// `routing.allow` (28000 "route not allowed", logged with the hook and
/// the target, and counted), its server role's credential from usher's
/// credential sources (the client's own when the role is the client's, or
/// when the client's secret is the role's: SCRAM pass-through), and the
/// pool bounded by `routing.max_pools` (53300).
async fn routed_pool<'a>(
    deps: &'a Arc<SessionDeps>,
    snapshot: &ConfigSnapshot,
    client: &ClientInfo,
    to: RouteTo<'_>,
) -> Result<PoolClaim<'a>, PgError> {
    let config = &snapshot.config;
    let hook = to.hook;
    let not_allowed = |target: &dyn std::fmt::Debug, why: &dyn std::fmt::Display| {
        tracing::warn!(hook = %hook, user = %client.user, database = %client.database, target = ?target, reason = %why, "route not allowed");
        crate::metrics::route_refused(hook);
        let mut e = PgError::fatal(sqlstate::INVALID_AUTHORIZATION, "route not allowed");
        e.hint = Some("see usher's log (routing.allow)".into());
        e
    };
    let entry = to
        .route
        .check(config, &client.database)
        .map_err(|why| not_allowed(&to.route, &why))?;
    let resolved = to
        .route
        .into_resolved(entry, &client.database, &client.user);
    let tls = snapshot
        .server_tls_for(&resolved.base)
        .ok_or_else(|| not_allowed(&resolved, &"the base entry has no TLS settings"))?;
    let credential = if resolved.user == *client.user {
        server_credential(to.client_secret, to.authenticated)
    } else {
        let role = snapshot
            .credentials
            .lookup(&resolved.base, &resolved.user)
            .await?;
        match role.secret {
            Some(Secret::Plain { password, .. }) => ServerCredential::Password(password),
            Some(Secret::Md5(hash)) => ServerCredential::Md5(hash),
            Some(Secret::Scram(role)) => match to.client_secret {
                Some(Secret::Scram(mine)) if mine.ct_eq(&role) => {
                    server_credential(to.client_secret, to.authenticated)
                }
                Some(Secret::Plain { verifier, .. }) if verifier.ct_eq(&role) => {
                    server_credential(to.client_secret, to.authenticated)
                }
                _ => ServerCredential::None,
            },
            None => ServerCredential::None,
        }
    };
    let max_pools = config.routing.as_ref().map_or(0, |r| r.max_pools);
    let pool = deps
        .pools
        .get_or_create_routed(config, &resolved, &client.user, tls, credential, max_pools)
        .map_err(|crate::pool::TooManyRoutes(n)| {
            tracing::warn!(hook = %to.hook, user = %client.user, route = %resolved.key, max_pools = n, "routed pool refused: routing.max_pools");
            PgError::fatal(
                sqlstate::TOO_MANY_CONNECTIONS,
                format!("sorry, too many routed pools already (routing.max_pools is {n})"),
            )
        })?;
    Ok(PoolClaim {
        pools: &deps.pools,
        pool: Some(pool),
    })
}

/// A client that authenticated and passed the client_connection hooks,
/// still to be told it is in: AuthenticationOk, the parameters as the
/// server has them, BackendKeyData, ReadyForQuery.
/// What a client past `max_db_client_connections` or
/// `max_user_client_connections` is told (53300, as for max_client_conn).
fn client_capped(
    which: crate::pool::caps::Capped,
    database: &str,
    user: &str,
    db_limit: usize,
    user_limit: usize,
) -> PgError {
    use crate::pool::caps::Capped;
    use crate::protocol::error::shown_name;
    let message = match which {
        Capped::Database => format!(
            "sorry, too many clients already for database \"{}\" (max_db_client_connections is {db_limit})",
            shown_name(database)
        ),
        Capped::User => format!(
            "sorry, too many clients already for user \"{}\" (max_user_client_connections is {user_limit})",
            shown_name(user)
        ),
    };
    PgError::fatal(sqlstate::TOO_MANY_CONNECTIONS, message)
}

struct Welcome<'a> {
    pool: PoolClaim<'a>,
    params: SessionParams,
    registration: Registration,
    client: ClientInfo,
    vars: Vars,
    /// What client_connection hooks had to say.
    notices: Vec<String>,
}

/// Where a successful login goes next.
enum Step<'a> {
    Done(LoggedIn),
    Welcome(Box<Welcome<'a>>),
}

/// Tells a client it is in, as PostgreSQL would: AuthenticationOk, then
/// what applying its startup parameters raised (NOTICEs, or the FATAL
/// error of a bad one), the parameters as the server reports them after
/// applying them (`UTF8` for `utf-8`, `ISO, MDY` for `iso`, a name cut to
/// 63 bytes), BackendKeyData and ReadyForQuery.
///
/// Session mode takes the client's server connection here (the client is
/// told its backend's pid, and its session starts on it). Transaction mode
/// takes one only when the pool has not yet learnt what the server makes
/// of every startup parameter and one is free at once, and gives it back.
///
/// Runs after the login slot is given back and outside auth_timeout: a
/// client waiting for a server connection is bounded by
/// query_wait_timeout, and holds no login slot meanwhile.
async fn welcome(
    deps: &Arc<SessionDeps>,
    stream: &mut ClientStream,
    welcome: Welcome<'_>,
) -> Result<Box<Session>, PgError> {
    let Welcome {
        pool,
        mut params,
        registration,
        client,
        vars,
        notices,
    } = welcome;
    // A new pool learns the server's parameters from a server connection,
    // which during an outage it waits for (up to query_wait_timeout): a
    // client that leaves meanwhile is not waited for, nor kept.
    let defaults = tokio::select! {
        biased;
        defaults = pool.server_params() => defaults?,
        () = stream.closed() => return Err(left_while_waiting()),
    };
    let gone = |_| PgError::protocol("client went away");
    let mut out = BytesMut::with_capacity(1024);
    messages::authentication_ok(&mut out);
    let session_mode = pool.mode() == PoolMode::Session;
    let mut spellings = Vec::new();
    let known = !session_mode
        && params.wanted().all(|(name, value)| {
            if defaults.get(name) == Some(value) {
                return true;
            }
            pool.normalised(name, value)
                .map(|spelling| spellings.push((name.clone(), spelling)))
                .is_some()
        });
    let checkout = if known {
        for (name, spelling) in spellings {
            params.take_spelling(&name, spelling);
        }
        None
    } else {
        // A login waits for no server connection (the pool may be paused,
        // or busy; in session mode an application may open more
        // connections than pool_size before it uses any): without a free
        // one, the client is told its values as it gave them and the
        // server's spelling when its first transaction applies them (as a
        // ParameterStatus), and in session mode usher's own pid.
        pool.checkout_if_free().await.transpose()?
    };
    let mut held = None;
    if let Some(mut checkout) = checkout {
        let asked: Vec<(String, String)> = params
            .wanted()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let before = out.len();
        if let Err(e) = params
            .bring_in_line(&mut checkout.conn, "", Some(&mut out))
            .await
        {
            let e = match e {
                // The server is ready again and its parameters are
                // known: the connection is fine, the client's
                // parameter is not; it ends the login as it would
                // directly.
                crate::backend::QueryError::Server(e) => {
                    pool.checkin(checkout);
                    PgError {
                        severity: crate::protocol::Severity::Fatal,
                        code: e.code,
                        message: e.message,
                        detail: e.detail,
                        hint: e.hint,
                    }
                }
                e => {
                    pool.discard(checkout);
                    PgError::fatal(e.sqlstate(), e.to_string())
                }
            };
            stream.write_all(&out).await.map_err(gone)?;
            return Err(e);
        }
        if out.len() == before {
            // Nothing to say about these values: later logins may skip
            // the server.
            let learnt = asked.into_iter().filter_map(|(name, raw)| {
                let now = params.wanted().find(|(n, _)| **n == name)?.1.clone();
                Some(((name, raw), now))
            });
            pool.learn_normalised(learnt.collect::<Vec<_>>());
        }
        if session_mode {
            registration.tell_pid(checkout.conn.backend_pid());
            held = Some(checkout);
        } else {
            pool.checkin(checkout);
        }
    }
    for (name, value) in params.initial_report(&defaults) {
        messages::parameter_status(&mut out, name, value);
    }
    let (pid, secret) = (registration.handle.pid(), registration.handle.secret);
    let mut session = Box::new(Session::new(
        deps.clone(),
        pool.keep(),
        params,
        defaults,
        registration,
        client,
        vars,
    ));
    if let Some(checkout) = held {
        // What the session start says on the server comes after the
        // parameters; otherwise the whole welcome is one write.
        stream.write_all(&out).await.map_err(gone)?;
        out.clear();
        session.hold_login_server(checkout);
        session.start_on_login_server(stream).await?;
    }
    messages::backend_key_data(&mut out, pid, secret);
    for n in notices {
        PgError::notice(n).encode(&mut out);
    }
    messages::ready_for_query(&mut out, status::IDLE);
    stream.write_all(&out).await.map_err(gone)?;
    Ok(session)
}

/// The pool a login found or created, until the session takes it
/// ([`PoolClaim::keep`]); a login that fails before that gives it back
/// ([`Pools::give_back`]), however it ends (an error, the client leaving,
/// `auth_timeout`).
struct PoolClaim<'a> {
    pools: &'a Pools,
    /// The login's only handle on the pool (`None` once kept).
    pool: Option<Arc<Pool>>,
}

impl PoolClaim<'_> {
    fn keep(mut self) -> Arc<Pool> {
        self.pool.take().expect("a claim is kept once")
    }
}

impl std::ops::Deref for PoolClaim<'_> {
    type Target = Arc<Pool>;
    fn deref(&self) -> &Arc<Pool> {
        self.pool.as_ref().expect("a claim is kept once")
    }
}

impl Drop for PoolClaim<'_> {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            self.pools.give_back(pool);
        }
    }
}

/// Picks the method for this connection (and a peer rule's user name map),
/// or refuses it: TLS when `tls.mode` is require (TCP clients only), then
/// the HBA rules (or `auth.method` without them).
async fn choose_method(
    snapshot: &ConfigSnapshot,
    tls: bool,
    host: ClientHost,
    user: &str,
    database: &str,
) -> Result<(AuthMethod, Option<String>), (AuthOutcome, PgError)> {
    // As the messages quote them.
    let (u, d) = (shown_name(user), shown_name(database));
    // The Unix-domain socket never crosses a network (and has no TLS):
    // `require` is about TCP clients.
    if !tls
        && host != ClientHost::Local
        && snapshot.client_tls.as_ref().map(|t| t.mode) == Some(TlsMode::Require)
    {
        let e = PgError::fatal(
            sqlstate::INVALID_AUTHORIZATION,
            format!(
                "TLS is required: usher refuses unencrypted connections (host \"{host}\", user \"{u}\", database \"{d}\")"
            ),
        )
        .with_hint("connect with sslmode=require (or verify-full)");
        return Err((AuthOutcome::TlsRequired, e));
    }
    let Some(hba) = &snapshot.hba else {
        return Ok((snapshot.config.auth.method, None));
    };
    let conn = Connection {
        host,
        tls,
        database,
        user,
    };
    let credentials = &snapshot.credentials;
    let decision = hba
        .decide(&conn, |role| async move {
            credentials.is_member(database, user, &role).await
        })
        .await;
    // PostgreSQL's wording, with "HBA" for "pg_hba.conf".
    let encryption = if tls {
        "SSL encryption"
    } else {
        "no encryption"
    };
    let described = format!("host \"{host}\", user \"{u}\", database \"{d}\", {encryption}");
    let refused = |message: String| {
        Err((
            AuthOutcome::HbaReject,
            PgError::fatal(sqlstate::INVALID_AUTHORIZATION, message),
        ))
    };
    match decision {
        Decision::Method { method, rule, map } => {
            tracing::debug!(user, database, rule = %rule, method = %method, "HBA rule matched");
            Ok((method, map))
        }
        Decision::Reject { rule } => {
            tracing::debug!(user, database, rule = %rule, "HBA rule rejects");
            refused(format!("HBA rejects connection for {described}"))
        }
        Decision::NoMatch => refused(format!("no HBA entry for {described}")),
    }
}

/// Reads startup-phase packets until the startup message, as PostgreSQL's
/// ProcessStartupPacket does: an SSLRequest (answered `S` with the TLS
/// handshake when TLS is on, `N` otherwise) and a GSSENCRequest (`N`) once
/// each, a second one refused as an unknown protocol version (and a
/// GSSENCRequest once TLS is on); a cancel request is forwarded. A client
/// that asked for protocol 3.x (x > 0) or `_pq_.` options is told
/// NegotiateProtocolVersion (3.0, the options unknown) and served as 3.0.
/// `None`: nothing more to do. Bytes that are not a startup packet are a
/// server-only error: logged, and the connection closed without a word.
async fn startup(
    snapshot: &ConfigSnapshot,
    deps: &SessionDeps,
    stream: &mut ClientStream,
    addr: ClientAddr,
) -> Result<Option<Vec<(String, String)>>, PgError> {
    let gone = |_| PgError::protocol("client went away");
    let invalid = |e: PgError| {
        tracing::info!(addr = %addr, error = %e.message, "invalid startup packet");
        e
    };
    let (mut ssl_done, mut gss_done) = (false, false);
    loop {
        let packet = read_startup(stream).await.map_err(invalid)?;
        match packet {
            None => return Ok(None),
            Some(StartupPacket::SslRequest) if !ssl_done => {
                ssl_done = true;
                // No TLS on the Unix-domain socket, as in PostgreSQL.
                match snapshot.client_tls.as_ref().filter(|_| !stream.is_unix()) {
                    Some(tls) => {
                        stream.write_all(b"S").await.map_err(gone)?;
                        refuse_read_ahead(stream, "SSL request")?;
                        if let Err(e) = stream.start_tls(&tls.acceptor).await {
                            // Recorded as a protocol error; the client cannot
                            // read an ErrorResponse without TLS.
                            tracing::info!(error = %e, "TLS handshake with a client failed");
                            return Err(PgError::protocol(format!("TLS handshake failed: {e}")));
                        }
                        // No GSS encryption inside TLS.
                        gss_done = true;
                    }
                    // 'N' tells the client to go on in plaintext (or give up).
                    None => {
                        stream.write_all(b"N").await.map_err(gone)?;
                        refuse_read_ahead(stream, "SSL request")?;
                    }
                }
            }
            Some(StartupPacket::GssEncRequest) if !gss_done => {
                gss_done = true;
                stream.write_all(b"N").await.map_err(gone)?;
                refuse_read_ahead(stream, "GSSAPI encryption request")?;
            }
            Some(StartupPacket::SslRequest) => return Err(unsupported_version(SSL_REQUEST)),
            Some(StartupPacket::GssEncRequest) => return Err(unsupported_version(GSSENC_REQUEST)),
            Some(StartupPacket::Cancel { pid, secret }) => {
                // Allowed in plaintext even when TLS is required: libpq
                // before PostgreSQL 17 always sends cancels unencrypted.
                // Another instance's key is forwarded to it (peers.rs).
                super::peers::cancel(&deps.peers, &deps.clients, pid, secret).await;
                return Ok(None);
            }
            Some(StartupPacket::Other(code)) => {
                let e = unsupported_version(code);
                // Protocol 1.x and 2.x clients get the error in their format.
                return match old_format_error(code) {
                    Some(old) => {
                        let _ = stream.write_all(&old).await;
                        Err(invalid(PgError::server_only(&e.code, e.message)))
                    }
                    None => Err(e),
                };
            }
            Some(StartupPacket::Startup(message)) => {
                if message.needs_negotiation() {
                    let mut out = BytesMut::new();
                    messages::negotiate_protocol_version(&mut out, &message.protocol_options);
                    stream.write_all(&out).await.map_err(gone)?;
                }
                if StartupPacket::param(&message.params, "user").is_none_or(str::is_empty) {
                    return Err(PgError::fatal(
                        sqlstate::INVALID_AUTHORIZATION,
                        "no PostgreSQL user name specified in startup packet",
                    ));
                }
                return Ok(Some(message.params));
            }
        }
    }
}

/// Bytes that came with an SSLRequest or GSSENCRequest, before its answer,
/// were not sent over the encryption the client asked for and may have
/// been injected on the way: refused as PostgreSQL refuses them
/// (CVE-2021-23214), whatever the answer was.
fn refuse_read_ahead(stream: &ClientStream, request: &str) -> Result<(), PgError> {
    if !stream.has_read_ahead() {
        return Ok(());
    }
    let mut e = PgError::fatal(
        sqlstate::PROTOCOL_VIOLATION,
        format!("received unencrypted data after {request}"),
    );
    e.detail = Some(
        "This could be either a client-software bug or evidence of an attempted man-in-the-middle attack."
            .into(),
    );
    Err(e)
}

/// What usher logs in to the server with for this user: the plaintext or
/// md5 hash it holds, or the SCRAM keys this login yielded (pass-through),
/// with the cleartext password when the client sent it.
fn server_credential(secret: Option<&Secret>, authenticated: &Authenticated) -> ServerCredential {
    match secret {
        Some(Secret::Plain { password, .. }) => ServerCredential::Password(password.clone()),
        Some(Secret::Md5(hash)) => ServerCredential::Md5(hash.clone()),
        Some(Secret::Scram(verifier)) => match authenticated.scram_client_key {
            Some(client_key) => {
                let keys = ScramKeys {
                    client_key,
                    verifier: verifier.clone(),
                };
                match &authenticated.cleartext {
                    Some(password) => ServerCredential::ScramAndPassword(keys, password.clone()),
                    None => ServerCredential::Scram(keys),
                }
            }
            None => ServerCredential::None,
        },
        None => ServerCredential::None,
    }
}
