"""The schemes TSP is compared with, on the same model and mesh code: "tp" (Megatron TP), "tp_sp"
(Megatron TP + sequence parallelism), "sp" (context parallelism, zigzag K/V all-gather) and
"tp_x_sp" (T x S = D on two sub-axes). Their builders (apply.py) are entries of the table of
schemes in parallel/schemes.py. Megatron vocabulary lives here, never in parallel/tsp."""

from tsp_trainer.parallel.baselines.apply import apply_baseline
from tsp_trainer.parallel.baselines.comm_model import expected_ledger_bytes
from tsp_trainer.parallel.baselines.layers import Groups

__all__ = ["Groups", "apply_baseline", "expected_ledger_bytes"]
