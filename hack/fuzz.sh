#!/usr/bin/env bash
# Runs every fuzz target of the module for FUZZTIME each (a duration, or Nx
# executions). A target fails only on a reproducible finding: when Go's fuzz
# coordinator reports a failure whose written input passes when run again
# (a worker that hung or died while minimising, golang/go#75804 and kin), the
# input is removed and the target is run once more; a second failure fails.
set -uo pipefail
GO=${GO:-go}
FUZZTIME=${FUZZTIME:-30s}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run_target() { # pkg target -> 0 ok, 1 real failure, 2 flake (input removed)
	local pkg=$1 f=$2
	if $GO test -run '^$' -fuzz "^$f\$" -fuzztime "$FUZZTIME" "$pkg" >"$log" 2>&1; then
		return 0
	fi
	local input
	input=$(sed -n 's/.*Failing input written to \(testdata\/fuzz\/[^ ]*\).*/\1/p' "$log" | head -1)
	local dir
	dir=$($GO list -f '{{.Dir}}' "$pkg")
	if [ -n "$input" ] && [ -f "$dir/$input" ]; then
		local id=${input#testdata/fuzz/}
		if $GO test -run "^${id%%/*}\$/^${id#*/}\$" "$pkg" >/dev/null 2>&1; then
			echo "  $f: the coordinator failed, but its input $input passes when run again: a flake of the fuzzer, not a finding; removed it, retrying"
			rm -f "$dir/$input"
			return 2
		fi
		return 1
	fi
	if grep -q "context deadline exceeded" "$log" && ! grep -q "panic:\|--- FAIL: $f/" "$log"; then
		echo "  $f: the coordinator stopped with 'context deadline exceeded' and no input: a flake of the fuzzer; retrying"
		return 2
	fi
	return 1
}

status=0
for pkg in $($GO list ./...); do
	for f in $($GO test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz'); do
		echo "fuzz $pkg $f ($FUZZTIME)"
		run_target "$pkg" "$f"
		rc=$?
		if [ $rc -eq 2 ]; then
			run_target "$pkg" "$f"
			rc=$?
		fi
		if [ $rc -ne 0 ]; then
			cat "$log"
			echo "fuzz: $pkg $f failed (a reproducible input, if any, is under testdata/fuzz/$f)"
			status=1
			break 2
		fi
	done
done
exit $status
