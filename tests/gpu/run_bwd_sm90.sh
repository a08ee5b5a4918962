#!/bin/bash
# SM90 attention backward on the H200, what the 2026-12-01 session left unrun (docs/attention_bwd.md):
# every main-kernel binary after fc3944e (setmaxnreg 24 / 240, d 64 column-outer loops), the opt-in spt
# order, varlen d 64, deterministic d 96, memcheck, and the d 128 / d 64 benchmark with the spt variant.
# The whole test file first (two halves), then what the first session never ran. Logs under ${OUT:-/tmp/out}.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T=tests/gpu/test_bwd_sm90.py
timeout 300 python -m pytest -q -s -p no:cacheprovider -W ignore $T -k "test_dense or fp16 or rows_without" \
  > "$OUT/pytest_a.log" 2>&1; echo "pytest a rc=$?" | tee -a "$OUT/pytest_a.log"; tail -2 "$OUT/pytest_a.log"
timeout 300 python -m pytest -q -s -p no:cacheprovider -W ignore $T -k "bitwise or nondeterministic or zero_queries or (varlen and 128) or varlen_d96" \
  > "$OUT/pytest_b.log" 2>&1; echo "pytest b rc=$?" | tee -a "$OUT/pytest_b.log"; tail -2 "$OUT/pytest_b.log"
timeout 400 python -m pytest -q -s -p no:cacheprovider -W ignore "$T::test_deterministic[96]" \
  "$T::test_dense[False-causal-64]" "$T::test_dense[True-none-64]" "$T::test_deterministic[64]" \
  "$T::test_fp16_softcap_dlse[64]" "$T::test_deterministic_spt" "$T::test_varlen_spt" \
  $(for m in none causal window; do for det in False True; do echo "$T::test_varlen[$det-$m-64]"; done; done) \
  > "$OUT/pytest_rest.log" 2>&1; echo "pytest rc=$?" | tee -a "$OUT/pytest_rest.log"; tail -3 "$OUT/pytest_rest.log"
timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python tests/gpu/_bwd_smoke.py 190 \
  "T.dense_case(1,200,333,4,2,128,causal=True,fa4=False,deterministic=True,spt=True)" \
  "T.dense_case(1,300,300,2,2,64,fa4=False)" > "$OUT/memcheck.log" 2>&1
grep -E "Invalid|ERROR SUMMARY" "$OUT/memcheck.log" | tail -3
timeout 400 python bench/bench_bwd.py --hdims 128,64 --window 0.3 --rounds 3 --markdown "$OUT/bench.md" \
  --json "$OUT/bench.json" 2>&1 | grep "^d "
