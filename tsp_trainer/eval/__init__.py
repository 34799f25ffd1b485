"""Long-context evaluation under the training layout: the eval loss by position bucket and passkey
retrieval, for the Trainer (evaluator.py) and the `tsp-eval` CLI (cli.py).

Forward only, on the sharded model of any scheme (TSP, TP, TP+SP, SP, TP x SP): each rank gets the
loss and argmax of its own tokens from the LM head (Parallelized.token_stats), which never holds
full-vocabulary logits of all tokens, and the small results are summed over the groups that split
a replica's tokens and over dp through Comm. Imports config, data, model, parallel, checkpoint and
observability; never trainer, engine (accelerate / deepspeed) or wandb.
"""

from tsp_trainer.eval.haystack import HaystackBuilder, Sample, filler_tokens
from tsp_trainer.eval.passkey import PasskeyCell, PasskeyResult, PasskeyTask, run_passkey
from tsp_trainer.eval.position_loss import PositionLoss, PositionLossAccumulator, bucket_edges

__all__ = ["HaystackBuilder", "PasskeyCell", "PasskeyResult", "PasskeyTask", "PositionLoss",
           "PositionLossAccumulator", "Sample", "bucket_edges", "filler_tokens", "run_passkey"]
