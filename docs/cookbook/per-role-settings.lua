-- Session settings by role membership: members of `reporting` get the
-- reports schema first and a statement timeout, members of `etl` the
-- staging schema and more work_mem. Set at session_start, they apply on
-- every server connection the session uses (in transaction mode too) and
-- again after DISCARD ALL.
--
-- Needs hooks.query (usher.roles reads the role graph through it).
-- Membership is PostgreSQL's, direct or through other roles, from a copy
-- refreshed every hooks.roles_refresh_s.

local per_group = {
  { role = "reporting", settings = { search_path = "reports, public", statement_timeout = "30s" } },
  { role = "etl", settings = { search_path = "staging, public", work_mem = "256MB" } },
}

function session_start(ctx)
  for _, group in ipairs(per_group) do
    if usher.roles.is_member(ctx.user, group.role) then
      for name, value in pairs(group.settings) do
        ctx:set(name, value)
      end
    end
  end
end
