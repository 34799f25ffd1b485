#!/usr/bin/env bash
# The CPU runs behind docs/benchmarks.md: a small Llama-shaped model (h=256, 4 layers, 4 MHA heads,
# I=688 ~ 2.7h, V=2048 ~ 8h: Llama-2-7B's ratios) at long context, D=2 and D=4, every scheme.
# gloo on a 2-core machine: memory and bytes are exact; step times are indicative only.
# Usage: experiments/long_context_cpu.sh [phase ...]   (phases: sweep timed long ac hf; default all)
# Wall time on the shared 2-core machine of docs/benchmarks.md: sweep 3 min (1K-8K), timed 14 min,
# long 2.5 min, ac 2 min, hf 1 min. Phase long2 (D=2 at 16K) was not run for the docs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=docs/results/tsp_bench
MODEL="--model tiny --hidden 256 --layers 4 --heads 4 --kv-heads 4 --intermediate 688 --vocab 2048"
mkdir -p "$OUT"
run() {   # run NAME ARGS...: one tsp-bench invocation, JSON + PNG + table into docs/results/tsp_bench
  local name=$1; shift
  echo "=== $name: $*"
  $PY -W ignore -m tsp_trainer.bench.cli $MODEL "$@" --json "$OUT/$name.json" --plot "$OUT/$name.png" \
    | tee "$OUT/$name.txt"
}
phases=${*:-sweep timed long ac hf}
for phase in $phases; do
  case $phase in
    sweep)   # memory and bytes only (one step), D=4, short to long: where the curves cross
      for n in 1024 2048 4096 8192; do run "d4_s${n}_mem" --degree 4 --seq-len $n --steps 0 --no-hf; done ;;
    timed)   # 8K with a timed step and the transformers comparison
      run d2_s8192 --degree 2 --seq-len 8192 --schemes tsp,tp,tp_sp,sp --steps 1
      run d4_s8192 --degree 4 --seq-len 8192 --steps 1 --no-hf ;;
    long)    # 16K: memory and bytes only (one step per scheme)
      run d4_s16384_mem --degree 4 --seq-len 16384 --steps 0 --no-hf ;;
    long2)
      run d2_s16384_mem --degree 2 --seq-len 16384 --schemes tsp,tp,tp_sp,sp --steps 0 --no-hf ;;
    ac)      # every scheme with every block checkpointed: stored activations = block inputs only
      run d4_s4096_ac_mem --degree 4 --seq-len 4096 --steps 0 --no-hf --activation-checkpointing ;;
    hf)      # ours vs transformers, steps interleaved (one scheme only, to keep it short)
      run d2_s2048_hf --degree 2 --seq-len 2048 --schemes tp --steps 3 ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
