-- Block roles outside a time window (UTC hours, `from` inclusive, `to`
-- exclusive). Clients outside their window get SQLSTATE 57P03
-- (cannot_connect_now) with a hint saying when to come back.
--
-- Harmless as shipped: only the role `nightly_batch` has a window.

local windows = {
  nightly_batch = { from = 1, to = 5 },
}

function client_connection(ctx)
  local w = windows[ctx.user]
  if w == nil then return end
  local hour = tonumber(os.date("!%H"))
  if hour < w.from or hour >= w.to then
    ctx:reject(ctx.user .. " may connect only between " .. w.from .. ":00 and " .. w.to .. ":00 UTC", {
      sqlstate = "57P03",
      hint = "try again after " .. w.from .. ":00 UTC",
    })
  end
end
