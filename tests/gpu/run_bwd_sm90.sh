#!/bin/bash
# SM90 attention backward on the H200: the wide schedule (head_dim 192 / 256 / (192, 128), never run on a
# GPU yet) in 4 parallel pytest processes (compile dominates) plus compute-sanitizer memcheck on two small
# wide cases, all at once; about 5 minutes. Logs under ${OUT:-/tmp/out}. A pass: "pytest N rc=0" for
# N = 1..4 and memcheck with no "Invalid" line (its error count is the DSL's host cuGetProcAddress probes).
# Of the d <= 128 kernels only the varlen ones changed since e825b63 (the epilogue re-reads cu_seqlens_k;
# the others are byte-identical .text), so P4 also reruns test_varlen d 64 / d 128; the whole d <= 128
# set: `pytest tests/gpu/test_bwd_sm90.py -k "d64 or d96 or d128"`.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T=tests/gpu/test_bwd_sm90.py
ids() {  # ids TEST PARAM...: node ids of a test with one parameter
  local test=$1; shift; for x in "$@"; do echo "$T::$test[$x]"; done
}
dense() { for g in False True; do for m in none causal window; do echo "$T::test_dense[$g-$m-$1]"; done; done; }
varlen() { for det in False True; do for m in none causal window; do echo "$T::test_varlen[$det-$m-$1]"; done; done; }
P1="$(dense d256) $(ids test_fp16_softcap_dlse d256) $(ids test_nondeterministic_differs d256) $(ids test_varlen_mha d256)"
P2="$(dense d192) $(ids test_fp16_softcap_dlse d192) $(ids test_rows_without_keys d256) $(ids test_zero_queries d256 d192-128) $(varlen d192 | head -3)"
P3="$(dense d192-128) $(ids test_fp16_softcap_dlse d192-128) $(ids test_rows_without_keys d192-128) $(varlen d192-128 | head -3)"
P4="$(ids test_deterministic d192 d256 d192-128) $(for d in d256 d192-128; do for m in none causal window; do echo "$T::test_deterministic_bitwise[$m-$d]"; done; done) $(varlen d192 | tail -3) $(varlen d192-128 | tail -3) $(varlen d64) $(varlen d128)"
i=0
for P in "$P1" "$P2" "$P3" "$P4"; do
  i=$((i + 1))
  ( timeout 340 python -m pytest -q -s -p no:cacheprovider -W ignore $P > "$OUT/pytest_$i.log" 2>&1
    echo "pytest $i rc=$?" >> "$OUT/pytest_$i.log" ) &
done
( timeout 330 compute-sanitizer --tool memcheck --print-limit 20 python tests/gpu/_bwd_smoke.py 300 \
    "T.dense_case(1,200,333,4,2,(256,256),causal=True,fa4=False,deterministic=True)" \
    "T._varlen_case([77,0,190],[130,33,64],4,2,(192,128),window=(50,10),deterministic=True)" \
    > "$OUT/memcheck.log" 2>&1 ) &
wait
for i in 1 2 3 4; do tail -2 "$OUT/pytest_$i.log"; done
grep -E "Invalid|ERROR SUMMARY|FAIL|ok |DONE" "$OUT/memcheck.log" | tail -6
