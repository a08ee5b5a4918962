#!/usr/bin/env bash
# Every benchmark with the bench/_timing.py method (own >= 0.5 s window per variant, launches queued
# back to back, L2 flushed between repetitions, 3 alternating rounds, host cost as its own column),
# on the shapes docs/benchmarks.md and README.md quote. Estimated (not yet run) on an H200: fwd + gqa +
# unfused about 5 minutes, indexed + select + h2o about 4-5; for a 10-minute limit per command run the
# two halves as two calls:
#
#   bench/run_all.sh                    # every default step
#   bench/run_all.sh fwd gqa unfused    # first half
#   bench/run_all.sh indexed select h2o # second half
#   bench/run_all.sh rho05 bwd          # opt-in steps (indexed at rho 0.5; the attention backward)
#   bench/run_all.sh bwd_wide layer bsparse   # opt-in: d 192 / 256 backward, the full layer, block-sparse
#   OUT=/tmp/b PYTHON=.venv/bin/python WINDOW=0.5 ROUNDS=3 bench/run_all.sh
#
# Writes $OUT/<step>.json, $OUT/<step>.md, $OUT/<step>.log, $OUT/summary.md (all markdown
# tables concatenated, with each step's wall time) and $OUT/benchmarks.png (bench/plot.py over the
# forward, backward and block-sparse steps' JSON). Extra flags for every step: EXTRA="--graph".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
PYTHON=${PYTHON:-python}
WINDOW=${WINDOW:-0.5}
ROUNDS=${ROUNDS:-3}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
: > "$OUT/summary.log"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(fwd gqa unfused indexed select h2o)
common="--window $WINDOW --rounds $ROUNDS $EXTRA"
status=0

run_step() {  # name, script, args...
    local name=$1 script=$2
    shift 2
    local t0=$SECONDS
    echo "== $name: $PYTHON bench/$script $* $common" | tee -a "$OUT/summary.log"
    # shellcheck disable=SC2086
    if "$PYTHON" "bench/$script" "$@" $common --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
        > "$OUT/$name.log" 2>&1; then
        echo "   done in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
    else
        echo "   FAILED (rc $?) after $((SECONDS - t0)) s; tail of $OUT/$name.log:" | tee -a "$OUT/summary.log"
        tail -n 20 "$OUT/$name.log" | tee -a "$OUT/summary.log"
        status=1
    fi
}

for step in "${steps[@]}"; do
    case $step in
        # docs/benchmarks.md forward table: bf16, 16 heads, 32K tokens, block 64; d 128 at every S,
        # d 64 / 256 at 2K and 8K (the rows docs/benchmarks.md and README quote)
        fwd) run_step fwd128 bench_fwd.py --hdims 128 --seqlens 2048,4096,8192,16384
             run_step fwd64_256 bench_fwd.py --hdims 64,256 --seqlens 2048,8192 ;;
        # GQA 32/8 at d 128 (issue 17's targets)
        gqa) run_step fwd_gqa bench_fwd.py --hdims 128 --heads 32 --heads-kv 8 --seqlens 2048,8192,16384 ;;
        # ours+bl against FA4 + a separate block-max pass (README's "faster than the unfused path")
        unfused) run_step fwd_unfused bench_fwd.py --hdims 128 --seqlens 2048,16384 --variants ours_bl,unfused \
                     --host-n 0 ;;
        # indexed attention, production layer, rho 0.9 (README), all five shapes, baseline at Lq <= 16K
        indexed) run_step indexed bench_indexed.py --rhos 0.9 ;;
        rho05) run_step indexed_rho05 bench_indexed.py --rhos 0.5 --baseline-max 0 --host-n 0 ;;
        # selection: 8K..128K, forward anchors at 8K / 32K / 128K
        select) run_step select bench_select.py ;;
        # H2O decode ops, every shape of the docs table
        h2o) run_step h2o bench_h2o.py ;;
        # the attention backward vs FA4's (bench_bwd.py's own default shapes; about 4 minutes)
        bwd) run_step bwd bench_bwd.py ;;
        # the wide backward schedules README quotes (d 192, d 256; MHA 16 heads, 8K / 16K)
        bwd_wide) run_step bwd_wide bench_bwd.py --hdims 192,256 --seqlens 8192,16384 --heads 16 --host-n 0 ;;
        # one training step of the full layer (forward with block_logit + backward) vs FA4 fwd + bwd
        layer) run_step layer bench_layer.py --seqlens 16384 ;;
        # block-sparse attention (issue 20): GQA 32/4 local selection at 16K-64K, MQA 64 heads at 16K
        bsparse) run_step bsparse_gqa bench_block_sparse.py --seqlens 16K,32K,64K --selections local --shapes gqa
                 run_step bsparse_mqa bench_block_sparse.py --seqlens 16K --selections local,random --shapes mqa64 ;;
        *) echo "unknown step $step (fwd gqa unfused indexed rho05 select h2o bwd bwd_wide layer bsparse)"; status=1 ;;
    esac
done

{
    echo "# Benchmarks ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD))"
    echo
    cat "$OUT/summary.log"
    for f in "$OUT"/*.md; do
        [ "$f" = "$OUT/summary.md" ] && continue
        echo
        cat "$f"
    done
} > "$OUT/summary.md"

# ours / anchor per shape of this run's forward, backward and block-sparse steps (bench/plot.py; needs matplotlib)
plots=()
for f in "$OUT"/fwd*.json "$OUT"/bwd*.json "$OUT"/bsparse*.json; do
    [ -e "$f" ] && [ "$f" != "$OUT/fwd_unfused.json" ] && plots+=("$f")
done
if [ ${#plots[@]} -gt 0 ]; then
    "$PYTHON" bench/plot.py --no-figures "${plots[@]}" --out "$OUT/benchmarks.png" >> "$OUT/summary.log" 2>&1 \
        || echo "plot skipped (bench/plot.py failed; matplotlib installed?)" | tee -a "$OUT/summary.log"
fi
exit $status
