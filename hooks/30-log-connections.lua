-- Log every client that comes and goes, with where from and for how long.
-- ctx.vars carries the login time from client_connection to session_end.

function client_connection(ctx)
  ctx.vars.connected_at = os.time()
  usher.log("info", string.format("connect user=%s database=%s addr=%s:%d app=%q tls=%s",
    ctx.user, ctx.database, ctx.client_addr, ctx.client_port, ctx.application_name,
    ctx.tls and ctx.tls.version or "no"))
end

function session_end(ctx)
  usher.log("info", string.format("disconnect user=%s database=%s addr=%s after %d ms",
    ctx.user, ctx.database, ctx.client_addr, ctx.duration_ms))
end
