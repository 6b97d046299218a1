//! A session's settings and hooks on its server connection: session_start
//! hooks, restarting after DISCARD ALL, putting back what a reset changed,
//! reading settings back.

use super::*;

impl Session {
    /// Brings the server connection in line with the session's
    /// parameters; the reported ones whose value changed.
    pub(super) async fn params_in_line(
        &mut self,
        conn: &mut crate::backend::ServerConn,
    ) -> Result<Vec<(String, String)>, PgError> {
        self.params
            .bring_in_line(conn, "", None)
            .await
            .map_err(|e| {
                PgError::fatal(
                    e.sqlstate(),
                    format!("could not apply session parameters: {e}"),
                )
            })
    }

    /// Runs session_start hooks: their parameters replace those of the
    /// previous run; notices and failures (as WARNINGs) go to the client.
    /// Returns the statements hooks asked to run (session mode).
    pub(super) async fn start_session(
        &mut self,
        client: &mut ClientStream,
        reason: SessionReason,
        server: Option<ServerInfo>,
    ) -> Result<Vec<String>, PgError> {
        if !self.deps.hooks.handles(Event::SessionStart) {
            return Ok(Vec::new());
        }
        let mut ctx = SessionCtx {
            client: &self.client,
            vars: &mut self.vars,
            reason,
            server,
            params: Vec::new(),
            exec: Vec::new(),
            notices: Vec::new(),
            warnings: Vec::new(),
        };
        self.deps.hooks.session_start(&mut ctx).await;
        let SessionCtx {
            params,
            exec,
            notices,
            warnings,
            ..
        } = ctx;
        self.params.set_hook_params(params);
        let mut out = BytesMut::new();
        for n in notices {
            PgError::notice(n).encode(&mut out);
        }
        for w in warnings {
            PgError::warning(w).encode(&mut out);
        }
        if !out.is_empty() {
            client
                .write_all(&out)
                .await
                .map_err(|_| PgError::protocol("client went away"))?;
        }
        Ok(exec)
    }

