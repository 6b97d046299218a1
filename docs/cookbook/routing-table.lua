-- Routing: a routing table in PostgreSQL, read with usher.query and cached
-- in usher.shared. `alice.acme` authenticates as itself, then its session
-- goes as the role `alice` to the server and database of tenant `acme`'s
-- row, through the `app` entry's settings:
--
--   CREATE TABLE tenant_shards (tenant text PRIMARY KEY, host text NOT NULL,
--                               port int NOT NULL, dbname text NOT NULL);
--   INSERT INTO tenant_shards VALUES ('acme', '10.1.0.7', 5432, 'acme');
--
-- Needs hooks.query (the query runs on usher's own connections as that
-- user, which must be able to read the table) and every shard in
-- routing.allow. A row is kept for `ttl` seconds: to move a tenant, UPDATE
-- its row; sessions that start after the ttl go to the new shard, sessions
-- already open finish on the old one (RECONNECT app on the console then
-- closes the old shard's idle connections as they come back).
local ttl = 30

function client_connection(ctx)
  local role, tenant = string.match(ctx.user, "^(.+)%.([%w_]+)$")
  if role == nil then return end
  local key = "route:" .. tenant
  local cached = usher.shared.get(key)
  local host, port, dbname
  if cached ~= nil then
    host, port, dbname = string.match(cached, "^(.-)|(%d+)|(.*)$")
  else
    local rows = usher.query(
      "SELECT host, port, dbname FROM tenant_shards WHERE tenant = $1", tenant)
    if #rows == 0 then
      ctx:reject("no such tenant: " .. tenant)
      return
    end
    host, port, dbname = rows[1].host, rows[1].port, rows[1].dbname
    usher.shared.set(key, host .. "|" .. port .. "|" .. dbname, ttl)
  end
  ctx:route{ database = "app", host = host, port = tonumber(port), dbname = dbname, user = role }
end
