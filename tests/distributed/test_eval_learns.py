"""The passkey metric can move: the tiny model, trained on the synthetic retrieval corpus
(`tsp-eval retrieval-corpus`, 3-digit keys in real filler text) with the recipe's optimizer and
schedule (recipes/tiny_passkey.yaml), is scored by `run_passkey` under the TSP layout on haystacks
it never saw (other keys, validation filler).

Chance: a key token is one of 10 digits (the first one of 9), so token accuracy by chance is ~0.1
and exact retrieval of a 3-token key ~1/900. Copying the key comes with a phase change (an
induction circuit) after ~1,000-1,250 steps (recipes/tiny_passkey.yaml's run: accuracy 0.00 at step
1,000, 0.60 at 1,250, 0.97 at 1,500 at length 128), minutes on 2 shared cores: the slow variant
trains 1,500 steps and requires exact retrieval far above chance. The default-suite variant trains
100 steps and checks only that the metric responds: the key tokens' loss falls from the untrained
model's (measured to 0.35 of it; required below 0.5) and the key tokens become digits (token
accuracy measured 0.29; required 0.15, chance ~0.1), not that the key is retrieved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import load_config
from tsp_trainer.data import build_loader, load_tokenizer
from tsp_trainer.eval import HaystackBuilder, PasskeyTask, run_passkey
from tsp_trainer.eval.evaluator import read_filler
from tsp_trainer.eval.synthetic import write_retrieval_corpus
from tsp_trainer.model import Transformer
from tsp_trainer.optim import build_optimizer, build_scheduler
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
DIGITS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("retrieval")
    write_retrieval_corpus(out, tokenizer=load_tokenizer(REPO / "data" / "tokenizer"),
                           text=str(REPO / "data" / "corpus"), docs=4000, min_tokens=96,
                           max_tokens=128, digits=DIGITS)
    return out


def _task(tok) -> PasskeyTask:
    filler = read_filler(str(REPO / "data" / "corpus"), split="validation", text_field="text",
                         tokenizer=tok, min_tokens=8192)
    return PasskeyTask((128,), (0.0, 0.5, 1.0), 8, HaystackBuilder(tok, filler, digits=DIGITS, seed=0))


def _train_and_score(rank, world, corpus, steps):
    """(passkey result before training, after `steps` steps), scored under TSP on this 1-rank mesh."""
    cfg = load_config(REPO / "recipes" / "tiny_passkey.yaml",
                      [f"data.source={corpus}", f"train.steps={steps}", "data.prefetch=0",
                       f"data.tokenizer={REPO / 'data' / 'tokenizer'}"])
    tok = load_tokenizer(cfg.data.tokenizer)
    torch.manual_seed(0)
    model = Transformer(cfg.model.to_model_config())
    model.init_weights(cfg.model.seed)
    par = parallelize(model, "tsp", build_mesh(1), seq_len=128)
    task = _task(tok)
    before = run_passkey(par, task, dp=par.mesh.dp)
    opt = build_optimizer(par.model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, steps)
    loader = build_loader(cfg.data.source, tokenizer=tok, seq_len=cfg.data.seq_len,
                          micro_batch_size=cfg.data.micro_batch_size, shuffle=True, seed=0)
    for _ in range(steps):
        batch = next(loader)
        ids, labels, positions = par.local_batch(batch["input_ids"], batch["labels"])
        loss_sum, count = par.loss_sum(ids, labels, positions)
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(par.model.parameters(), cfg.optim.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
    loader.close()
    return before, run_passkey(par, task, dp=par.mesh.dp)


def _cells(result):
    return {c.depth: c for c in result.cells}


def _token_accuracy(result) -> float:
    return sum(c.tokens_right for c in result.cells) / sum(c.key_tokens for c in result.cells)


def test_passkey_metric_responds_to_a_short_training(corpus):
    before, after = run_on_ranks(_train_and_score, 1, corpus, 100, timeout=400)[0]
    b, a = _cells(before), _cells(after)
    for depth in (0.0, 0.5, 1.0):           # untrained: ~ln(1024) = 6.9 nats; digits known: ~2.3
        assert a[depth].key_nll < 0.5 * b[depth].key_nll, (depth, b[depth].key_nll, a[depth].key_nll)
    assert _token_accuracy(before) < 0.05 and _token_accuracy(after) >= 0.15


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_passkey_is_retrieved_after_training(corpus):
    before, after = run_on_ranks(_train_and_score, 1, corpus, 1500, timeout=900)[0]
    assert before.accuracy == 0.0
    # exact 3-digit keys in 24 haystacks, chance ~1/900 each: 3 or more is retrieval, not luck. Where
    # the copying circuit forms depends on the CPU's rounding: the same code and seed reach 0.21
    # exact (token accuracy 0.73) at step 1,500 on one machine and 0.97 on another
    assert after.accuracy >= 0.1, (after.accuracy, _token_accuracy(after))
    assert _token_accuracy(after) >= 0.6, (after.accuracy, _token_accuracy(after))
