-- Tell a user at login how often logins as them failed, and when and from
-- where the last one came: the auth monitor's counts, read from its shared
-- store (auth_monitor.store), summed over every usher instance that writes
-- there. Counts reach the store every auth_monitor.store.flush_interval_s.
--
-- Needs hooks.query in the store's database, as a user that may read its
-- tables (here in the schema public, auth_monitor.store.schema's default).
-- The store keys a role's row by its oid when usher knows it, else by its
-- name (uid 0): the query adds the two up.

local sql = [[
SELECT sum(r.other_auth_failures)::int8 AS failures,
       sum(r.blocked_attempts)::int8 AS refused,
       to_char(max(r.last_failed_ts) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') AS last_failed,
       (array_agg(r.last_failed_addr ORDER BY r.last_failed_ts DESC NULLS LAST))[1] AS last_addr
  FROM public.usher_auth_mon_roles r
 WHERE r.uid = (SELECT oid FROM pg_roles WHERE rolname = $1)
    OR (r.uid = 0 AND r.name = $1)]]

function client_connection(ctx)
  local row = usher.query(sql, ctx.user)[1]
  if row.failures == nil or row.failures == 0 then return end
  ctx:notice(string.format(
    "%d failed login attempts as %s so far (%d refused), the last at %s UTC from %s",
    row.failures, ctx.user, row.refused, row.last_failed or "?", row.last_addr or "?"))
end
