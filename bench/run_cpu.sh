#!/usr/bin/env bash
# Runs the CPU microbenchmarks (bench/bin/*_bench, built by bench/build.sh; the GPU ones
# run from bench/gpu_check.sh) and writes their tables, each binary's exit code, the
# command, commit, machine and load average before/after into one Markdown file.
#
#   bash bench/run_cpu.sh                       # make bench: writes bench/results/cpu.md
#   bash bench/run_cpu.sh --quick --out FILE    # tiny sizes (CI: checks the plumbing)
#
# Exit status: 0 when every binary ran (its exit 0, or 3: a missed speed target is a
# result, and the file says so); 1 when one failed (its exit 1, a crash, or a missing
# binary); the file is written either way.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=bench/results/cpu.md
quick=()
while (($#)); do
  case $1 in
    --quick) quick=(--quick) ;;
    --out) out=${2:?--out needs a file}; shift ;;
    *) echo "usage: bash bench/run_cpu.sh [--quick] [--out FILE] (got '$1')" >&2; exit 1 ;;
  esac
  shift
done
mkdir -p "$(dirname "$out")"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}

meaning() {  # the exit-code contract of bench_util.h
  case $1 in
    0) echo "ran, results within tolerance, speed targets met or not judged" ;;
    1) echo "FAILED: bad arguments, an exception, or a result over its error tolerance" ;;
    3) echo "ran, results within tolerance, a speed target MISSED" ;;
    *) echo "FAILED: crashed or killed" ;;
  esac
}

load_before=$($PY bench/provenance.py load)
body=$(mktemp)
summary=$(mktemp)
output=$(mktemp)
trap 'rm -f "$body" "$summary" "$output"' EXIT
failed=0
# run TITLE BINARY: its output (stdout and stderr) and exit code into the body; its exit
# code and target verdicts (its lines starting with "- ") into the summary.
run() {
  local rc
  if [[ -x bench/bin/$2 ]]; then
    bench/bin/"$2" "${quick[@]}" > "$output" 2>&1
    rc=$?
  else
    echo "bench/bin/$2 is missing: build it first (bash bench/build.sh)" > "$output"
    rc=1
  fi
  cat "$output"
  { echo "## $1"; echo; cat "$output"; echo
    echo "Exit code of \`bench/bin/$2${quick:+ --quick}\`: $rc ($(meaning "$rc"))."; echo; } >> "$body"
  { echo "- $1 (\`$2\`): exit $rc, $(meaning "$rc")"; grep '^- ' "$output" | sed 's/^/  /'; } >> "$summary"
  [[ $rc == 0 || $rc == 3 ]] || failed=1
}
run "Masked linear, forward + backward (fp32)" masked_linear_bench
run "pack_segments + unpack_average_ (fp32)" pack_segments_bench
load_after=$($PY bench/provenance.py load)

command="make bench"
((${#quick[@]})) && command="bash bench/run_cpu.sh --quick --out $out"
{
  echo "# CPU microbenchmarks"
  echo
  echo "Command: \`$command\` (bash bench/build.sh && bash bench/run_cpu.sh), $(date -u +%Y-%m-%dT%H:%MZ)," \
       "commit $($PY bench/provenance.py commit)."
  echo "Machine: $($PY bench/provenance.py machine), OMP_NUM_THREADS=$OMP_NUM_THREADS." \
       "Load average (1, 5, 15 min): $load_before before, $load_after after."
  echo
  echo "Verdicts (each binary's exit code and targets; tables below):"
  echo
  cat "$summary"
  echo
  cat "$body"
} > "$out"
echo "wrote $out"
exit $failed
