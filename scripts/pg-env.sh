# Shared by the scripts: find PostgreSQL's server programs, install them when
# missing (Debian/Ubuntu, as root), and run them as the postgres OS user when
# we are root (initdb and postgres refuse to run as root).

pg_bindir() {
  if command -v initdb >/dev/null 2>&1; then
    dirname "$(readlink -f "$(command -v initdb)")"
    return
  fi
  ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

ensure_postgres_installed() {
  local bindir
  bindir=$(pg_bindir)
  if [ -n "$bindir" ] && [ -x "$bindir/initdb" ] && command -v psql >/dev/null 2>&1 && command -v pgbench >/dev/null 2>&1; then
    return
  fi
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "PostgreSQL (initdb, pg_ctl, psql, pgbench) is missing: install the postgresql package" >&2
    exit 1
  fi
  echo "installing PostgreSQL with apt-get..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql postgresql-contrib >/dev/null
}

# as_postgres CMD...: run CMD as the postgres OS user when root, else as ourselves.
as_postgres() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}
