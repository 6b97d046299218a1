#!/usr/bin/env bash
# Rolling restart of one usher on its port, with nobody dropped: start a
# new usher with the same configuration (it must say `so_reuseport: true`,
# as the running one must), wait until the new process itself listens on
# the port, SIGTERM the old one (it closes its listening socket at once and
# exits once its clients have left, or after shutdown_timeout), and wait
# for it to exit. Prints the new usher's pid on stdout.
#
#   scripts/rolling_restart.sh --pid OLD_PID --config usher.yaml --port 6432 \
#       [--bin target/release/usher] [--log new.log] [--timeout 120]
#
# Linux: with `net.ipv4.tcp_migrate_req = 1` the kernel also hands
# connections still in their handshake to the new socket (docs/operations.md,
# "Running several instances").
set -euo pipefail

bin=usher log=/dev/null timeout=120 old="" config="" port=""
while [ $# -gt 0 ]; do
  case "$1" in
    --pid) old=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --log) log=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [ -z "$old" ] || [ -z "$config" ] || [ -z "$port" ]; then
  echo "usage: $0 --pid OLD_PID --config FILE --port PORT [--bin USHER] [--log FILE] [--timeout S]" >&2
  exit 2
fi

# alive PID: running (a zombie, exited but not yet waited for by its
# parent, is not).
alive() {
  local state
  state=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# listens PID PORT: whether PID itself holds a socket listening on PORT
# (not merely: something answers there, which the old one still does).
listens() {
  local hex inode
  hex=$(printf '%04X' "$2")
  for inode in $(awk -v p=":$hex" '$2 ~ p"$" && $4 == "0A" { print $10 }' /proc/net/tcp /proc/net/tcp6 2>/dev/null); do
    if ls -l "/proc/$1/fd" 2>/dev/null | grep -q "socket:\[$inode\]"; then return 0; fi
  done
  return 1
}

alive "$old" || { echo "no process $old" >&2; exit 1; }
grep -Eq '^so_reuseport:[[:space:]]*true' "$config" ||
  { echo "$config does not say so_reuseport: true: the new usher could not bind" >&2; exit 1; }

"$bin" --config "$config" </dev/null >/dev/null 2>>"$log" &
new=$!
for _ in $(seq 300); do
  if listens "$new" "$port"; then break; fi
  if ! alive "$new"; then
    echo "the new usher exited at start (see $log)" >&2; exit 1
  fi
  sleep 0.1
done
listens "$new" "$port" || { echo "the new usher does not listen on $port" >&2; kill "$new"; exit 1; }

kill -TERM "$old"
for _ in $(seq $((timeout * 10))); do
  alive "$old" || { echo "$new"; exit 0; }
  sleep 0.1
done
echo "the old usher ($old) is still running after ${timeout}s" >&2
echo "$new"
exit 1
