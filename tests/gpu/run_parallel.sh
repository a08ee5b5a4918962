#!/bin/bash
# Run several pytest groups of the GPU suite at once on the lent GPU machine (compiling dominates a GPU
# test run and is single-threaded per process; the machine has 16 cores). Each argument is one group:
# a quoted pytest argument string. Logs: ${OUT:-/tmp/out}/gN.log, one summary line per group at the end.
#   bash tests/gpu/run_parallel.sh "tests/gpu/test_decode.py" "tests/gpu/test_h2o.py -k 'select or reset'"
# GROUP_TIMEOUT (seconds, default 270) bounds each group; a group cut off says so.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
limit=${GROUP_TIMEOUT:-270}
i=0
for group in "$@"; do
  i=$((i + 1))
  # eval: a group may quote its own arguments (-k "a or b")
  ( eval "timeout $limit python -m pytest -q -rfE -p no:cacheprovider $group" > "$OUT/g$i.log" 2>&1
    echo "group $i rc=$? ($group)" >> "$OUT/g$i.log" ) &
done
wait
for f in "$OUT"/g*.log; do
  echo "== $f: $(grep -E ' in [0-9.]+s' "$f" | tail -n 1)"
  grep -E '^(FAILED|ERROR)' "$f" | head -n 8
  tail -n 1 "$f"
done
