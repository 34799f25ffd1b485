"""data_wait per step at 128K tokens with a real-size tokenizer, prefetch off vs on.

    python experiments/data_prefetch.py [--steps 8] [--step-time 7.55] [--procs 1] [--json docs/results/data_prefetch.json]

1. Trains a byte-level BPE with a 32,000-token vocabulary (Llama-2-sized) with `tokenizers` on the
   bundled corpus plus the Python standard library's sources (no download), and writes book-length
   documents (~400 KB each, like PG19's books) made of those sources.
2. For each mode, runs `--steps` steps of one 128K-token micro-batch (seq_len 131,072, micro 1,
   shuffled blocks of 16 books): data_wait is the time `next(loader)` takes in the training loop;
   the step's compute is simulated by an idle wait of `--step-time` seconds (a GPU step, where
   the Python thread waits on the device). The loader's time per batch is split into
   encode_batch (the Rust tokenizer, which releases the GIL) and the rest (reading rows and
   packing: Python, GIL held), which bounds what the worker can take from the training thread.
   A probe measures how much CPU a Python thread gets next to a thread calling `encode` vs
   `encode_batch`. The default step time is tsp-plan's prediction
   for the 7B model at 128K on 1,024 H200s (TSP, D=8, DP=128, micro 1: 7.55 s per step, its
   fastest TSP layout, so the strictest 1% bound).
   Modes, interleaved off/on/off/on: off (tokenize and pack in the training loop), on (prefetch
   depth 2).
3. `--procs N` runs N copies at once (the N ranks of a TSP group each read and tokenize the same
   data); each reports its own numbers.
The first step of each mode includes opening the dataset and is reported apart. Everything runs in
one process per copy, modes interleaved, so the machine's load affects them alike.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_tokenizer(folder: Path, vocab: int = 32000) -> float:
    """A byte-level BPE of `vocab` tokens trained on the corpus + stdlib; returns seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.perf_counter()
    files = [str(p) for p in (REPO / "data" / "corpus").glob("train-*.jsonl")] + _stdlib_files()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return time.perf_counter() - t0


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return sorted(f for f in glob.glob(f"{root}/**/*.py", recursive=True)
                  if "/test" not in f and "site-packages" not in f)


def build_books(folder: Path, *, book_bytes: int = 400_000, books_per_file: int = 12) -> int:
    """Book-length documents (the stdlib sources concatenated) in jsonl files; returns books."""
    folder.mkdir(parents=True, exist_ok=True)
    books, current = [], []
    for f in _stdlib_files():
        current.append(Path(f).read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, current)) >= book_bytes:
            books.append("\n".join(current))
            current = []
    for i in range(0, len(books), books_per_file):
        with open(folder / f"train-{i // books_per_file:05d}.jsonl", "w") as out:
            for text in books[i:i + books_per_file]:
                out.write(json.dumps({"text": text}) + "\n")
    return len(books)


def _busy(seconds: float) -> int:
    """Pure-Python work for about `seconds` (holds the GIL); returns iterations done."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    return n


def gil_probe(tok_dir: Path, seconds: float = 3.0) -> dict:
    """CPU seconds the main thread gets during `seconds` of pure-Python work, alone and with a
    thread tokenizing 400 KB texts through `encode` or `encode_batch`. A call that holds the GIL
    starves the main thread; one that releases it only competes for a core."""
    import threading

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    text = Path(_stdlib_files()[0]).read_text() * 20
    calls = {"encode": lambda: tok.encode(text, add_special_tokens=False),
             "encode_batch": lambda: tok.encode_batch_fast([text], add_special_tokens=False)}
    out = {}
    for name in ("alone", "encode", "encode_batch", "alone"):
        stop = threading.Event()
        worker = None
        if name != "alone":
            worker = threading.Thread(target=lambda f=calls[name]: [f() for _ in iter(stop.is_set, True)])
            worker.start()
            time.sleep(0.2)
        c0 = time.thread_time()
        _busy(seconds)
        out.setdefault(name, []).append(time.thread_time() - c0)
        stop.set()
        if worker is not None:
            worker.join()
    return {k: statistics.mean(v) for k, v in out.items()}


class _Timer:
    """Wall time spent inside a wrapped function (summed)."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t0


