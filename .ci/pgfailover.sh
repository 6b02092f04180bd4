#!/usr/bin/env bash
# Starts a PostgreSQL primary (127.0.0.1:5440) with a synchronous streaming standby
# (127.0.0.1:5441), two clusters of this machine's PostgreSQL in folders of their own, trust
# auth, database `test`; for broker-postgres's failover tests. `stop` stops both. Running it
# while a pair is up does nothing. After a test promoted the standby, running it again starts
# the pair afresh.
#
#   .ci/pgfailover.sh          # start (or keep) the pair
#   .ci/pgfailover.sh stop     # stop both
set -euo pipefail

DIR="${SQLX_BROKER_PGFAILOVER_DIR:-/tmp/sqlx-broker-pgfailover}"
BIN="/usr/lib/postgresql/$(ls /etc/postgresql | head -n 1)/bin"
PRIMARY=5440
STANDBY=5441

as_pg() { runuser -u postgres -- "$@"; }
ready() { pg_isready -q -h 127.0.0.1 -p "$1"; }
in_recovery() { psql -h 127.0.0.1 -p "$1" -U postgres -d postgres -tAc 'SELECT pg_is_in_recovery()' 2>/dev/null; }
stop() {
  for d in standby primary; do
    if [ -f "$DIR/$d/postmaster.pid" ]; then as_pg "$BIN/pg_ctl" -D "$DIR/$d" -m immediate stop >/dev/null 2>&1 || true; fi
  done
}

if [ "${1:-start}" = stop ]; then
  stop
  exit 0
fi

if ready $PRIMARY && ready $STANDBY && [ "$(in_recovery $PRIMARY)" = f ] && [ "$(in_recovery $STANDBY)" = t ]; then
  echo "PostgreSQL failover pair is up: primary $PRIMARY, standby $STANDBY"
  exit 0
fi

# Anything else (nothing running, a promoted standby, a dead primary): start afresh.
stop
rm -rf "$DIR"
mkdir -p "$DIR"
chown postgres "$DIR"
as_pg "$BIN/initdb" -D "$DIR/primary" -A trust -U postgres >"$DIR/initdb.log"
cat >>"$DIR/primary/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PRIMARY
unix_socket_directories = '$DIR'
wal_level = replica
max_wal_senders = 4
shared_buffers = 32MB
max_connections = 200
autovacuum = off
fsync = off
CONF
echo "host replication all 127.0.0.1/32 trust" >>"$DIR/primary/pg_hba.conf"
as_pg "$BIN/pg_ctl" -D "$DIR/primary" -l "$DIR/primary.log" -w start >/dev/null
psql -h 127.0.0.1 -p $PRIMARY -U postgres -d postgres -qc 'CREATE DATABASE test'
as_pg "$BIN/pg_basebackup" -h 127.0.0.1 -p $PRIMARY -U postgres -D "$DIR/standby" -R -X stream -c fast >/dev/null
sed -i "s/^port = $PRIMARY/port = $STANDBY/" "$DIR/standby/postgresql.conf"
as_pg "$BIN/pg_ctl" -D "$DIR/standby" -l "$DIR/standby.log" -w start >/dev/null
# Synchronous only once the standby runs (a commit would wait for it forever before).
psql -h 127.0.0.1 -p $PRIMARY -U postgres -d postgres -qc "ALTER SYSTEM SET synchronous_standby_names = '*'" -c 'SELECT pg_reload_conf()' >/dev/null
for _ in $(seq 1 30); do
  sync=$(psql -h 127.0.0.1 -p $PRIMARY -U postgres -d postgres -tAc "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")
  if [ "$sync" = 1 ]; then
    echo "PostgreSQL failover pair is up: primary $PRIMARY, synchronous standby $STANDBY"
    exit 0
  fi
  sleep 1
done
echo "error: the standby on $STANDBY did not become synchronous; see $DIR/*.log" >&2
exit 1
