"""Bytes each DP rank reads, by split strategy.

    python experiments/data_split.py [--files 23] [--dp 8]

Writes `--files` jsonl files of equal size (like PG19's 23 train files; 40 documents of
`--doc-chars` random letters each, 1 MB per file by default) and one parquet file with `--files`
row groups of the same documents, then streams every DP rank's share as the loader does (`open_text_stream`:
reshard() + the "shards" split) and as datasets' default would for this file count ("examples":
every rank reads everything and keeps 1 row in dp). Bytes are the process's read syscalls
(/proc/self/io rchar) around each rank's pass, as a multiple of the fair share (total / dp).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import tempfile
from pathlib import Path


def bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=23)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--doc-chars", type=int, default=25_000)
    args = p.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="tsp_split_bench_"))
    os.environ.setdefault("HF_HOME", str(work / "hf"))
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.distributed import split_dataset_by_node

    from tsp_trainer.data.streaming import load_streaming, open_text_stream

    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    folder = work / "jsonl"
    folder.mkdir()
    # Random letters: parquet compresses repeated text ~100x, and then its footer reads, not
    # the data, would be what is measured.
    rng = random.Random(0)
    rows = [[f"file {f} doc {i} " + "".join(rng.choices(string.ascii_lowercase + " ", k=args.doc_chars))
             for i in range(40)] for f in range(args.files)]
    for f, texts in enumerate(rows):
        (folder / f"train-{f:05d}-of-{args.files:05d}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in texts))
    parquet = work / "one.parquet"
    pq.write_table(pa.table({"text": sum(rows, [])}), parquet, row_group_size=40)

    def shares(source: Path, read) -> list[float]:
        total = sum(p.stat().st_size for p in ([source] if source.is_file() else source.iterdir()))
        read(0)                                         # warm-up: lazy imports read files too
        out = []
        for rank in range(args.dp):
            before = bytes_read()
            read(rank)
            out.append((bytes_read() - before) / (total / args.dp))
        return out

    def ours(source):
        return lambda r: list(open_text_stream(str(source), dp_rank=r, dp_degree=args.dp))

    def examples(source):
        return lambda r: list(split_dataset_by_node(load_streaming(str(source), split="train"),
                                                    rank=r, world_size=args.dp, strategy="examples"))

    print(f"{args.files} files / row groups over dp={args.dp}: bytes read per rank / fair share")
    for name, source, read in (("jsonl files, shards (ours)", folder, ours(folder)),
                               ("jsonl files, examples (datasets default)", folder, examples(folder)),
                               ("1 parquet, reshard + shards (ours)", parquet, ours(parquet)),
                               ("1 parquet, examples (datasets default)", parquet, examples(parquet))):
        s = shares(source, read)
        print(f"  {name:42s} max {max(s):5.2f}x  min {min(s):5.2f}x  "
              f"({', '.join(f'{x:.2f}' for x in s)})")


if __name__ == "__main__":
    main()
