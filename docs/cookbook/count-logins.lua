-- At most so many logins a minute per user, counted in usher.shared (one
-- store for every hook VM of this usher instance: each instance counts
-- its own). The count's key expires 60 s after the user's first login of
-- the minute, so the window starts at that login. Users not listed here
-- are counted but not limited; a refused login counts too.

local per_minute = {
  batch_loader = 3,
}

function client_connection(ctx)
  local n = usher.shared.incr("logins/" .. ctx.user, 1, 60)
  ctx.vars.logins_this_minute = n
  local limit = per_minute[ctx.user]
  if limit ~= nil and n > limit then
    ctx:reject(string.format("too many logins for user %s: %d within a minute, at most %d", ctx.user, n, limit), {
      sqlstate = "53300",
      hint = "reuse connections, or wait a minute",
    })
  end
end
