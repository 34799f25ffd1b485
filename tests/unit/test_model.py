import pytest
import torch

from tsp_trainer.config import MODEL_SIZES, model_config
from tsp_trainer.model import Transformer, attention_core, rope_cos_sin


@pytest.mark.parametrize("size,expected", [
    ("7b", 6_738_415_616),          # Llama-2-7B: the published parameter count
    # paper's literal gated FFN x4: 32 x (4 h^2 + 3 h 16384 + 2 h) + h + 2 V h, h = 4096, V = 32000
    ("7b_ffn4x", 32 * (4 * 4096**2 + 3 * 4096 * 16384 + 2 * 4096) + 4096 + 2 * 32000 * 4096),
    ("1b", 16 * (4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048) + 2048 + 2 * 32000 * 2048),
    ("125m", 12 * (4 * 768**2 + 3 * 768 * 2048 + 2 * 768) + 768 + 2 * 32000 * 768),
])
def test_named_size_parameter_counts(size, expected):
    cfg = MODEL_SIZES[size]
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected == cfg.num_params()


def test_tied_embeddings_count_once():
    cfg = model_config("tiny", tie_embeddings=True)
    model = Transformer(cfg)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_forward_shapes_and_causality():
    cfg = model_config("tiny")
    model = Transformer(cfg)
    model.init_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, cfg.vocab_size)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    # tokens after position 9 must not influence positions 0..9
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_init_is_layout_independent_and_seeded():
    cfg = model_config("tiny")
    a, b = Transformer(cfg), Transformer(cfg)
    a.init_weights(3)
    b.init_weights(3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    b.init_weights(4)
    assert not torch.equal(a.layers[0].mlp.up_proj.weight, b.layers[0].mlp.up_proj.weight)


def test_attention_core_query_slices_match_full():
    """Queries at arbitrary contiguous global positions (as a zigzag rank holds them) against the
    full key prefix equal the same rows of full causal attention (GQA)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 12, 4, 8), torch.randn(2, 12, 2, 8), torch.randn(2, 12, 2, 8)
    full = attention_core(q, k, v)
    pos = torch.tensor([0, 1, 2, 9, 10, 11])
    torch.testing.assert_close(attention_core(q[:, pos], k, v, pos), full[:, pos], rtol=1e-5, atol=1e-6)


def test_model_has_no_distributed_import():
    import ast
    import pathlib

    import tsp_trainer.model as m
    for path in pathlib.Path(m.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(x.startswith("torch.distributed") for x in names), path


def test_rope_tables():
    cos, sin = rope_cos_sin(torch.tensor([0, 5]), 8, 10000.0)
    assert cos.shape == (2, 8)
    torch.testing.assert_close(cos[0], torch.ones(8))
    torch.testing.assert_close(sin[1, 0], torch.tensor(5.0).sin())


def test_attention_core_blocks_long_query_runs():
    """Query runs longer than the CPU mask block are split; results are unchanged."""
    from tsp_trainer.model.attention_route import SdpaRoute

    torch.manual_seed(1)
    q, k, v = torch.randn(1, 40, 2, 4), torch.randn(1, 40, 2, 4), torch.randn(1, 40, 2, 4)
    pos = torch.cat([torch.arange(0, 10), torch.arange(30, 40)])
    whole = attention_core(q[:, pos], k, v, pos)
    blocked = SdpaRoute("cpu_blocked_mask", query_block=3)
    torch.testing.assert_close(attention_core(q[:, pos], k, v, pos, blocked), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole, attention_core(q, k, v)[:, pos], rtol=1e-5, atol=1e-6)
