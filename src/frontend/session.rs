//! The serve loop of a logged-in client.
//!
//! The client's bytes are walked message by message (only headers are read;
//! bodies stream through) and forwarded to a server connection borrowed from
//! the pool at the first message of a transaction. The server's bytes are
//! walked the same way, looking only at ReadyForQuery and ParameterStatus.
//! In transaction mode the server connection goes back to the pool at the
//! ReadyForQuery 'I' that answers the client's last Sync/Query; in session
//! mode it stays until the client leaves.

use super::close_with_error;
use super::params::SessionParams;
use super::registry::{ClientHandle, Registration};
use super::stream::ClientStream;
use crate::app::App;
use crate::config::PoolMode;
use crate::pool::{Checkout, Pool};
use crate::protocol::error::sqlstate;
use crate::protocol::frames::{FrameWalker, Visit};
use crate::protocol::messages::{self, parse_parameter_status};
use crate::protocol::PgError;
use bytes::{Buf, BytesMut};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Read buffers grow from this size; they are freed while the client is idle.
const BUFFER_SIZE: usize = 16 * 1024;

/// A logged-in client and what its session wants.
pub struct Session {
    app: Arc<App>,
    addr: SocketAddr,
    user: String,
    database: String,
    pool: Arc<Pool>,
    params: SessionParams,
    /// The pool's server defaults for reported parameters.
    defaults: Arc<HashMap<String, String>>,
    handle: Arc<ClientHandle>,
    _registration: Registration,
    started: Instant,
}

/// Why the serve loop ended.
enum End {
    /// The client sent Terminate or closed its socket.
    ClientLeft,
    /// Tell the client this and close.
    Error(PgError),
    /// usher is shutting down and the client was idle.
    Shutdown,
}

/// Where the conversation with the server stands, from the messages seen.
#[derive(Debug)]
struct Flow {
    /// Sync/Query/FunctionCall messages sent whose ReadyForQuery has not come.
    pending: u32,
    /// Extended-protocol messages sent since the last Sync.
    unsynced: bool,
    /// Transaction status of the last ReadyForQuery ('I', 'T' or 'E').
    status: u8,
}

impl Flow {
    fn new() -> Self {
        Flow {
            pending: 0,
            unsynced: false,
            status: b'I',
        }
    }