    /// After the client's DISCARD ALL: forget its SETs and the hooks'
    /// values, run session_start again, and (session mode) apply the result
    /// to the server connection it holds.
    pub(super) async fn restart_session(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<(), PgError> {
        self.params.reset();
        let server = fwd.held.as_ref().map(server_info);
        let exec = self
            .start_session(client, SessionReason::DiscardAll, server)
            .await?;
        if let Some(checkout) = fwd.held.as_mut() {
            self.apply_session(client, checkout, exec).await?;
        }
        Ok(())
    }

    /// Brings a held server connection in line with the session (parameters)
    /// and runs the statements session_start hooks asked for; a failing
    /// statement is a WARNING for the client.
    pub(super) async fn apply_session(
        &mut self,
        client: &mut ClientStream,
        checkout: &mut Checkout,
        exec: Vec<String>,
    ) -> Result<(), PgError> {
        let changed = self.params_in_line(&mut checkout.conn).await?;
        report_parameters(client, changed).await?;
        self.run_session_statements(client, checkout, exec).await
    }

    /// Runs the statements session_start hooks asked for; a failing one is
    /// a WARNING for the client.
    pub(super) async fn run_session_statements(
        &mut self,
        client: &mut ClientStream,
        checkout: &mut Checkout,
        exec: Vec<String>,
    ) -> Result<(), PgError> {
        for sql in exec {
            if let Err(e) = checkout.conn.simple_query(&sql).await {
                let w = PgError::warning(format!("session_start statement failed: {e}"))
                    .with_detail(sql.clone());
                let mut out = BytesMut::new();
                w.encode(&mut out);
                client
                    .write_all(&out)
                    .await
                    .map_err(|_| PgError::protocol("client went away"))?;
            }
        }
        Ok(())
    }

    /// [`ServerStep::Settle`]: the client's statements may have reset
    /// settings, which on the server connection went to the server's
    /// defaults. Brings the connection to what PostgreSQL would have, and
    /// returns the ParameterStatus messages to send before the
    /// ReadyForQuery (`status`): each reported parameter whose value is
    /// not what the client was last told.
    ///
    /// Outside a transaction block the settings are read back and the
    /// connection brought in line with the session (after a DISCARD ALL,
    /// the session begins anew first: its SETs and hook values are
    /// forgotten, session_start runs again). Inside one, the values the
    /// session started with go back for the names it reset, within the
    /// transaction (a ROLLBACK undoes both, as it would the RESET); the
    /// rest is settled when the block ends. In a failed block the error's
    /// abort undid the resets (unless a SAVEPOINT followed them in the same
    /// Query: a known limit).
    pub(super) async fn settle_resets(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
        status: u8,
    ) -> Result<BytesMut, PgError> {
        let conn = &fwd.held.as_ref().expect("a server connection is held").conn;
        // What the client was told, before anything changes.
        let mut told: Vec<(String, Option<String>)> = conn
            .params()
            .base()
            .keys()
            .map(|name| {
                (
                    name.clone(),
                    self.params.told(name, &self.defaults).cloned(),
                )
            })
            .collect();
        told.sort();
        if status == crate::protocol::tags::status::IDLE {
            let mut exec = Vec::new();
            if fwd.flow.take_discarded() {
                // The client's DISCARD ALL: its session begins anew.
                self.params.reset();
                let server = fwd.held.as_ref().map(server_info);
                exec = self
                    .start_session(client, SessionReason::DiscardAll, server)
                    .await?;
                if self.mode != PoolMode::Session {
                    // (Statements are session mode's.)
                    exec.clear();
                }
            }
            self.settle_settings(client, fwd, false).await?;
            let checkout = fwd.held.as_mut().expect("a server connection is held");
            self.params_in_line(&mut checkout.conn).await?;
            self.run_session_statements(client, checkout, exec).await?;
        } else if status == crate::protocol::tags::status::FAILED {
            // The error aborted the (sub)transaction, and the resets with
            // it: the server has what PostgreSQL would.
            fwd.flow.take_resets();
        } else {
            let restores = self.restores(fwd.flow.take_resets());
            let conn = &mut fwd.held.as_mut().expect("a server connection is held").conn;
            conn.restore(&restores).await.map_err(|e| {
                PgError::fatal(
                    e.sqlstate(),
                    format!("could not put back the session's value of a reset setting: {e}"),
                )
            })?;
        }
        let conn = &fwd.held.as_ref().expect("a server connection is held").conn;
        let mut out = BytesMut::new();
        for (name, before) in told {
            let Some(now) = conn.params().get(&name) else {
                continue;
            };
            if before.as_ref() != Some(now) {
                messages::parameter_status(&mut out, &name, now);
                if status != crate::protocol::tags::status::IDLE {
                    // Settled when the block ends; until then the client
                    // has what it was told.
                    self.params.observe(&name, now);
                }
            }
        }
        Ok(out)
    }

    /// What to put back inside a transaction block after `resets`: the
    /// value the session started with, for each name it has one of (the
    /// others went to the server's default, as they would directly).
    pub(super) fn restores(&self, resets: Vec<Reset>) -> Vec<Restore> {
        let mut out = Vec::new();
        let mut put = |name: &str, local: bool| {
            if let Some(value) = self.params.reset_value(name) {
                if !SERVER_SET.contains(&name) {
                    out.push(Restore {
                        name: name.to_string(),
                        value: value.clone(),
                        local,
                    });
                }
            }
        };
        for reset in resets {
            match reset {
                Reset::One { name, local } => put(&canonical_name(&name), local),
                Reset::All => {
                    for name in self.params.started_with() {
                        put(name, false);
                    }
                }
                Reset::Unknown => {}
            }
        }
        out
    }

    /// The client's statements may have changed settings: read back what
    /// the server connection's session has set and make it the session's
    /// own (`SessionParams::settle`). With `sync_now` (session mode, where
    /// the connection stays), a RESET's startup value goes back on at once.
    pub(super) async fn settle_settings(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
        sync_now: bool,
    ) -> Result<(), PgError> {
        let effects = fwd.flow.settled();
        let mut custom = effects.custom;
        let checkout = fwd.held.as_mut().expect("a server connection is held");
        let conn = &mut checkout.conn;
        // Custom settings the session or the connection already has may
        // have been RESET: ask for them too.
        for name in conn.params().now().keys().chain(self.params.custom_names()) {
            if name.contains('.') && !custom.contains(name) {
                custom.push(name.clone());
            }
        }
        let read = conn.session_settings(&custom).await.map_err(|e| {
            PgError::fatal(
                e.sqlstate(),
                format!("could not read the session's settings back: {e}"),
            )
        })?;
        // (A SET LOCAL ... TO DEFAULT ended with its transaction.)
        let reset = |name: &str| {
            effects.resets.iter().any(|r| match r {
                Reset::All | Reset::Unknown => true,
                Reset::One { name: n, local } => !local && canonical_name(n) == name,
            })
        };
        self.params.settle(read, conn.params(), reset);
        if sync_now {
            self.apply_session(client, checkout, Vec::new()).await?;
        }
        Ok(())
    }
    /// Session mode: the session begins with its server connection
    /// (session_start hooks, then their parameters and statements).
    pub(super) async fn start_on_server(
        &mut self,
        client: &mut ClientStream,
        checkout: &mut Checkout,
    ) -> Result<(), PgError> {
        self.session_started = true;
        let reused = checkout.conn.start_session();
        let reason = if reused {
            SessionReason::ReusedServer
        } else {
            SessionReason::NewSession
        };
        let exec = self
            .start_session(client, reason, Some(server_info(checkout)))
            .await?;
        self.apply_session(client, checkout, exec).await
    }
}

/// Tells the client about parameters whose value changed under it.
pub(super) async fn report_parameters(
    client: &mut ClientStream,
    changed: Vec<(String, String)>,
) -> Result<(), PgError> {
    if changed.is_empty() {
        return Ok(());
    }
    let mut out = BytesMut::new();
    for (name, value) in changed {
        messages::parameter_status(&mut out, &name, &value);
    }
    client
        .write_all(&out)
        .await
        .map_err(|_| PgError::protocol("client went away"))
}

/// What session_start hooks learn of a server connection.
pub(super) fn server_info(checkout: &Checkout) -> ServerInfo {
    ServerInfo {
        backend_pid: checkout.conn.backend_pid(),
        server_version: checkout
            .conn
            .params()
            .get("server_version")
            .cloned()
            .unwrap_or_default(),
        fresh: checkout.conn.sessions_served() <= 1,
    }
}
