#!/usr/bin/env bash
# The memory runs behind docs/benchmarks.md's summary figure: a small Llama-shaped model (h=256,
# 4 layers, 4 MHA heads, I=688 ~ 2.7h, V=2048 ~ 8h: Llama-2-7B's ratios) at D=4, every scheme, 1K to
# 16K tokens, one step each: memory and bytes, which are exact (the step times of docs/benchmarks.md
# come from experiments/step_time_table.py's interleaved launches instead). sp with its weights
# replicated (--replicated-weights), the variant those tables show; sp and ulysses under ZeRO-3,
# as the trainer runs them: docs/benchmarks.md, "Ulysses beside the ALST stack".
# Usage: experiments/long_context_cpu.sh [phase ...]   (phases: sweep long ac; default all)
# Wall time on the shared 2-core machine of docs/benchmarks.md: sweep 3 min (1K-8K), long 2.5 min,
# ac 2 min.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=docs/results/tsp_bench
MODEL="--model tiny --hidden 256 --layers 4 --heads 4 --kv-heads 4 --intermediate 688 --vocab 2048"
mkdir -p "$OUT"
run() {   # run NAME ARGS...: one tsp-bench invocation, JSON + PNG + table into docs/results/tsp_bench
  local name=$1; shift
  echo "=== $name: $*"
  $PY -W ignore -m tsp_trainer.bench.cli $MODEL --replicated-weights "$@" --json "$OUT/$name.json" --plot "$OUT/$name.png" \
    | tee "$OUT/$name.txt"
}
phases=${*:-sweep long ac}
for phase in $phases; do
  case $phase in
    sweep)   # memory and bytes only (one step), D=4, short to long: where the curves cross
      for n in 1024 2048 4096 8192; do run "d4_s${n}_mem" --degree 4 --seq-len $n --steps 0 --no-hf; done ;;
    long)    # 16K: memory and bytes only (one step per scheme)
      run d4_s16384_mem --degree 4 --seq-len 16384 --steps 0 --no-hf ;;
    ac)      # every scheme with every block checkpointed: stored activations = block inputs only
      run d4_s4096_ac_mem --degree 4 --seq-len 4096 --steps 0 --no-hf --activation-checkpointing ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
