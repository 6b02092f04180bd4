#!/usr/bin/env bash
# Mutation testing: cargo-mutants changes one thing at a time in the statement builders (and, with
# `core`, the core's settle and claim paths) and runs the SQLite conformance suite against each
# change; a change no test notices is a "missed" mutant. Too slow for every CI run (the time,
# the score and every missed mutant with why it survives are in docs/mutants.md); run it after
# changing a statement, and update docs/mutants.md with what it prints.
#
#   scripts/mutants.sh            # SQLite statement builders: sql.rs, lease.rs, advisory.rs, fifo.rs
#   scripts/mutants.sh core       # broker-core's delivery settlement, renewal and claim paths
#   scripts/mutants.sh all        # both
#
# Results land in target/mutants/<scope>/mutants.out (caught.txt, missed.txt, timeout.txt,
# unviable.txt). The stress runs are skipped: they take a minute each per mutant and every
# guarantee they check has a focused case.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo-mutants >/dev/null 2>&1; then
    cargo install cargo-mutants --locked
fi

scope=${1:-sqlite}
sqlite=(-f broker-sqlite/src/sql.rs -f broker-sqlite/src/lease.rs
    -f broker-sqlite/src/advisory.rs -f broker-sqlite/src/fifo.rs)
# The settle, renew and claim paths of the core; its builders and accessors are left out.
core=(-f broker-core/src/delivery.rs -f broker-core/src/broker.rs
    -F 'settle|from_claim|renew_lease|retry_or_dead|held_attempt|claim')
case "$scope" in
    sqlite) files=("${sqlite[@]}") ;;
    core) files=("${core[@]}") ;;
    all) files=("${sqlite[@]}" "${core[@]}") ;;
    *)
        echo "usage: $0 [sqlite|core|all]" >&2
        exit 2
        ;;
esac

mkdir -p "target/mutants/$scope"
start=$(date +%s)
status=0
# No baseline run: cargo-mutants runs the unmutated tree against the tests of the mutated
# packages, not --test-package's, and broker-core has no conformance test. The SQLite suite
# (with broker-sqlite's unit tests) runs on 6 test threads, about 45 s on a quiet machine: its
# cases wait on the database far more than they compute, and each has its own file. A mutant
# whose suite runs past the timeout (a wait that never ends) counts as a timeout, which is
# caught.
cargo mutants "${files[@]}" \
    --test-package broker-sqlite \
    --jobs 1 \
    --no-shuffle \
    --baseline skip \
    --timeout "${MUTANTS_TIMEOUT:-300}" \
    --output "target/mutants/$scope" \
    -- --lib --test conformance -- --skip stress --test-threads "${MUTANTS_TEST_THREADS:-6}" ||
    status=$?
end=$(date +%s)
out="target/mutants/$scope/mutants.out"
count() { [ -f "$out/$1" ] && wc -l <"$out/$1" || echo 0; }
caught=$(count caught.txt)
missed=$(count missed.txt)
timeout=$(count timeout.txt)
unviable=$(count unviable.txt)
echo "mutants ($scope): caught $caught, missed $missed, timeout $timeout, unviable $unviable, in $(((end - start) / 60)) min"
if [ "$missed" -gt 0 ]; then
    echo "missed:"
    cat "$out/missed.txt"
fi
# cargo-mutants exits 2 when a mutant was missed, 3 on a timeout: pass that on.
exit "$status"
