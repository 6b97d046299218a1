#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target (fuzz/corpus/<target>/): real
packets and messages, SCRAM exchanges, console commands, pg_hba lines,
userlists and configurations. Run from anywhere; it overwrites its own files
only. The corpus that fuzzing grows is kept elsewhere (fuzz/target/grown)."""
import base64
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def msg(tag, body=b""):
    return tag + struct.pack(">I", len(body) + 4) + body


def cstr(s):
    return s.encode() + b"\0"


def piece(b):
    assert len(b) < 256
    return bytes([len(b)]) + b


# startup: the first packet.
def startup(code, rest=b""):
    body = struct.pack(">I", code) + rest
    return struct.pack(">I", len(body) + 4) + body


write("startup", "startup", startup(196608, cstr("user") + cstr("alice") + cstr("database") + cstr("app") + cstr("application_name") + cstr("psql") + b"\0"))
write("startup", "ssl", startup(80877103))
write("startup", "gssenc", startup(80877104))
write("startup", "cancel", startup(80877102, struct.pack(">II", 1234, 5678)))
write("startup", "protocol2", startup(2 << 16, cstr("user") + cstr("alice") + b"\0"))
write("startup", "no_user", startup(196608, cstr("database") + cstr("app") + b"\0"))

# frames: max_message (u16), max_inspected (u16), wanted, stop_after, cuts piece, stream.
client = (msg(b"Q", cstr("select 1"))
          + msg(b"P", cstr("s1") + cstr("select $1") + struct.pack(">hI", 1, 23))
          + msg(b"B", cstr("") + cstr("s1") + struct.pack(">hhh", 0, 1, 0) + struct.pack(">i", 1) + b"7" + struct.pack(">h", 0))
          + msg(b"D", b"P" + cstr(""))
          + msg(b"E", cstr("") + struct.pack(">i", 0))
          + msg(b"S") + msg(b"X"))
server = (msg(b"1") + msg(b"2") + msg(b"T", struct.pack(">h", 1) + cstr("x") + struct.pack(">IhIhih", 0, 0, 25, -1, -1, 0))
          + msg(b"D", struct.pack(">hi", 1, 1) + b"7") + msg(b"C", cstr("SELECT 1"))
          + msg(b"S", cstr("TimeZone") + cstr("UTC"))
          + msg(b"E", b"SERROR\0C42P01\0Mrelation \"x\" does not exist\0\0")
          + msg(b"Z", b"I"))
write("frames", "client", struct.pack(">HH", 0xffff, 0x4000) + bytes([0b11111111, 0]) + piece(bytes([3, 7, 1])) + client)
write("frames", "server", struct.pack(">HH", 0xffff, 0x4000) + bytes([0b01010101, 0b00000100]) + piece(bytes([5])) + server)
write("frames", "streamed", struct.pack(">HH", 0x0100, 0x0010) + bytes([0, 0]) + piece(bytes([2, 9])) + msg(b"d", b"x" * 200) + msg(b"c"))

# messages: the limit selector, then whole messages.
write("messages", "login", bytes([2]) + msg(b"p", cstr("s3cret")) + msg(b"p", cstr("SCRAM-SHA-256") + struct.pack(">i", 3) + b"abc"))
write("messages", "server", bytes([3]) + server)
write("messages", "error", bytes([3]) + msg(b"E", b"SFATAL\0VFATAL\0C28P01\0Mpassword authentication failed\0\0") + msg(b"N", b"SNOTICE\0C00000\0Mhi\0\0"))

# auth: method and secret selector, then the client's messages.
first = b"n,,n=,r=rOprNGfwEbeRWgbNEkqO"
sasl_initial = msg(b"p", cstr("SCRAM-SHA-256") + struct.pack(">i", len(first)) + first)
sasl_final = msg(b"p", b"c=biws,r=rOprNGfwEbeRWgbNEkqO,p=" + base64.b64encode(bytes(32)))
for how, name in [(0, "password_plain"), (1, "md5_plain"), (2, "scram_plain"), (5, "scram_md5"), (8, "scram_scram"), (11, "scram_unknown"), (6, "password_scram")]:
    if how % 3 == 2:
        write("auth", name, bytes([how]) + sasl_initial + sasl_final)
    elif how % 3 == 1:
        write("auth", name, bytes([how]) + msg(b"p", cstr("md5" + "0" * 32)))
    else:
        write("auth", name, bytes([how]) + msg(b"p", cstr("pw")))
write("auth", "wrong_mechanism", bytes([2]) + msg(b"p", cstr("SCRAM-SHA-256-PLUS") + struct.pack(">i", -1)))

# scram_server: client-first (a piece), then client-final; @@ is the server's nonce.
proof = base64.b64encode(bytes(32))
write("scram_server", "exchange", piece(first) + b"c=biws,r=@@,p=" + proof)
write("scram_server", "authzid", piece(b"y,a=alice,n=alice,r=abc") + b"c=eSxhPWFsaWNlLA==,r=@@,p=" + proof)
write("scram_server", "psql", piece(b"n,,n=,r=9IZ2O01zb9IgiIZ1WJ/zgpJB") + b"c=biws,r=@@,p=AFpSYH/K/8bux1mRPUwxTe8lBuIPEyhi/7UFPQpSr4A=")

# scram_client: server-first (a piece; @@ usher's nonce, $$ the salt), then server-final.
write("scram_client", "exchange", piece(b"r=@@3rfcNHYJY1ZVvWVs7j,s=$$,i=4096") + b"v=" + base64.b64encode(bytes(32)))
write("scram_client", "error", piece(b"r=@@x,s=$$,i=4096") + b"e=invalid-proof")
write("scram_client", "mismatch", piece(b"r=@@x,s=QSXCR+Q6sek8bf92,i=4096") + b"v=")

# prepared: bound, then ops: 0-2 client message (tag by op/8), 3 Sync,
# 4 answer, 5 ReadyForQuery, 6 DISCARD ALL, 7 next transaction.
def client_msg(tag_index, body):
    return bytes([tag_index * 8]) + piece(body)

parse = client_msg(0, cstr("s1") + cstr("select $1") + struct.pack(">hI", 1, 23))
bind = client_msg(1, cstr("") + cstr("s1") + struct.pack(">hhh", 0, 1, 0))
describe = client_msg(2, b"S" + cstr("s1"))
close = client_msg(3, b"S" + cstr("s1"))
sync, answer_parse, answer_close, ready, discard = bytes([3]), bytes([4]), bytes([12]), bytes([5]), bytes([6])
write("prepared", "cycle", bytes([3]) + parse + bind + describe + sync + answer_parse + ready + bytes([7]) + bind + sync + answer_parse + ready + bytes([15]) + parse + sync + answer_close + ready + close + sync + answer_close + ready)
write("prepared", "error_skips", bytes([1]) + parse + client_msg(0, cstr("s2") + cstr("select 2") + struct.pack(">h", 0)) + sync + ready + bind + discard + bytes([7]) + parse)

# console: simple Query text as sent.
for i, c in enumerate([
    "SHOW POOLS;", "show help", "PAUSE app", "RESUME", "RECONNECT \"my db\"", "KILL app;",
    "KILL_CLIENT 42", "RESET AUTH_MON", "RESET AUTH_MON 10.0.0.1", "RESET AUTH_MON \"10.0.0.1\"",
    "MAINTENANCE ON admins", "MAINTENANCE OFF", "SHUTDOWN WAIT_FOR_CLIENTS", "ENABLE HOOKS", "RELOAD\0",
]):
    write("console", f"command{i:02}", c)

# hba_file: pg_hba.conf lines.
write("hba_file", "rules", """# TYPE  DATABASE  USER  ADDRESS  METHOD
hostssl all carol 0.0.0.0/0 reject
host app alice,bob 127.0.0.1/32 trust   # inline comment
host all +staff 10.0.0.0 255.0.0.0 md5
hostnossl sameuser all ::1/128 password
host "all" "a b","x""y" all cert
local all all trust
host all all all scram-sha-256
""")
write("hba_file", "bad", "host all all 10.0.0.0/8 md5 clientcert=verify-full\nhost \"all all all trust\n")

# hba_yaml: auth.hba.
write("hba_yaml", "rules", """- { type: host, database: app, user: alice, address: 127.0.0.0/8, method: trust }
- { type: hostssl, database: "all", user: "+staff, bob", address: "::1/128", method: cert }
- { type: local, database: all, user: all, method: reject }
- { type: hostnossl, database: sameuser, user: all, address: all, method: scram-sha-256 }
""")

# userlist: PgBouncer's userlist.txt.
write("userlist", "users", """; comment
"alice" "a""b"
"bob" "md5c2f9e3dc9a6b3a1e1e2b1a4a1b1b1b1b"
  "carol"   "SCRAM-SHA-256$4096:c2FsdHNhbHRzYWx0$FzTbzVjF0ec4Ckq5xCjHQ2JbXSwCVBO8QuDdvb3M1wM=:Ffm0XsHXdSkZYTd3VTtAlBOiqP4CsBZ3bA1UqcRJ1dE=" "ignored"
