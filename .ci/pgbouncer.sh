#!/usr/bin/env bash
# Starts PgBouncer 127.0.0.1:6432 in transaction mode in front of the local PostgreSQL (every
# database, trust auth), installing it from the system packages if it is missing. Used by
# .ci/run, and run by the PgBouncer tests themselves when nothing answers on the port. Exits
# non-zero if PgBouncer does not come up.
set -euo pipefail
# shellcheck source=packages.sh
. "$(dirname "$0")/packages.sh"

PORT="${SQLX_BROKER_PGBOUNCER_PORT:-6432}"
DIR="${SQLX_BROKER_PGBOUNCER_DIR:-/tmp/sqlx-broker-pgbouncer}"

up() { pg_isready -q -h 127.0.0.1 -p "$PORT"; }

if up; then
  echo "PgBouncer is up on $PORT"
  exit 0
fi
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
  echo "PgBouncer is missing; installing it from the system packages"
  install_packages pgbouncer
fi
mkdir -p "$DIR"
cat >"$DIR/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PORT
unix_socket_dir =
auth_type = trust
auth_file = $DIR/userlist.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 20
logfile = $DIR/pgbouncer.log
pidfile = $DIR/pgbouncer.pid
ignore_startup_parameters = extra_float_digits
INI
echo '"postgres" ""' >"$DIR/userlist.txt"
chown -R postgres "$DIR"
# PgBouncer refuses to run as root; -u drops to the postgres user.
/usr/sbin/pgbouncer -d -u postgres "$DIR/pgbouncer.ini"
for _ in $(seq 1 30); do
  if up; then echo "PgBouncer is up on $PORT (transaction mode)"; exit 0; fi
  sleep 1
done
echo "error: PgBouncer did not come up on $PORT; see $DIR/pgbouncer.log" >&2
exit 1
