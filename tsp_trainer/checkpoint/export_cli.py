"""`tsp-export CHECKPOINT OUT`: a checkpoint saved under any layout -> a Hugging Face folder of the
model's family (Llama, Mistral or Qwen2, as imported), with the tokenizer the run trained with.

One process, no process group: it reads the self-describing model shards (checkpoint/shards.py),
never DeepSpeed's per-rank files. Exit status 2 with one line on stderr for bad input; OUT is
then left as it was (the folder is built under a temporary name and renamed at the end).
"""

from __future__ import annotations

import argparse
import sys

from tsp_trainer.checkpoint.hf import DTYPES, export_checkpoint, run_tokenizer
from tsp_trainer.config.hf_model import HF_FAMILIES


def build_parser() -> argparse.ArgumentParser:
    classes = ", ".join(f"{family.architecture} for {name}" for name, family in HF_FAMILIES.items())
    parser = argparse.ArgumentParser(
        prog="tsp-export",
        description="Export a tsp_trainer checkpoint to a Hugging Face folder (config.json + "
                    "safetensors + the run's tokenizer) of the model's family, which "
                    f"AutoModelForCausalLM.from_pretrained loads as its own class ({classes}).")
    parser.add_argument("checkpoint", help="a step_XXXXXXXX folder, or a checkpoints root / run "
                                           "folder (its `latest` checkpoint is used)")
    parser.add_argument("out", help="output folder (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="split the weights into files of at most this size, e.g. 5GB, 500MB, "
                             "2GiB (default 5GB); an index file lists them when split")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="copy the tokenizer files of DIR into OUT (and put its bos/eos/pad "
                             "ids into config.json); default: the tokenizer the checkpoint's run "
                             "trained with (data.tokenizer, else its model folder's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast the weights (default: as stored in the checkpoint)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    tokenizer, missing = (args.tokenizer, "") if args.tokenizer else run_tokenizer(args.checkpoint)
    try:
        out = export_checkpoint(args.checkpoint, args.out, max_shard_size=args.max_shard_size,
                                tokenizer=tokenizer, dtype=args.dtype, overwrite=args.overwrite)
    except ValueError as err:
        print(f"tsp-export: error: {err}", file=sys.stderr)
        sys.exit(2)
    files = sorted(p.name for p in out.iterdir())
    print(f"tsp-export: wrote {out} ({', '.join(files)})"
          + (f"; tokenizer from {tokenizer}" if tokenizer is not None else ""))
    if tokenizer is None:
        print(f"tsp-export: no tokenizer written: {missing}; pass --tokenizer DIR to add one",
              file=sys.stderr)


if __name__ == "__main__":
    main()