# another
""")
write("userlist", "bad", "\"alice\" \"s3cret\"\nalice s3cret\n")

# config: the shipped configuration and one with every section.
with open(os.path.join(ROOT, "config", "usher.yaml"), "rb") as f:
    write("config", "usher.yaml", f.read())
write("config", "full.yaml", """listen: 127.0.0.1:6432
pool_mode: session
pool_size: 5
min_pool_size: 1
query_wait_timeout: 1.5
client_idle_timeout: 0
server_lifetime: 3600
prepared_statements: 100
max_message_size: 1048576
tls: { mode: allow, cert: c.pem, key: k.pem, ca: ca.pem }
auth:
  method: md5
  user: auth
  cache_ttl: 5
  hba:
    - { type: hostssl, database: all, user: all, address: all, method: cert }
databases:
  app: { host: db, port: 5433, dbname: real, pool_size: 3, query_wait_timeout: 2, tls: verify-full, tls_ca: ca.pem }
  other: { pool_mode: transaction, server_lifetime: 60 }
users:
  auth: { password: secret }
  bob: { password: "md5c2f9e3dc9a6b3a1e1e2b1a4a1b1b1b1b", pool_size: 2 }
admin: { users: [auth], stats_users: [bob] }
log: { level: "usher=debug,warn", format: json }
hooks:
  enabled: true
  timeout_ms: 50
  memory_limit_mb: 16
  query: { database: app, user: auth, timeout_ms: 500 }
auth_monitor:
  state_file: mon.json
  lockout: { max_failures: 5, window_s: 60, duration_s: 300 }
blocking:
  rules:
    - { action: deny, member_of: reporting, databases: [app], message: "later" }
  maintenance: { member_of: admins }
metrics: { listen: 127.0.0.1:9930 }
""")

# sql_scan: the first byte is the declared parameter count, the rest a
# Query or Parse text.
write("sql_scan", "params", b"\x02SELECT $1::int + $2")
write("sql_scan", "prepare", b"\x00PREPARE p (int) AS SELECT $1; ")
write("sql_scan", "explain", b"\x00EXPLAIN (ANALYZE) EXECUTE \"q\"(1, 'a;b')")
write("sql_scan", "block", b"\x00BEGIN; SET LOCAL search_path = a; LISTEN x; COMMIT AND NO CHAIN")
write("sql_scan", "dollar", b"\x00DO $$ BEGIN PERFORM set_config('a.b', 'c', false); END $$; /* c */ -- x")
write("sql_scan", "rollback", b"\x00rollback work")
