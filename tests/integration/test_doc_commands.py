"""The commands of the README and the guides, run as written on the bundled tiny data, so the docs
cannot rot.

A fenced ```bash block right after a `<!-- doc-test: NAME -->` line belongs to scenario NAME. A
scenario's blocks run in order, each in `bash -e`, in one fresh folder that links the repository's
recipes/, launch/ and data/ (so relative paths read as in the docs and outputs land in the test's
folder), with this interpreter's scripts first on PATH. A block must exit 0, or the code the
marker names (`<!-- doc-test: NAME exit=2 -->`). A ```text block right after it is its expected
output: each of its lines must appear in the output, in order, `...` standing for any text."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARKER = re.compile(r"^<!--\s*doc-test:\s*([\w-]+)(?:\s+exit=(\d+))?\s*-->\s*$")
LINKED = ("recipes", "launch", "data")


@dataclass(frozen=True)
class DocBlock:
    where: str                 # "docs/guides/x.md:12", for messages
    scenario: str
    code: str
    exit_code: int
    expected: str | None       # the ```text block after the command, if any


def _fence_end(lines: list[str], start: int) -> int:
    """Index of the closing fence of the block whose opening fence is lines[start]."""
    for k in range(start + 1, len(lines)):
        if lines[k].strip() == "```":
            return k
    raise AssertionError(f"line {start + 1}: fenced block never closed")


def doc_blocks(text: str, source: str) -> list[DocBlock]:
    """Every marked block of a Markdown text, in order."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if not marker:
            i += 1
            continue
        assert i + 1 < len(lines) and lines[i + 1].strip() == "```bash", \
            f"{source}:{i + 1}: a doc-test marker must be followed by a ```bash block"
        end = _fence_end(lines, i + 1)
        expected, nxt = None, end + 1
        while nxt < len(lines) and not lines[nxt].strip():
            nxt += 1
        if nxt < len(lines) and lines[nxt].strip() == "```text":
            close = _fence_end(lines, nxt)
            expected, end = "\n".join(lines[nxt + 1:close]), close
        blocks.append(DocBlock(f"{source}:{i + 1}", marker.group(1), "\n".join(lines[i + 2:_fence_end(lines, i + 1)]),
                               int(marker.group(2) or 0), expected))
        i = end + 1
    return blocks


def scenario(path: str, name: str) -> list[DocBlock]:
    blocks = [b for b in doc_blocks((REPO / path).read_text(encoding="utf-8"), path) if b.scenario == name]
    assert blocks, f"{path} has no doc-test block of scenario {name!r}"
    return blocks


def matches(expected: str, output: str) -> str | None:
    """None if every line of `expected` appears in `output` in order ('...' = any text), else the
    first line that does not."""
    pos = 0
    for line in filter(None, (x.strip() for x in expected.splitlines())):
        for piece in filter(None, (p.strip() for p in line.split("..."))):
            found = output.find(piece, pos)
            if found < 0:
                return line
            pos = found + len(piece)
    return None


def workspace(tmp_path: Path) -> tuple[Path, dict]:
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", DS_ACCELERATOR="cpu",
               WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return tmp_path, env


def _check(block: DocBlock, proc: subprocess.CompletedProcess | subprocess.Popen, output: str) -> None:
    assert proc.returncode == block.exit_code, (f"{block.where}: exit {proc.returncode}, the doc says "
                                                f"{block.exit_code}\n{block.code}\n{output[-4000:]}")
    if block.expected is not None:
        missing = matches(block.expected, output)
        assert missing is None, f"{block.where}: output lacks {missing!r}\n{output[-4000:]}"


