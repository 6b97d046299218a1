-- Per-tenant session settings kept in a table, so that a DBA changes them
-- with SQL rather than by editing hooks. Each role is a tenant; its rows
-- become its session settings (custom ones such as app.tenant_id too),
-- applied on every server connection it uses.
--
--   CREATE TABLE tenant_settings (role name, name text, value text,
--                                 PRIMARY KEY (role, name));
--   INSERT INTO tenant_settings VALUES ('acme', 'app.tenant_id', '42'),
--                                      ('acme', 'statement_timeout', '5s');
--
-- Needs hooks.query: the query runs on usher's own connections as that
-- user, which must be able to read the table. It runs once per client,
-- at login. If it fails (the table is gone, the server is down), the hook
-- fails and hooks.on_error decides: by default the client is refused.

function client_connection(ctx)
  local rows = usher.query(
    "SELECT name, value FROM tenant_settings WHERE role = $1 ORDER BY name", ctx.user)
  for _, row in ipairs(rows) do
    ctx:set(row.name, row.value)
  end
  ctx.vars.tenant_settings = #rows
end
