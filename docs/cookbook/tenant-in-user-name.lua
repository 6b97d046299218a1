-- Routing: the tenant in the user name, as Supavisor does. `alice.tenant42`
-- authenticates as itself (a `users:` entry, the auth file or the auth
-- query), then its session goes as the role `alice` to tenant 42's shard,
-- in the shard's database `tenants`. Tenants go to the shards in turn
-- (tenant % number of shards): edit `shards`. Every shard's host and port
-- must be in `routing.allow`, and `app` in `routing.allow.databases`; a
-- user name without a tenant goes where its startup packet says.
local shards = {
  { host = "127.0.0.1", port = 5432 },
  { host = "127.0.0.1", port = 5433 },
}
local dbname = "tenants"

function client_connection(ctx)
  local role, tenant = string.match(ctx.user, "^(.+)%.tenant(%d+)$")
  if role == nil then return end
  local shard = shards[tonumber(tenant) % #shards + 1]
  ctx:route{ database = "app", host = shard.host, port = shard.port, dbname = dbname, user = role }
end
