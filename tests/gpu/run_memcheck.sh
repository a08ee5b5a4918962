#!/bin/bash
# compute-sanitizer memcheck over the GPU suite's small "memcheck" cases (decode, FlashMask, block-sparse,
# indexed). Passes when every group's pytest passes and no memcheck report names a device access ("Invalid ...",
# "out of bounds", "misaligned"); the CUDA-API errors it counts come from the DSL's host cuGetProcAddress probes.
#   bash tests/gpu/run_memcheck.sh            (logs in ${OUT:-/tmp/out}/memcheck_*.log)
#   MEMCHECK_GROUPS="decode flashmask" bash tests/gpu/run_memcheck.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rc=0
run() {
  local name=$1; shift
  local log="$OUT/memcheck_$name.log"
  timeout "${MEMCHECK_TIMEOUT:-300}" compute-sanitizer --tool memcheck --print-limit 50 \
    python -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
  local prc=$?
  local bad
  bad=$(grep -ciE "Invalid (__global__|__shared__|__local__)|out of bounds|misaligned address" "$log")
  echo "memcheck $name: pytest rc=$prc, device access errors: $bad ($(grep -E ' passed| failed' "$log" | tail -n 1))"
  [ "$prc" = 0 ] && [ "$bad" = 0 ] || rc=1
}
# the groups run at once (compiling dominates; each reports its own line)
names=(decode flashmask block_sparse indexed)
files=(tests/gpu/test_decode.py tests/gpu/test_flashmask.py tests/gpu/test_block_sparse.py tests/gpu/test_indexed.py)
for i in "${!names[@]}"; do
  case " ${MEMCHECK_GROUPS:-${names[*]}} " in *" ${names[$i]} "*) ;; *) continue ;; esac
  ( run "${names[$i]}" "${files[$i]}" -k memcheck; echo $rc > "$OUT/memcheck_${names[$i]}.rc" ) &
done
wait
for f in "$OUT"/memcheck_*.rc; do [ "$(cat "$f")" = 0 ] || rc=1; rm -f "$f"; done
exit $rc
