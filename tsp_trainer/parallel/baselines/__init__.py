"""The schemes TSP is compared with (DESIGN.md section 4), on the same model and mesh code:
"tp" (Megatron TP), "tp_sp" (Megatron TP + sequence parallelism), "sp" (context parallelism,
zigzag K/V all-gather) and "tp_x_sp" (T x S = D on two sub-axes). Importing this package registers
them in parallel.schemes.SCHEMES. Megatron vocabulary lives here, never in parallel/tsp."""

from tsp_trainer.parallel.baselines.apply import (apply_baseline, build_sp, build_tp, build_tp_sp,
                                                  build_tp_x_sp)
from tsp_trainer.parallel.baselines.comm_model import expected_ledger_bytes
from tsp_trainer.parallel.baselines.layers import Groups
from tsp_trainer.parallel.schemes import SCHEMES

BASELINE_SCHEMES = {"tp": build_tp, "tp_sp": build_tp_sp, "sp": build_sp, "tp_x_sp": build_tp_x_sp}
SCHEMES.update(BASELINE_SCHEMES)

__all__ = ["BASELINE_SCHEMES", "Groups", "apply_baseline", "expected_ledger_bytes"]
