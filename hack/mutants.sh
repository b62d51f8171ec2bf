#!/usr/bin/env bash
# hack/mutants.sh [hack/mutants/NN-name.patch ...]
#
# The IPAM mutation table (docs/ipam.md#mutation-table): each realistic bug
# in hack/mutants/ is applied alone to a temporary copy of the tracked
# files, the ipalloc tests run against it (as make test runs them: the
# package, then the 1500 simulation schedules), and one line says which
# tests caught it, or that it SURVIVED (a missing test). The work tree is
# never touched. Exit status 1 if any mutant survived or did not apply.
#
#   MUTANT_FLAGS   extra go test flags (default: none)
#   SIM_SCHEDULES  schedules of the second run (default 1500, as make test)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PATH=/usr/local/go/bin:$PATH
GO=${GO:-go}
SIM_SCHEDULES=${SIM_SCHEDULES:-1500}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ $# -gt 0 ]; then patches=("$@"); else patches=("$root"/hack/mutants/*.patch); fi
bad=0
printf '%-40s %s\n' "mutant" "caught by"
for p in "${patches[@]}"; do
	name=$(basename "$p" .patch)
	rm -rf "$tmp/src" && mkdir "$tmp/src"
	(cd "$root" && git ls-files -z | xargs -0 cp --parents -t "$tmp/src")
	if ! (cd "$tmp/src" && patch -s -p1 <"$p" >/dev/null); then
		printf '%-40s %s\n' "$name" "DOES NOT APPLY"
		bad=1
		continue
	fi
	out=$(cd "$tmp/src" && "$GO" test -count=1 -failfast -timeout 20m ${MUTANT_FLAGS:-} ./ipalloc 2>&1) || true
	if grep -q '^FAIL.*\[build failed\]\|^# github.com' <<<"$out"; then
		printf '%-40s %s\n' "$name" "DOES NOT BUILD"
		bad=1
		continue
	fi
	caught=$(grep -oE -- '--- FAIL: [A-Za-z0-9_]+' <<<"$out" | sed 's/--- FAIL: //' | sort -u | paste -sd, - || true)
	if [ -z "$caught" ]; then
		out=$(cd "$tmp/src" && "$GO" test -count=1 -timeout 60m -run '^TestSimulation$' ./ipalloc -ipalloc.sim.schedules="$SIM_SCHEDULES" 2>&1) || true
		grep -q -- '--- FAIL: TestSimulation' <<<"$out" && caught="TestSimulation (only in $SIM_SCHEDULES schedules)"
	fi
	if [ -z "$caught" ]; then
		caught="SURVIVED"
		bad=1
	fi
	seed=$(grep -oE 'seed [0-9]+: step [0-9]+' <<<"$out" | head -1 || true)
	printf '%-40s %s%s\n' "$name" "$caught" "${seed:+ ($seed)}"
done
exit $bad
