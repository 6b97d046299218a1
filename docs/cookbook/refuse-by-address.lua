-- Members of `dba` may connect only from the admin network and from the
-- host itself; everyone else from anywhere. (The built-in blocking rules
-- do this without Lua, `addresses` and `member_of`: a hook is for when
-- the decision needs more than a rule.)
--
-- IPv4 only: an IPv6 client is in none of these networks. Needs
-- hooks.query (for usher.roles).

local allowed = {
  dba = { "10.20.0.0/16", "127.0.0.1/32" },
}

--- The address as a 32-bit number, or nil if it is not dotted IPv4.
local function ipv4(addr)
  local a, b, c, d = addr:match("^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
  if a == nil then return nil end
  return ((tonumber(a) * 256 + tonumber(b)) * 256 + tonumber(c)) * 256 + tonumber(d)
end

local function in_network(addr, cidr)
  local net, bits = cidr:match("^(.+)/(%d+)$")
  local a, n = ipv4(addr), ipv4(net)
  if a == nil or n == nil then return false end
  local size = 2 ^ (32 - tonumber(bits))
  return a // size == n // size
end

function client_connection(ctx)
  for role, networks in pairs(allowed) do
    if usher.roles.is_member(ctx.user, role) then
      local ok = false
      for _, cidr in ipairs(networks) do
        if in_network(ctx.client_addr, cidr) then ok = true end
      end
      if not ok then
        ctx:reject(string.format("members of %s may not connect from %s", role, ctx.client_addr), {
          sqlstate = "28000",
          hint = "connect from the admin network",
        })
        return
      end
    end
  end
end
