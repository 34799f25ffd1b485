"""docs/parallelism.md's Ulysses commands as a user runs them (subprocesses, the bundled tiny data):
tsp-launch trains parallel.scheme=ulysses on 4 processes (DP 2 x D 2; zero.stage auto: ZeRO-3 over
the 4 ranks), and a degree that does not divide the query heads, a head-chunk count that does not
divide the query heads per rank, or ZeRO-3 under tsp, is one line and exit 2 before start-up."""

from __future__ import annotations

import pytest

from tests.integration.test_doc_commands import run_blocks, scenario, workspace


@pytest.mark.slow           # real launches (~16 s); Ulysses' parity is tests/distributed/test_ulysses_parity.py
@pytest.mark.timeout(600)
def test_ulysses_doc_commands_run_as_written(tmp_path):
    cwd, env = workspace(tmp_path)
    # the refusals first: consecutive blocks that must fail run side by side (run_blocks)
    run_blocks([block for name in ("ulysses-shapes", "ulysses-head-chunks", "zero3-scheme", "ulysses")
                for block in scenario("docs/parallelism.md", name)], cwd, env)
