#!/usr/bin/env bash
# Runs usher in front of a local PostgreSQL with config/usher.yaml.
#
# If nothing answers on 127.0.0.1:5432, starts a throwaway cluster there
# (data in .quickstart/). Makes sure the demo role and database exist, then
# runs usher in the foreground on 127.0.0.1:6432. Ctrl-C stops usher; the
# throwaway cluster keeps running (stop it with: scripts/quickstart.sh stop).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh

QS="$PWD/.quickstart"
PGPORT=5432

if [ "${1:-}" = "stop" ]; then
  [ -d "$QS/data" ] && as_postgres "$(pg_bindir)/pg_ctl" -D "$QS/data" -m fast stop || true
  exit 0
fi

ensure_postgres_installed
BIN=$(pg_bindir)

# Runs SQL as a PostgreSQL superuser: over the throwaway cluster's socket,
# or as the postgres OS user over the default socket for an existing server.
superuser_psql() {
  if [ -d "$QS/data" ]; then
    psql -X -q -h "$QS" -p "$PGPORT" -U postgres -d postgres -v ON_ERROR_STOP=1 "$@"
  else
    as_postgres psql -X -q -p "$PGPORT" -d postgres -v ON_ERROR_STOP=1 "$@"
  fi
}

if pg_isready -q -h 127.0.0.1 -p "$PGPORT"; then
  echo "usher quickstart: using the PostgreSQL already running on 127.0.0.1:$PGPORT"
elif [ -d "$QS/data" ]; then
  echo "usher quickstart: starting the throwaway cluster in $QS"
  as_postgres "$BIN/pg_ctl" -D "$QS/data" -l "$QS/postgres.log" -w start >/dev/null
else
  echo "usher quickstart: starting a throwaway PostgreSQL cluster in $QS"
  mkdir -p "$QS"
  [ "$(id -u)" -eq 0 ] && chown postgres:postgres "$QS"
  as_postgres "$BIN/initdb" -D "$QS/data" -U postgres -E UTF8 --locale=C \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  cat >>"$QS/data/postgresql.conf" <<CONF
port = $PGPORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$QS'
password_encryption = 'scram-sha-256'
CONF
  as_postgres "$BIN/pg_ctl" -D "$QS/data" -l "$QS/postgres.log" -w start >/dev/null
fi

# The demo role and database that config/usher.yaml points at.
superuser_psql <<'SQL' || echo "usher quickstart: could not create role demo / database app (no superuser access?); create them yourself" >&2
SELECT 'CREATE ROLE demo LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'demo') \gexec
ALTER ROLE demo PASSWORD 'demo-secret';
SELECT 'CREATE DATABASE app OWNER demo' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'app') \gexec
SQL

cargo build --release --quiet
cat <<MSG

usher is starting on 127.0.0.1:6432 in front of 127.0.0.1:$PGPORT. In another terminal:

    PGPASSWORD=demo-secret psql -h 127.0.0.1 -p 6432 -U demo app
    PGPASSWORD=admin-secret psql -h 127.0.0.1 -p 6432 -U admin usher -c 'SHOW POOLS'

MSG
exec target/release/usher --config config/usher.yaml
