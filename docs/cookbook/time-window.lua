-- Let members of a role in only during their hours (UTC, `from`
-- inclusive, `to` exclusive; a window may run past midnight). Batch jobs
-- connect at night, reports by day; anyone else at any time. A client
-- outside its window gets 57P03 (cannot_connect_now) and a hint saying
-- when to come back.
--
-- Needs hooks.query (for usher.roles).

local windows = {
  { role = "night_batch", from = 20, to = 8 },
  { role = "day_reports", from = 8, to = 20 },
}

local function inside(hour, w)
  if w.from <= w.to then
    return hour >= w.from and hour < w.to
  end
  return hour >= w.from or hour < w.to -- past midnight
end

function client_connection(ctx)
  local hour = tonumber(os.date("!%H"))
  for _, w in ipairs(windows) do
    if usher.roles.is_member(ctx.user, w.role) and not inside(hour, w) then
      ctx:reject(string.format("members of %s may connect only between %02d:00 and %02d:00 UTC", w.role, w.from, w.to), {
        sqlstate = "57P03",
        hint = string.format("try again after %02d:00 UTC", w.from),
      })
      return
    end
  end
end
