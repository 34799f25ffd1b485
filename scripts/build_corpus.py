"""Build the bundled demo corpus and tokenizer in data/ from the running Python's standard library.

Each document is the docstrings of one stdlib module (module, classes, functions, methods), so the
text is English prose about code, is always present offline, and may be redistributed under the
PSF License (copied to data/LICENSE-PSF.txt). The byte-level BPE tokenizer (vocab 1024, the `tiny`
model's vocab_size) is trained on the train split only.

    python scripts/build_corpus.py            # writes data/corpus/*.jsonl, data/tokenizer/*
    python scripts/build_corpus.py --out /tmp/data --vocab-size 4096

The output depends only on the interpreter's stdlib (the bundled copy was built from CPython 3.11.7).
Imports only the standard library, tokenizers and transformers.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import shutil
import sysconfig
from pathlib import Path

# Folders that are not library prose: tests, demos, vendored or generated code, codec stubs.
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip",
                 "pydoc_data", "encodings", "__phello__", "__pycache__", "lib-dynload"}
# Modules that Python's docs list under their own (permissive) licenses in "Licenses and
# Acknowledgements for Incorporated Software"; left out so the whole corpus is PSF-licensed.
EXCLUDED_MODULES = ("asynchat", "asyncore", "http.cookies", "trace", "uu", "xmlrpc")
EOS, PAD = "<|endoftext|>", "<|pad|>"
VALIDATION_EVERY = 20   # about 1 module in 20 goes to the held-out split (chosen by name hash)
NUM_TRAIN_SHARDS = 2    # one shard per DP rank of the dp_degree=2 tests


def stdlib_modules(stdlib: Path) -> list[tuple[str, Path]]:
    """(dotted module name, path) of every stdlib source file we keep, sorted by name."""
    out = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if not any(name == m or name.startswith(m + ".") for m in EXCLUDED_MODULES):
            out.append((name, path))
    return sorted(out)


def module_document(name: str, path: Path) -> str:
    """Docstrings of one module, each object's under its qualified name; '' when it has none."""
    try:
        # Parse bytes so that PEP 263 coding cookies are honoured.
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return ""
    sections = []
    module_doc = ast.get_docstring(tree)
    if module_doc:
        sections.append(f"Module {name}\n\n{module_doc}")
    for qualname, doc in _object_docstrings(tree, prefix=""):
        sections.append(f"{name}.{qualname}\n\n{doc}")
    return "\n\n".join(sections).strip()


def _object_docstrings(node: ast.AST, *, prefix: str):
    """Yield (qualname, docstring) for classes and functions in source order, recursively."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qualname = f"{prefix}{child.name}"
            doc = ast.get_docstring(child)
            if doc:
                yield qualname, doc
            yield from _object_docstrings(child, prefix=qualname + ".")


def is_validation(name: str) -> bool:
    # A name hash (not position) keeps the split stable when modules are added or removed.
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % VALIDATION_EVERY == 0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_corpus(out: Path, stdlib: Path) -> dict[str, list[dict]]:
    train, validation = [], []
    for name, path in stdlib_modules(stdlib):
        text = module_document(name, path)
        if text:
            (validation if is_validation(name) else train).append({"text": text, "module": name})
    # Round-robin over the sorted modules so the two shards have similar sizes.
    splits = {f"train-{i:05d}-of-{NUM_TRAIN_SHARDS:05d}": train[i::NUM_TRAIN_SHARDS]
              for i in range(NUM_TRAIN_SHARDS)}
    splits["validation"] = validation
    for stem, rows in splits.items():
        write_jsonl(out / "corpus" / f"{stem}.jsonl", rows)
    shutil.copyfile(stdlib / "LICENSE.txt", out / "LICENSE-PSF.txt")
    return splits


def train_tokenizer(texts: list[str], out: Path, *, vocab_size: int) -> None:
    """Byte-level BPE (GPT-2 style): every byte is in the alphabet, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Special tokens first, so EOS is id 0 and PAD id 1.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1, "special token ids moved"
    # save_pretrained writes tokenizer.json plus the config files from_pretrained(folder) reads.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   model_max_length=1 << 20)
    fast.save_pretrained(str(out / "tokenizer"))
    # transformers 5 writes its own class name; the v4 name loads under both major versions.
    config_path = out / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data")
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    splits = build_corpus(args.out, stdlib)
    train_texts = [row["text"] for stem, rows in splits.items() if stem.startswith("train")
                   for row in rows]
    train_tokenizer(train_texts, args.out, vocab_size=args.vocab_size)
    print(f"python {platform.python_version()} stdlib {stdlib}")
    for stem, rows in splits.items():
        chars = sum(len(r["text"]) for r in rows)
        print(f"{stem}: {len(rows)} documents, {chars} characters")


if __name__ == "__main__":
    main()
