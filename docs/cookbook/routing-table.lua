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
-- routing.allow. A row is kept for `ttl` seconds, or until the next
-- RECONNECT of app on the console: to move a tenant, UPDATE its row, then
-- RECONNECT app (or wait for the ttl). Sessions that start after that go
-- to the new shard; sessions already open finish on the old one, whose
-- idle connections RECONNECT closes as they come back.
local ttl = 30

function client_connection(ctx)
  local role, tenant = string.match(ctx.user, "^(.+)%.([%w_]+)$")
  if role == nil then return end
  local key = "route:" .. tenant
  -- A row read before the last RECONNECT of app is not used.
  local reconnects = usher.reconnects("app")
  local cached = usher.shared.get(key)
  local host, port, dbname
  if cached ~= nil then
    local seen
    seen, host, port, dbname = string.match(cached, "^(%d+)|(.-)|(%d+)|(.*)$")
    if tonumber(seen) ~= reconnects then host = nil end
  end
  if host == nil then
    local rows = usher.query(
      "SELECT host, port, dbname FROM tenant_shards WHERE tenant = $1", tenant)
    if #rows == 0 then
      ctx:reject("no such tenant: " .. tenant)
      return
    end
    host, port, dbname = rows[1].host, rows[1].port, rows[1].dbname
    usher.shared.set(key, reconnects .. "|" .. host .. "|" .. port .. "|" .. dbname, ttl)
  end
  ctx:route{ database = "app", host = host, port = tonumber(port), dbname = dbname, user = role }
end