def run_blocks(blocks: list[DocBlock], cwd: Path, env: dict, timeout: float = 600,
               extra: dict[str, str] | None = None) -> None:
    """Run the blocks in order. Consecutive blocks that must fail run side by side (a refused
    command changes nothing). `extra` appends text to the command lines that contain a key (a
    shorter run of the same command), and is named in the test that uses it."""
    def start(block: DocBlock) -> subprocess.Popen:
        code = block.code
        for needle, suffix in (extra or {}).items():
            code = "\n".join(line + suffix if needle in line else line for line in code.splitlines())
        return subprocess.Popen(["bash", "-e", "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    i = 0
    while i < len(blocks):
        group = [blocks[i]]
        while blocks[i].exit_code and i + len(group) < len(blocks) and blocks[i + len(group)].exit_code:
            group.append(blocks[i + len(group)])
        procs = [start(block) for block in group]
        try:
            for block, proc in zip(group, procs):
                output, _ = proc.communicate(timeout=timeout)
                _check(block, proc, output)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        i += len(group)


@pytest.mark.slow           # every documented error through a real launch (~11 s)
def test_troubleshooting_errors_are_the_documented_lines(tmp_path):
    """Each error of the troubleshooting guide, caused as the guide causes it: exit code 2 and the
    line the guide quotes (the checks run before any process group, a few seconds each)."""
    cwd, env = workspace(tmp_path)
    blocks = scenario("docs/guides/troubleshooting.md", "troubleshooting")
    assert sum(b.exit_code == 2 for b in blocks) >= 8
    run_blocks(blocks, cwd, env)


def test_glossary_examples_print_what_the_glossary_says(tmp_path):
    cwd, env = workspace(tmp_path)
    run_blocks(scenario("docs/guides/glossary.md", "glossary"), cwd, env)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bring_your_own_model_and_data_end_to_end(tmp_path):
    """The guide as written: a tiny HF folder and jsonl files, then check, train (4 processes, 6
    steps), resume (4 more), export and eval. Slow (two 4-process launches and four more
    interpreters); the default suite runs each step's code: an HF folder trained from under
    DP 2 x TSP 2 and exported with its tokenizer (tests/distributed/test_hf_interop.py),
    tsp-check and tsp-launch (tests/integration/test_tsp_launch.py, test_interrupt_launch.py),
    the resume (test_interrupt_launch.py, tests/distributed/test_resume_settings.py), tsp-eval
    loss (tests/distributed/test_eval_cli.py)."""
    cwd, env = workspace(tmp_path)
    run_blocks(scenario("docs/guides/bring_your_own.md", "byo"), cwd, env)
    assert (cwd / "runs/my_run/checkpoints/latest").read_text().strip() == "step_00000010"
    assert (cwd / "eval_results/my_model_trained/loss_by_position.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_readme_rows_run_in_order_after_the_main_job(tmp_path):
    """The README's main job (its tsp-launch line), then every row of "After the quick start" in
    order, each as written except the passkey training, which runs 40 of its 1,500 steps (the
    passkey evaluation then reads that checkpoint)."""
    from tests.integration.test_lifecycle_launch import recipe_launch_line

    main_job = recipe_launch_line("tiny_cpu.yaml", ("tsp-launch",))
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f".venv/bin/{main_job}" in readme
    cwd, env = workspace(tmp_path)
    rows = scenario("README.md", "readme-rows")
    run_blocks([DocBlock("README.md: main job", "main", main_job, 0, "tsp-train: done: 60 steps")] + rows,
               cwd, env, extra={"recipes/tiny_passkey.yaml": " train.steps=40"})
    for folder in ("tiny_1proc", "tiny_dp4", "tiny_passkey"):
        assert (cwd / "runs" / folder / "checkpoints" / "latest").exists(), folder


def test_the_extractor_can_fail():
    """The extractor finds marked blocks, their exit codes and expected text, and the matcher
    reports a missing line (so a passing doc-test means something)."""
    text = ("<!-- doc-test: a -->\n```bash\necho hi\n```\n\n```text\nh...i\n```\n"
            "```bash\nnot marked\n```\n<!-- doc-test: a exit=2 -->\n```bash\nexit 2\n```\n")
    blocks = doc_blocks(text, "x.md")
    assert [(b.code, b.exit_code, b.expected) for b in blocks] == [("echo hi", 0, "h...i"), ("exit 2", 2, None)]
    assert matches("h...i", "hi") is None and matches("a...b\nc", "ab") == "c"
    assert matches("x: ... y", "x: 1 y") is None and matches("y ... x", "x y") == "y ... x"


def test_every_doc_test_marker_is_well_formed():
    """A marker the extractor cannot read would drop its block silently."""
    bad = [f"{path.relative_to(REPO)}:{number}" for path in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
           for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
           if "<!-- doc-test" in line and not MARKER.match(line.strip())]
    assert bad == []
