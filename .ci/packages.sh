#!/usr/bin/env bash
# Sourced by the set-up scripts (pgbouncer.sh, galera.sh, chromium.sh): `install_packages NAME..`
# installs system packages one install at a time on this machine. The tests run these scripts
# themselves, and two test binaries (or a test and .ci/run) may need a package at once, while
# dpkg allows one run at a time: each install first takes a lock of ours, and apt then waits
# for a dpkg lock held by anything else instead of failing.

install_packages() {
  if [ "$(id -u)" != 0 ]; then
    echo "error: installing $* needs root: run \`apt-get install -y $*\` as root, then the tests again" >&2
    return 1
  fi
  local lock="${SQLX_BROKER_INSTALL_LOCK:-/tmp/sqlx-broker-install.lock}"
  (
    if ! flock -w 1200 9; then
      echo "error: another install held $lock for 20 minutes; installing $* gave up" >&2
      exit 1
    fi
    local wait=(-o DPkg::Lock::Timeout=600)
    apt-get "${wait[@]}" update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get "${wait[@]}" install -y -qq "$@" >/dev/null
  ) 9>"$lock"
}
