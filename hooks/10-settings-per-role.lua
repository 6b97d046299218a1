-- Session settings per role: search_path and application_name for roles
-- listed below, applied on every server connection the session uses (in
-- transaction mode too) and again after DISCARD ALL.
--
-- Harmless as shipped: it only acts for the roles named in `per_role`.

local per_role = {
  reporting = { search_path = "reports, public", application_name = "reporting" },
  etl = { search_path = "staging, public", statement_timeout = "15min" },
}

function session_start(ctx)
  local settings = per_role[ctx.user]
  if settings == nil then return end
  for name, value in pairs(settings) do
    ctx:set(name, value)
  end
end
