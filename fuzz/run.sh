#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for MINUTES minutes each and
# prints the executions per target.
#
#   fuzz/run.sh            # 1 minute per target
#   fuzz/run.sh 5          # 5 minutes per target
#   fuzz/run.sh 2 path_normalize route_match
#
# Environment:
#   FUZZ_SANITIZER=address|none   (default address; `none` builds faster and
#                                  runs ~2x more executions; the code under
#                                  test is safe Rust either way)
#   FUZZ_CMIN=1                   minimize fuzz/corpus/<target> afterwards
#                                  (`cargo fuzz cmin`)
#
# Only stable rustc is needed: cargo-fuzz passes nightly `-Z` flags, which
# RUSTC_BOOTSTRAP=1 lets stable rustc accept. Needs `cargo install cargo-fuzz`.
# New inputs go to fuzz/corpus/<target> (fuzz/seeds/<target> is read too);
# a crash or failed property leaves its input in fuzz/artifacts/<target>/.
set -uo pipefail

cd "$(dirname "$0")"
minutes=${1:-1}
shift || true
case $minutes in
'' | *[!0-9]*)
	echo "usage: fuzz/run.sh [MINUTES] [TARGET...]" >&2
	exit 2
	;;
esac
export RUSTC_BOOTSTRAP=1
sanitizer=${FUZZ_SANITIZER:-address}

if [ $# -gt 0 ]; then
	targets=("$@")
else
	mapfile -t targets < <(cargo fuzz list)
fi

mkdir -p logs
echo "== building (sanitizer: $sanitizer; log: fuzz/logs/build.log)"
if ! cargo fuzz build --sanitizer "$sanitizer" >logs/build.log 2>&1; then
	tail -30 logs/build.log
	exit 1
fi
failed=()
declare -A execs rate result
for t in "${targets[@]}"; do
	mkdir -p "corpus/$t" "seeds/$t"
	echo "== $t: ${minutes} min (sanitizer: $sanitizer)"
	cargo fuzz run --sanitizer "$sanitizer" "$t" "corpus/$t" "seeds/$t" -- \
		-max_total_time=$((minutes * 60)) -print_final_stats=1 \
		>"logs/$t.log" 2>&1
	rc=$?
	execs[$t]=$(sed -n 's/^stat::number_of_executed_units: *//p' "logs/$t.log" | tail -1)
	rate[$t]=$(sed -n 's/^stat::average_exec_per_sec: *//p' "logs/$t.log" | tail -1)
	if [ $rc -eq 0 ]; then
		result[$t]=ok
	else
		result[$t]="FAILED (rc $rc, see fuzz/logs/$t.log and fuzz/artifacts/$t/)"
		failed+=("$t")
		grep -m1 -E 'panicked at|ERROR: libFuzzer|SUMMARY' "logs/$t.log" || true
	fi
	if [ "${FUZZ_CMIN:-0}" = 1 ]; then
		cargo fuzz cmin --sanitizer "$sanitizer" "$t" "corpus/$t" >>"logs/$t.log" 2>&1
	fi
done

echo
printf '%-16s %12s %10s  %s\n' target executions exec/s result
for t in "${targets[@]}"; do
	printf '%-16s %12s %10s  %s\n' "$t" "${execs[$t]:-?}" "${rate[$t]:-?}" "${result[$t]}"
done
[ ${#failed[@]} -eq 0 ]
