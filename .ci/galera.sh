#!/usr/bin/env bash
# Starts a three-node MariaDB Galera cluster on this machine, for the Galera tests: nodes on
# 127.0.0.1 ports 3311, 3312 and 3313 (group communication 4571-4573, state transfer 4581-4583
# and 4591-4593), each with its own data folder and a small buffer pool, root without a password
# and a `test` database. Installs galera-4 from the system packages if it is missing. Used by
# .ci/run; run it by hand before `cargo test -p broker-mysql --test galera`. Exits non-zero if the
# cluster does not reach three synced nodes.
#
#   .ci/galera.sh          # start the nodes that are down
#   .ci/galera.sh stop     # stop all three
set -euo pipefail
# shellcheck source=packages.sh
. "$(dirname "$0")/packages.sh"

DIR="${SQLX_BROKER_GALERA_DIR:-/tmp/sqlx-broker-galera}"
NODES=(1 2 3)
port() { echo $((3310 + $1)); }
addresses="gcomm://127.0.0.1:4571,127.0.0.1:4572,127.0.0.1:4573"

sql() { mariadb -h 127.0.0.1 -P "$(port "$1")" -u root --connect-timeout=2 -N -e "$2" 2>/dev/null; }
up() { sql "$1" 'SELECT 1' >/dev/null; }
synced() {
  [ "$(sql "$1" "SHOW STATUS LIKE 'wsrep_local_state_comment'" | cut -f2)" = Synced ] &&
    [ "$(sql "$1" "SHOW STATUS LIKE 'wsrep_cluster_size'" | cut -f2)" = 3 ]
}

stop_node() {
  local pid="$DIR/node$1/mariadbd.pid"
  if [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null; then
    for _ in $(seq 1 30); do kill -0 "$(cat "$pid")" 2>/dev/null || break; sleep 1; done
  fi
}

if [ "${1:-start}" = stop ]; then
  for n in 3 2 1; do stop_node "$n"; done
  exit 0
fi

if [ ! -e /usr/lib/galera/libgalera_smm.so ]; then
  echo "galera-4 is missing; installing it from the system packages"
  install_packages galera-4 rsync
fi

start_node() { # node, extra arguments
  local n=$1
  shift
  local d="$DIR/node$n"
  mkdir -p "$d"
  if [ ! -d "$d/data/mysql" ]; then
    mariadb-install-db --no-defaults --user=mysql --datadir="$d/data" \
      --auth-root-authentication-method=normal >"$d/install.log" 2>&1
  fi
  cat >"$d/my.cnf" <<CNF
[mariadbd]
datadir = $d/data
socket = $d/mariadbd.sock
pid-file = $d/mariadbd.pid
log-error = $d/error.log
port = $(port "$n")
bind-address = 127.0.0.1
user = mysql
innodb_buffer_pool_size = 64M
innodb_log_file_size = 32M
max_connections = 400
performance_schema = OFF
binlog_format = ROW
default_storage_engine = InnoDB
innodb_autoinc_lock_mode = 2
wsrep_on = ON
wsrep_provider = /usr/lib/galera/libgalera_smm.so
wsrep_cluster_name = sqlx_broker_ci
wsrep_cluster_address = $addresses
wsrep_node_name = node$n
wsrep_node_address = 127.0.0.1:$((4570 + n))
wsrep_provider_options = "gmcast.listen_addr=tcp://127.0.0.1:$((4570 + n));ist.recv_addr=127.0.0.1:$((4580 + n));gcache.size=64M"
wsrep_sst_receive_address = 127.0.0.1:$((4590 + n))
wsrep_sst_method = rsync
CNF
  chown -R mysql:mysql "$d"
  start-stop-daemon --start --background --chuid mysql --pidfile "$d/mariadbd.pid" --exec /usr/sbin/mariadbd -- \
    --defaults-file="$d/my.cnf" "$@"
}

# The position a node's own data reaches (`uuid:seqno`, from `mariadbd --wsrep-recover`), or
# nothing. A node killed without a clean shutdown has seqno -1 in grastate.dat; started with
# this position it rejoins by incremental state transfer (IST: the writes it missed, from a
# donor's gcache) instead of a full rsync SST, whose donor flushes and locks its tables for
# seconds (writes on that node, a broker's acks included, wait the while).
recovered_position() { # node
  local d="$DIR/node$1"
  [ -d "$d/data/mysql" ] || return 0
  rm -f "$d/recover.log"
  /usr/sbin/mariadbd --defaults-file="$d/my.cnf" --wsrep-recover --log-error="$d/recover.log" \
    >/dev/null 2>&1 || true
  sed -n 's/.*WSREP: Recovered position: *\([0-9a-f-]*:[0-9-]*\).*/\1/p' "$d/recover.log" | tail -n 1
}

wait_up() { # node
  for _ in $(seq 1 90); do
    if up "$1"; then return 0; fi
    sleep 1
  done
  echo "error: Galera node $1 did not come up; see $DIR/node$1/error.log" >&2
  tail -n 30 "$DIR/node$1/error.log" >&2 || true
  exit 1
}

any_up=false
for n in "${NODES[@]}"; do up "$n" && any_up=true; done
for n in "${NODES[@]}"; do
  if up "$n"; then continue; fi
  if [ "$any_up" = false ]; then
    # No node runs: the first one starts a new cluster (it must have the latest state; a CI
    # cluster is disposable, so its data folder is started afresh).
    rm -rf "$DIR/node$n/data"
    start_node "$n" --wsrep-new-cluster
    any_up=true
  else
    position=$(recovered_position "$n")
    case "$position" in
      *:-1 | "") start_node "$n" ;;
      *) start_node "$n" --wsrep-start-position="$position" ;;
    esac
  fi
  wait_up "$n"
done

for _ in $(seq 1 90); do
  if synced 1 && synced 2 && synced 3; then
    sql 1 'CREATE DATABASE IF NOT EXISTS test'
    echo "Galera is up: 3 synced nodes on ports $(port 1), $(port 2), $(port 3)"
    exit 0
  fi
  sleep 1
done
echo "error: the Galera cluster did not reach 3 synced nodes; see $DIR/node*/error.log" >&2
exit 1
