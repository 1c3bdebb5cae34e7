#!/usr/bin/env bash
# `make coverage`: the whole suite's two tiers under coverage, every process they start included
# (torchrun's agents and ranks, CLI subprocesses), then one combined report of modelpar/
# (docs/testing.md "Coverage"; the settings are pyproject.toml's [tool.coverage.*]).
#
# The tiers run side by side through `tests/run_tiers.sh` (TIERS_RUNNER=coverage). Each process writes its own data file
# `.coverage.<host>.<pid>.<random>` next to $COVERAGE_FILE (the repository root: tests run CLI
# subprocesses in temporary folders); `coverage combine` merges them. Per-test timeouts are raised to
# 900 s: measuring slows the suite down. The exit status is non-zero if either tier failed; the report
# is written either way (`coverage-report/`: report.txt, and html/ for reading line by line).
set -u
PY=${PY:-python}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export COVERAGE_FILE="$root/.coverage"
rm -f .coverage .coverage.*
TIERS_RUNNER=coverage PY="$PY" bash "$root/tests/run_tiers.sh" -o timeout=900 "$@"
rc=$?
"$PY" -m coverage combine -q
mkdir -p coverage-report
"$PY" -m coverage report >coverage-report/report.txt
"$PY" -m coverage html -q -d coverage-report/html
grep "^TOTAL" coverage-report/report.txt
exit $rc
