"""The GQA-native attention path (model/attention_gqa.py) on CPU tensors: inside `native_gqa_route()`
`attention_core` takes its CPU route with gqa_native set under GQA when the call's gqa_path is
native (train.attention_gqa; fused keeps the plain CPU route), the same per-group-member code
the CUDA flash route runs (there on flash attention's varlen kernel, here on torch's CPU flash
kernel). Yields a count of the native calls, so a test sees the path was taken."""

from __future__ import annotations

import contextlib

from tsp_trainer.model import layers


@contextlib.contextmanager
def native_gqa_route():
    original = layers.sdpa_route
    calls = {"grouped": 0}

    class Counted(layers.SdpaRoute):
        def grouped(self, q, k, v, q_runs, documents):
            calls["grouped"] += 1
            return super().grouped(q, k, v, q_runs, documents)

    def route(device_type, dtype, *, gqa, head_dim, kernel="fa2", gqa_path="native"):
        base = original(device_type, dtype, gqa=gqa, head_dim=head_dim, kernel=kernel, gqa_path=gqa_path)
        return Counted(**{**base.__dict__, "gqa_native": gqa and gqa_path == "native"})

    layers.sdpa_route = route
    try:
        yield calls
    finally:
        layers.sdpa_route = original


__all__ = ["native_gqa_route"]
