"""Tiny Hugging Face models of the shapes that go beyond hidden / heads and a degree that divides
everything: Qwen3 (per-head q/k RMSNorm), an explicit head_dim (Llama, Mistral), a prime
vocabulary (tied and untied), K/V heads fewer than D (MQA, GQA 8/2), built with transformers' own config classes and
saved with save_pretrained; and their one-process references (logits, loss, gradients, a 3-step
AdamW replay, document masking) computed by transformers itself. `saved` and `shared_reference`
make each shape's folder and reference once per test session, for the D = 1 and the D = 2, 4
tests alike (read-only)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from tsp_trainer.checkpoint.hf import from_hf_name

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# name -> (transformers config class, its keywords beyond BASE)
SHAPES = {
    # Qwen3: q/k norms, head_dim 16 (hidden / heads = 8), GQA 8/4
    "qwen3": ("Qwen3Config", dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16)),
    # Qwen3 with attention_bias (q, k, v, o) and tied embeddings, head_dim 24
    "qwen3_bias_tied": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=24,
                                            attention_bias=True, tie_word_embeddings=True)),
    # Llama with head_dim 24 > hidden / heads = 16 (q, o: [96, 64], [64, 96])
    "llama_head_dim": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=24)),
    # Mistral(-Nemo style) with head_dim 8 < hidden / heads = 16, no window
    "mistral_head_dim": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                               sliding_window=None)),
    # a prime vocabulary (1,031: no degree > 1 divides it), tied and untied: padded internally
    "llama_vocab_prime_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                                   vocab_size=1031, tie_word_embeddings=True)),
    "qwen3_vocab_prime": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                              vocab_size=1031)),
    # K/V heads fewer than D (copied on the ranks that share one): MQA (one K/V head, q/k/v biases:
    # the bias copies too) and Qwen3 GQA 8/2 (copies at D = 4, q/k norms)
    "qwen2_mqa": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1)),
    "qwen3_kv2": ("Qwen3Config", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
}
# the shapes whose K/V heads are fewer than some tested D
FEW_KV_HEADS = ("qwen2_mqa", "qwen3_kv2")
LR, EPS, STEPS = 1e-2, 1e-3, 3          # the AdamW replay (eps far above gradient rounding noise)
DOC_LENGTHS = [[5, 11, 1, 15], [3, 29]]


def save_tiny(folder, shape: str, **overrides):
    """The transformers model of `shape` (random weights, random biases and norm weights: the
    defaults zeros / ones would leave their paths untested), saved with save_pretrained.
    `overrides`: config keywords that change the shape (e.g. num_key_value_heads)."""
    import transformers

    cls_name, extra = SHAPES[shape]
    config = getattr(transformers, cls_name)(**{**BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return model.eval()


def batch(vocab: int, rows: int = 2, seq: int = 32, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, :3] = -100
    return tokens[:, :-1].contiguous(), labels


def our_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {from_hf_name(n): t for n, t in tensors.items()}


def _loss(hf, ids, labels):
    """Sum of token cross-entropies and the count, as our loss_sum (labels already shifted)."""
    logits = hf(input_ids=ids).logits.float()
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum",
                                              ignore_index=-100)
    return total, int((labels != -100).sum())


def reference(folder, ids, labels) -> dict:
    """transformers on the saved folder: logits, loss, gradients; the weights after STEPS AdamW
    steps; the document-masked loss and gradients (each document alone, positions from 0)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    total, count = _loss(hf, ids, labels)
    (total / count).backward()
    out = {"logits": logits, "loss": (total / count).item(),
           "grads": our_names({n: p.grad.clone() for n, p in hf.named_parameters()})}
    hf.zero_grad()
    sums, count = [], 0
    for row, lengths in enumerate(DOC_LENGTHS):
        start = 0
        for n in lengths:
            s, c = _loss(hf, ids[row:row + 1, start:start + n], labels[row:row + 1, start:start + n])
            sums.append(s)
            count += c
            start += n
    doc_total = torch.stack(sums).sum()
    (doc_total / count).backward()
    out["doc_loss"] = (doc_total / count).item()
    out["doc_grads"] = our_names({n: p.grad.clone() for n, p in hf.named_parameters()})
    hf.zero_grad()
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS)
    for _ in range(STEPS):
        total, count = _loss(hf, ids, labels)
        (total / count).backward()
        opt.step()
        opt.zero_grad()
    out["weights"] = our_names({n: t.detach().clone() for n, t in hf.state_dict().items()})
    return out


@functools.lru_cache(maxsize=None)
def _session_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="tsp_hf_shapes_"))


@functools.lru_cache(maxsize=None)
def saved(shape: str) -> Path:
    """`save_tiny(folder, shape)` once per test session (seeded: the same files wherever it is
    written), in one root folder with a subfolder per shape. Tests only read it."""
    folder = _session_root() / shape
    save_tiny(folder, shape)
    return folder


@functools.lru_cache(maxsize=None)
def shared_reference(shape: str) -> dict:
    """`reference` of the `saved` folder on `batch` of its vocabulary, once per test session.
    Tests only read it."""
    from tsp_trainer.config.hf_model import model_config_from_hf

    folder = saved(shape)
    ids, labels = batch(model_config_from_hf(folder).vocab_size)
    return reference(str(folder), ids, labels)
