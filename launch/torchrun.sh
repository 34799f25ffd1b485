#!/usr/bin/env bash
# torchrun launcher, single or multi node.
#   launch/torchrun.sh recipes/tiny_cpu.yaml                       # 4 CPU processes, this machine
#   NPROC=8 launch/torchrun.sh recipes/7b_128k_8gpu.yaml          # one 8-GPU node
#   NNODES=128 NODE_RANK=$i MASTER_ADDR=host0 NPROC=8 launch/torchrun.sh recipes/7b_128k_1024gpu.yaml
# Extra arguments are dotlist overrides: launch/torchrun.sh recipes/tiny_cpu.yaml train.steps=10
set -euo pipefail
recipe=${1:?usage: launch/torchrun.sh RECIPE [key=value ...]}; shift
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
if ! "$python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR=cpu
fi
# The recipe and its inputs, checked once per node here (bad input: one line, exit 2, before any
# rank starts); node 0's rank 0 verifies a resume checkpoint and takes the folder's lease.
world=$(( ${NNODES:-1} * ${NPROC:-4} ))
first_rank=$(( ${NODE_RANK:-0} * ${NPROC:-4} ))
"$python" -m tsp_trainer check --world-size "$world" --first-rank "$first_rank" "$recipe" "$@"
# One node and no MASTER_ADDR: port 0 (a free one), so two jobs on one machine do not collide.
# Several nodes must all name the same endpoint: MASTER_ADDR and MASTER_PORT (default 29500).
if [ "${NNODES:-1}" = 1 ] && [ -z "${MASTER_ADDR:-}" ]; then default_port=0; else default_port=29500; fi
exec "$python" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "${NPROC:-4}" \
  --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-$default_port}" \
  --rdzv_id "${RDZV_ID:-tsp_trainer}" \
  -m tsp_trainer train "$recipe" "$@"