    /// Nothing is in flight: the server owes the client nothing.
    fn quiet(&self) -> bool {
        self.pending == 0 && !self.unsynced
    }
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        app: Arc<App>,
        addr: SocketAddr,
        user: String,
        database: String,
        pool: Arc<Pool>,
        params: SessionParams,
        defaults: Arc<HashMap<String, String>>,
        registration: Registration,
    ) -> Self {
        Session {
            app,
            addr,
            user,
            database,
            pool,
            params,
            defaults,
            handle: registration.handle.clone(),
            _registration: registration,
            started: Instant::now(),
        }
    }

    /// Serves the client until it leaves, an error ends it, or shutdown.
    pub async fn serve(mut self, mut client: ClientStream) {
        let mut held: Option<Checkout> = None;
        let mut flow = Flow::new();
        let end = self.serve_loop(&mut client, &mut held, &mut flow).await;
        self.handle.set_server(None);
        if let Some(checkout) = held.take() {
            let clean = flow.quiet() && flow.status == b'I';
            match (clean, self.pool.mode()) {
                (true, PoolMode::Session) => self.pool.reset_and_checkin(checkout).await,
                (true, PoolMode::Transaction) => self.pool.checkin(checkout),
                (false, _) => self.pool.discard(checkout),
            }
        }
        match &end {
            End::ClientLeft => {}
            End::Error(e) => close_with_error(&mut client, e).await,
            End::Shutdown => {
                let e = PgError::fatal(
                    sqlstate::ADMIN_SHUTDOWN,
                    "terminating connection because usher is shutting down",
                );
                close_with_error(&mut client, &e).await;
            }
        }
        tracing::info!(
            user = %self.user, database = %self.database, addr = %self.addr,
            duration_ms = self.started.elapsed().as_millis() as u64,
            reason = match &end { End::ClientLeft => "client", End::Error(_) => "error", End::Shutdown => "shutdown" },
            "client disconnected"
        );
    }

    async fn serve_loop(
        &mut self,
        client: &mut ClientStream,
        held: &mut Option<Checkout>,
        flow: &mut Flow,
    ) -> End {
        let mode = self.pool.mode();
        let max_message = self.app.config.max_message_size;
        let mut shutdown = self.app.shutting_down();
        let mut in_buf = BytesMut::new();
        let mut out_buf = BytesMut::new();
        let mut in_walker = FrameWalker::new(max_message);
        let mut out_walker = FrameWalker::new(usize::MAX >> 1);

        loop {
            // A client may be ended by shutdown only between transactions.
            let idle =
                held.is_none() || (flow.quiet() && in_walker.at_boundary() && flow.status == b'I');
            if idle && *shutdown.borrow() {
                return End::Shutdown;
            }
            if held.is_none() && in_buf.is_empty() && in_buf.capacity() > 0 {
                in_buf = BytesMut::new(); // an idle client keeps no buffer
            }
            tokio::select! {
                read = async {
                    if in_buf.capacity() == in_buf.len() {
                        client.readable().await?;
                        in_buf.reserve(BUFFER_SIZE);
                    }
                    client.read_buf(&mut in_buf).await
                } => {
                    match read {
                        Ok(0) | Err(_) => return End::ClientLeft,
                        Ok(_) => {}
                    }
                    let mut terminate = false;
                    let walked = in_walker.walk(&in_buf, |_| false, |tag, _| match tag {
                        b'X' => { terminate = true; Visit::StopBefore }
                        b'Q' | b'S' | b'F' => { flow.pending += 1; flow.unsynced = false; Visit::Forward }
                        b'H' | b'd' | b'c' | b'f' => Visit::Forward,
                        _ => { flow.unsynced = true; Visit::Forward }
                    });
                    let walked = match walked {
                        Ok(w) => w,
                        Err(e) => return End::Error(e),
                    };
                    if walked.forward > 0 {
                        if held.is_none() {
                            match self.begin_transaction(client).await {
                                Ok(c) => {
                                    *held = Some(c);
                                    out_buf.reserve(BUFFER_SIZE);
                                }
                                Err(e) => return End::Error(e),
                            }
                        }
                        let server = &mut held.as_mut().expect("server held").conn;
                        if let Err(e) = server.stream.write_all(&in_buf[..walked.forward]).await {
                            return End::Error(server_lost(&e.to_string()));
                        }
                        in_buf.advance(walked.forward);
                    }
                    if terminate {
                        return End::ClientLeft;
                    }
                }
                read = async {
                    match held.as_mut() {
                        Some(c) => c.conn.stream.read_buf(&mut out_buf).await,
                        None => std::future::pending().await,
                    }
                } => {
                    match read {
                        Ok(0) => return End::Error(server_lost("server closed the connection unexpectedly")),
                        Err(e) => return End::Error(server_lost(&e.to_string())),
                        Ok(_) => {}
                    }
                    let checkout = held.as_mut().expect("server held");
                    let params = &mut self.params;
                    let at_boundary = in_walker.at_boundary();
                    let walked = out_walker.walk(&out_buf, |t| t == b'Z' || t == b'S', |tag, body| match tag {
                        b'Z' => {
                            flow.pending = flow.pending.saturating_sub(1);
                            flow.status = body.first().copied().unwrap_or(b'I');
                            if mode == PoolMode::Transaction && flow.status == b'I' && flow.quiet() && at_boundary {
                                Visit::StopAfter
                            } else {
                                Visit::Forward
                            }
                        }
                        b'S' => {
                            if let Some((name, value)) = parse_parameter_status(body) {
                                params.observe(&name, &value);
                                checkout.conn.params.insert(name, value);
                            }
                            Visit::Forward
                        }
                        _ => Visit::Forward,
                    });
                    let walked = match walked {
                        Ok(w) => w,
                        Err(e) => return End::Error(server_lost(&e.message)),
                    };
                    if client.write_all(&out_buf[..walked.forward]).await.is_err() {
                        return End::ClientLeft;
                    }
                    out_buf.advance(walked.forward);
                    if walked.stopped {
                        let checkout = held.take().expect("server held");
                        self.handle.set_server(None);
                        if out_buf.is_empty() {
                            self.pool.checkin(checkout);
                        } else {
                            // The server said more after its last ReadyForQuery: not clean.
                            let _ = client.write_all(&out_buf).await;
                            self.pool.discard(checkout);
                        }
                        out_buf = BytesMut::new();
                        out_walker = FrameWalker::new(usize::MAX >> 1);
                    }
                }
                _ = shutdown.changed(), if idle => {}
            }
        }
    }

    /// Borrows a server connection and brings its parameters in line with
    /// the session.
    async fn begin_transaction(&mut self, client: &mut ClientStream) -> Result<Checkout, PgError> {
        let mut checkout = self.pool.checkout().await?;
        if let Some(sql) = self.params.sync_sql(&checkout.conn, &self.defaults) {
            if let Err(e) = checkout.conn.simple_query(&sql).await {
                self.pool.discard(checkout);
                return Err(PgError::fatal(
                    &e.code,
                    format!("could not apply session parameters: {}", e.message),
                ));
            }
            let changed = self.params.after_sync(&mut checkout.conn, &self.defaults);
            if !changed.is_empty() {
                let mut out = BytesMut::new();
                for (name, value) in changed {
                    messages::parameter_status(&mut out, &name, &value);
                }
                client
                    .write_all(&out)
                    .await
                    .map_err(|_| PgError::protocol("client went away"))?;
            }
        }
        self.handle.set_server(Some(checkout.conn.cancel.clone()));
        Ok(checkout)
    }
}

fn server_lost(detail: &str) -> PgError {
    PgError::fatal(sqlstate::CONNECTION_FAILURE, "server connection lost")
        .with_detail(detail.to_string())
}
