"""The package's dependency rules (docs/design.md, "Packages and the direction of imports"), checked
on every module's imports (ast), the absence of import cycles among tsp_trainer modules, and the
size that keeps trainer.py a conductor."""

import ast
import functools
import pathlib

import tsp_trainer

ROOT = pathlib.Path(tsp_trainer.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return names


@functools.lru_cache(maxsize=1)
def _modules() -> tuple[tuple[str, set[str]], ...]:
    """(path under the package, the names it imports) for every module, parsed once per session."""
    return tuple((path.relative_to(ROOT).as_posix(), _imports(path)) for path in sorted(ROOT.rglob("*.py")))


def _uses(names: set[str], package: str) -> bool:
    return any(n == package or n.startswith(package + ".") for n in names)


def test_model_knows_nothing_of_distribution_or_our_other_packages():
    for rel, names in _modules():
        if rel.startswith("model/"):
            assert not _uses(names, "torch.distributed"), rel
            ours = {n for n in names if n.startswith("tsp_trainer.")}
            assert all(n.startswith(("tsp_trainer.model", "tsp_trainer.config")) for n in ours), rel


def test_accelerate_and_deepspeed_only_in_engine():
    for rel, names in _modules():
        if _uses(names, "accelerate") or _uses(names, "deepspeed"):
            assert rel.startswith("engine/"), rel


def test_omegaconf_only_in_config_load_and_wandb_only_in_its_sink():
    for rel, names in _modules():
        if _uses(names, "omegaconf"):
            assert rel == "config/load.py", rel
        if _uses(names, "wandb"):
            assert rel == "observability/wandb_sink.py", rel
        if _uses(names, "wandb_workspaces"):
            assert rel == "observability/dashboard.py", rel


def test_config_imports_no_runtime_code():
    for rel, names in _modules():
        if rel.startswith("config/"):
            ours = {n for n in names if n.startswith("tsp_trainer.")}
            assert all(n.startswith("tsp_trainer.config") for n in ours), rel
            assert not _uses(names, "torch"), rel


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "reduce", "isend", "irecv", "send", "recv", "batch_isend_irecv", "all_to_all",
               "all_to_all_single", "barrier", "broadcast_object_list", "all_gather_object",
               "gather_object"}


def _distributed_calls(path: pathlib.Path) -> list[str]:
    """Calls like dist.all_reduce(...) or torch.distributed.broadcast(...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if node.func.attr in COLLECTIVES and owner in ("dist", "torch.distributed"):
                found.append(f"{owner}.{node.func.attr}")
    return found


def test_collectives_only_through_comm():
    """Every collective and P2P op is issued by parallel/comm.py (Comm, so the ledger sees it);
    outside it only process-group start-up and tear-down (launchers, the CLI) appear."""
    allowed = {"cli.py": {"dist.barrier"}, "tools/launch.py": {"dist.barrier"}}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "parallel/comm.py":      # the one place ops are issued (and recorded)
            continue
        calls = set(_distributed_calls(path)) - allowed.get(rel, set())
        assert not calls, (rel, calls)


def test_run_package_is_called_by_the_conductors_only():
    """run/ (the job's lifecycle) is used by trainer.py and cli.py; it imports none of the engine,
    the observability sinks, the trainer or the CLI, and no accelerate / deepspeed / wandb."""
    for rel, names in _modules():
        if _uses(names, "tsp_trainer.run") and not rel.startswith("run/"):
            assert rel in ("trainer.py", "cli.py"), rel
        if rel.startswith("run/"):
            for forbidden in ("tsp_trainer.engine", "tsp_trainer.observability", "tsp_trainer.trainer",
                              "tsp_trainer.cli", "accelerate", "deepspeed", "wandb"):
                assert not _uses(names, forbidden), (rel, forbidden)


def test_data_knows_nothing_of_distribution():
    """The data package takes dp_rank and dp_degree as integers (it never sees a process group): no
    torch.distributed, and none of parallel/, engine/, checkpoint/ or the trainer."""
    for rel, names in _modules():
        if rel.startswith("data/"):
            assert not _uses(names, "torch.distributed"), rel
            ours = {n for n in names if n.startswith("tsp_trainer.")}
            assert all(n.startswith(("tsp_trainer.data", "tsp_trainer.config")) for n in ours), rel


def test_eval_package_is_used_by_the_trainer_and_cli_never_the_reverse():
    """tsp_trainer/eval (loss by position, passkey) runs on the parallel model through Comm: no
    accelerate / deepspeed / wandb / omegaconf, none of trainer, engine or cli (which import it), and
    no module outside those two and eval itself imports it (e.g. the model or parallel code)."""
    for rel, names in _modules():
        if rel.startswith("eval/"):
            assert not any(_uses(names, pkg) for pkg in ("accelerate", "deepspeed", "wandb",
                                                         "omegaconf")), rel
            assert not any(_uses(names, f"tsp_trainer.{m}") for m in ("trainer", "engine", "cli")), rel
        elif rel not in ("trainer.py", "cli.py"):
            assert not _uses(names, "tsp_trainer.eval"), rel


TRAINER_MAX_LINES = 350


def test_trainer_stays_a_conductor():
    """trainer.py builds the pieces in order and runs fit() and train_step(); what does not
    conduct (checkpoint state, device checks, FLOP counts, block wrappers) lives in its package."""
    lines = len((ROOT / "trainer.py").read_text().splitlines())
    assert lines <= TRAINER_MAX_LINES, (
        f"tsp_trainer/trainer.py has {lines} lines, more than {TRAINER_MAX_LINES}: move what does "
        "not conduct the run into the package it belongs to")


def _module_name(path: pathlib.Path) -> str:
    parts = ("tsp_trainer", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_time_imports(tree: ast.AST) -> list[ast.stmt]:
    """Import statements that run when the module is imported: not inside a function (a lazy
    import runs later) nor under `if TYPE_CHECKING:`."""
    found, todo = [], list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo += ast.iter_child_nodes(node)
    return found


def _import_graph() -> dict[str, set[str]]:
    """tsp_trainer module -> the tsp_trainer modules it imports at import time (`from pkg import
    name` counts as pkg.name when that is a module)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in _import_time_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                targets |= (subs & paths.keys()) or {node.module}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_among_our_modules():
    graph = _import_graph()
    assert "tsp_trainer.parallel.baselines.apply" in graph["tsp_trainer.parallel.schemes"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_tools_are_below_bench_and_plan():
    """tools/ (launcher, memory tracker, host-sync counter) serves tsp-bench, the planner and the
    tests: it imports neither tsp-bench nor the planner, and no module outside bench/ and the CLI
    imports tsp-bench."""
    for rel, names in _modules():
        if rel.startswith("tools/"):
            assert not _uses(names, "tsp_trainer.bench") and not _uses(names, "tsp_trainer.plan"), rel
        elif not rel.startswith("bench/") and rel != "cli.py":
            assert not _uses(names, "tsp_trainer.bench"), rel


def test_the_training_path_reaches_the_planner_through_one_entry():
    """Outside plan/ (trainer.py, run/, bench/, every other package) the one planner module
    imported is plan/resolve.py, the `auto` settings decided once for the job and the run's
    recompute for its FLOP count; the CLI also starts tsp-plan. The planner can change without
    touching training."""
    for rel, names in _modules():
        if rel.startswith("plan/"):
            continue
        planner = {n for n in names if _uses({n}, "tsp_trainer.plan")}
        allowed = {"tsp_trainer.plan.resolve"} | ({"tsp_trainer.plan.cli"} if rel == "cli.py" else set())
        assert planner <= allowed, (rel, sorted(planner - allowed))
