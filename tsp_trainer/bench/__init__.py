"""tsp-bench: TSP and the baselines measured side by side (memory, bytes, time); see cli.py.

The names other code builds on (the experiments/ scripts): `build_scheme` (one rank of a scheme
and its step runner), `StepRunner` (a memory step, then timed steps, of one model),
`scheme_rank` / `interleaved_ranks` / `single_process` (what each benchmark process runs) and
`make_batch` (the random batch every scheme is fed)."""

from tsp_trainer.bench.report import format_spread, ratio_spread
from tsp_trainer.bench.run import (StepRunner, build_scheme, interleaved_ranks, make_batch, scheme_rank,
                                   single_process)

__all__ = ["StepRunner", "build_scheme", "format_spread", "interleaved_ranks", "make_batch", "ratio_spread",
           "scheme_rank", "single_process"]
