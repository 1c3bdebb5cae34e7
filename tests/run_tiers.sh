#!/usr/bin/env bash
# `make test` with no PYTEST_ARGS: the whole suite as its two tiers at once (docs/testing.md).
#
# The slow tier (torchrun launches, subprocesses) keeps about 1.5 of this machine's 2 cores busy on
# average: rank start-up, rendezvous and timeouts leave the rest idle. The pure tier (one process, no
# launches, `-m "not slow"`) fills that idle core beside it instead of running before or after it. Each
# tier is an ordinary pytest session with its own temporary directory; the pure tier's output is kept
# and printed once the slow tier ends, and the exit status is non-zero if either tier failed.
set -u      # arguments (test paths, -k ...) go to both tiers
PY=${PY:-python}
# TIERS_RUNNER=coverage: each tier under `coverage run` (tests/run_coverage.sh, `make coverage`)
if [ "${TIERS_RUNNER:-}" = coverage ]; then run=("$PY" -m coverage run -m pytest); else run=("$PY" -m pytest); fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${run[@]}" -q -rs -m "not slow" -p no:cacheprovider --basetemp="$tmp/pure" "$@" >"$tmp/pure.log" 2>&1 &
pure=$!
"${run[@]}" -q -rs -m slow "$@"
slow=$?
wait "$pure"
rc_pure=$?
echo
echo "================ pure tier (pytest -m 'not slow', ran beside the slow tier) ================"
cat "$tmp/pure.log"
echo "tiers: slow exit $slow, pure exit $rc_pure"
[ "$slow" -eq 0 ] && [ "$rc_pure" -eq 0 ]