def run_mode(books: Path, tok_dir: Path, *, prefetch: bool, steps: int, step_time: float) -> dict:
    """`steps` steps of one 128K micro-batch; the step's compute is an idle wait (a GPU step)."""
    from tsp_trainer.data import PrefetchLoader, build_loader

    loader = build_loader(str(books), tokenizer=str(tok_dir), seq_len=131072, micro_batch_size=1,
                          shuffle=True, shuffle_buffer=16, seed=0)
    # Where the loader's time goes: encode_batch (the Rust tokenizer, GIL released) vs the rest
    # of making a batch (reading rows, packing: Python, GIL held).
    tok = loader.tokenizer
    encode = _Timer(tok._encode_batch)
    object.__setattr__(tok, "_encode_batch", encode)
    make = _Timer(loader.next_windows)
    loader.next_windows = make
    if prefetch:
        loader = PrefetchLoader(loader, depth=2)
    waits = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(loader)
        waits.append(time.perf_counter() - t0)
        assert batch["input_ids"].shape == (1, 131072)
        time.sleep(step_time)
    made = loader.loader.batches if prefetch else loader.batches
    loader.close()
    steady = waits[1:]
    return {"prefetch": prefetch, "first_wait_s": waits[0],
            "mean_wait_s": statistics.mean(steady), "max_wait_s": max(steady),
            "mean_wait_pct_of_step": 100 * statistics.mean(steady) / step_time,
            "max_wait_pct_of_step": 100 * max(steady) / step_time,
            "make_s_per_batch": make.total / made, "encode_s_per_batch": encode.total / made,
            "gil_held_s_per_batch": (make.total - encode.total) / made}


def one_copy(args_tuple) -> list[dict]:
    books, tok_dir, steps, step_time = args_tuple
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Interleaved: off, on, off, on, so load changes on the machine hit both alike.
    return [run_mode(Path(books), Path(tok_dir), prefetch=p, steps=steps, step_time=step_time)
            for p in (False, True, False, True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-time", type=float, default=7.55)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(tempfile.mkdtemp(prefix="tsp_data_bench_"))
    os.environ.setdefault("HF_HOME", str(work / "hf"))
    train_s = build_tokenizer(work / "tok")
    n_books = build_books(work / "books")
    with mp.get_context("fork").Pool(args.procs) as pool:
        results = pool.map(one_copy, [(str(work / "books"), str(work / "tok"), args.steps,
                                       args.step_time)] * args.procs)
    probe = gil_probe(work / "tok")
    report = {"step_time_s": args.step_time, "steps": args.steps, "procs": args.procs,
              "tokenizer": "byte-level BPE, vocab 32,000, trained locally", "books": n_books,
              "tokenizer_train_s": train_s, "seq_len": 131072, "results": results,
              "gil_probe_main_cpu_s_in_3s": probe}
    print(f"tokenizer trained in {train_s:.1f} s; {n_books} books; step {args.step_time} s; "
          f"{args.procs} copies at once")
    print("| copy | prefetch | first next() s | mean data_wait s | max s | mean % of step | "
          "max % | make batch s | of it encode_batch s | GIL held s (% of step) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, rows in enumerate(results):
        for r in rows:
            print(f"| {c} | {'on' if r['prefetch'] else 'off'} | {r['first_wait_s']:.3f} | "
                  f"{r['mean_wait_s']:.4f} | {r['max_wait_s']:.4f} | {r['mean_wait_pct_of_step']:.3f} | "
                  f"{r['max_wait_pct_of_step']:.3f} | {r['make_s_per_batch']:.3f} | "
                  f"{r['encode_s_per_batch']:.3f} | {r['gil_held_s_per_batch']:.3f} "
                  f"({100 * r['gil_held_s_per_batch'] / args.step_time:.2f}%) |")
    print("main-thread CPU s during 3 s of Python work: " +
          ", ".join(f"{k} {v:.2f}" for k, v in probe.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
