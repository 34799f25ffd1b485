"""The run's attention kernel reaches every attention call as an argument: the model is built with
it and hands it to each call through the pass's Rotary; nothing is kept per process."""

import torch

from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer, layers


def test_the_model_hands_its_attention_kernel_to_every_attention_call(monkeypatch):
    seen = []
    route = layers.sdpa_route

    def recording(*args, **kwargs):
        seen.append(kwargs["kernel"])
        return route(*args, **kwargs)

    monkeypatch.setattr(layers, "sdpa_route", recording)
    cfg = model_config("tiny")
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    for kernel in ("cudnn", "fa3"):
        model = Transformer(cfg, attention_kernel=kernel)
        model.init_weights(0)
        model(ids)
        assert seen == [kernel] * cfg.num_layers
        seen.clear()
    # a model built without one takes torch's default flash kernel, whatever was built before it
    Transformer(cfg)(ids)
    assert seen == ["fa2"] * cfg.num_layers
