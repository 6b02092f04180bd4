#!/usr/bin/env bash
# Chromium and chromedriver for the dashboard's browser tests (broker-web/tests/browser.rs),
# installed from the system packages if missing. Used by .ci/run, and run by the browser tests
# themselves when either is missing. Exits non-zero if either cannot be installed or does not
# run: the browser tests fail, not skip, without them.
set -euo pipefail
# shellcheck source=packages.sh
. "$(dirname "$0")/packages.sh"

CHROMIUM="${SQLX_BROKER_CHROMIUM:-/usr/bin/chromium}"
DRIVER="${SQLX_BROKER_CHROMEDRIVER:-/usr/bin/chromedriver}"

if [ ! -x "$CHROMIUM" ] || [ ! -x "$DRIVER" ]; then
  echo "Chromium or chromedriver is missing; installing them from the system packages"
  install_packages chromium chromium-driver
fi
for bin in "$CHROMIUM" "$DRIVER"; do
  if [ ! -x "$bin" ]; then
    echo "error: $bin is still missing after apt-get install chromium chromium-driver" >&2
    exit 1
  fi
done
"$DRIVER" --version
# The browser itself, as the tests start it (root, no sandbox, no network of its own).
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
if ! timeout 60 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --dump-dom 'data:text/html,<p>ok</p>' 2>/dev/null | grep -q '<p>ok</p>'; then
  echo "error: $CHROMIUM does not render a page headless" >&2
  exit 1
fi
echo "Chromium renders headless"
