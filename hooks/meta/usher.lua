---@meta
-- LuaLS annotations for usher hooks: point your editor's Lua language server
-- at this folder (it is not loaded as a hook: only *.lua files directly in
-- hooks/ are). See docs/hooks.md, "Events", for when each event runs.

---@class UsherTls
---@field version string             protocol version, e.g. "TLSv1_3"
---@field cipher string              negotiated cipher suite
---@field client_cert_subject string? "CN=..." of the client certificate

---@class UsherServer
---@field backend_pid integer        the PostgreSQL backend's pid
---@field server_version string
---@field fresh boolean              false when the connection served an earlier session

---@class UsherRejectOptions
---@field sqlstate string?           five characters, default "28000"
---@field detail string?
---@field hint string?

---@class UsherCtx
---@field event string               "auth_attempt" | "client_connection" | "session_start" | "session_end"
---@field id integer                 usher's connection id (its BackendKeyData pid)
---@field user string
---@field database string
---@field application_name string
---@field startup table<string,string> the startup packet's parameters
---@field client_addr string             the IP, or "unix" for a client of the Unix-domain socket
---@field client_port integer            a Unix-socket client's is the socket's port
---@field tls UsherTls?              nil for plaintext connections
---@field auth_method string         the method that authenticated the client
---@field pool_mode string           "session" | "transaction"
---@field vars table<string, string|number|boolean> kept for this client's later events
---@field reason string?             session_start: "new_session" | "discard_all" | "reused_server"
---@field server UsherServer?        session_start in session mode
---@field duration_ms integer?       session_end
---@field user_exists boolean?       auth_attempt
---@field method string?             auth_attempt: the authentication method
---@field outcome string?            auth_attempt: "success" | "wrong_password" | "unknown_user" | "hba_reject" | "tls_required" | "timeout" | "protocol_error" | "refused" | "locked"
---@field success boolean?           auth_attempt
local UsherCtx = {}

--- Refuse the client (client_connection). It gets a FATAL error with this message.
---@param message string
---@param opts UsherRejectOptions?
function UsherCtx:reject(message, opts) end

--- Set a session parameter, applied on every server connection the session uses.
---@param name string
---@param value string|number
function UsherCtx:set(name, value) end

--- Run a statement on the session's server connection (session_start, session mode only).
---@param sql string
function UsherCtx:exec(sql) end

--- Send the client a NOTICE.
---@param message string
function UsherCtx:notice(message) end

---@class UsherShared
usher.shared = {}
---@param key string
---@return string|number|boolean|nil
function usher.shared.get(key) end
---@param key string
---@param value string|number|boolean|nil  nil deletes
---@param ttl_s number?                     seconds until it expires
function usher.shared.set(key, value, ttl_s) end
---@param key string
---@param by integer?                       default 1
---@param ttl_s number?                     applies when the key is created
---@return integer
function usher.shared.incr(key, by, ttl_s) end
---@param key string
---@return boolean
function usher.shared.delete(key) end

usher = {}

--- Log a line through usher's log ("debug" | "info" | "warn" | "error").
---@param level string
---@param message string
function usher.log(level, message) end

--- Run a query on usher's own small connection pool (hooks.query); parameters
--- are sent as text: cast them in SQL ($1::int). Returns an array of rows,
--- each a table of column name to value.
---@param sql string
---@param ... string|number|boolean|nil
---@return table[]
function usher.query(sql, ...) end

usher.roles = {}
--- True if `user` is `role` or a member of it (transitively), from a cached
--- copy of the server's role graph.
---@param user string
---@param role string
---@return boolean
function usher.roles.is_member(user, role) end
