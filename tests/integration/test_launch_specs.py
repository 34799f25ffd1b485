"""The SkyPilot task and the Kubeflow TrainJob of recipes/7b_128k_1024gpu.yaml hold the launch
contract (neither has run on its engine: docs/launching/skypilot.md, kubeflow.md): processes =
nodes x processes per node = the recipe's world size; each node's processes a whole number of TSP
groups; one launch/torchrun.sh per node with `train.resume=auto` and a run folder that outlives the
machines; a stop at a checkpoint (exit 75) relaunched; on Kubernetes the grace period before
SIGKILL above torchrun's wait for the final save. Each spec's own command runs against a python
stand-in with the engine's environment (SKYPILOT_* / PET_*), and the torchrun line it produces is
checked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.test_launch import _calls, _script_env, _standins, _torchrun_line
from tsp_trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/7b_128k_1024gpu.yaml"
SKYPILOT = REPO / "launch/skypilot/7b_128k_1024gpu.yaml"
KUBEFLOW = REPO / "launch/kubeflow/7b_128k_1024gpu.yaml"
EXIT_PREEMPTED = 75
# Keys of a SkyPilot task YAML and of its `resources` used or allowed here (SkyPilot's task schema)
SKYPILOT_TASK_KEYS = {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts",
                      "setup", "run", "config"}
SKYPILOT_RESOURCE_KEYS = {"infra", "cloud", "region", "zone", "accelerators", "cpus", "memory",
                          "instance_type", "use_spot", "job_recovery", "disk_size", "disk_tier",
                          "network_tier", "ports", "image_id", "labels", "any_of", "ordered",
                          "autostop"}
TEARDOWN_MARGIN_S = 30     # torchrun's own teardown after its ranks' save, inside the grace period


@pytest.fixture(scope="module")
def recipe():
    cfg = load_config(RECIPE)
    return {"world": cfg.parallel.dp_degree * cfg.parallel.tsp_degree, "tsp": cfg.parallel.tsp_degree,
            "checkpoint_every": cfg.checkpoint.every}


def _run_command(tmp_path: Path, command: list[str], **env: str) -> tuple[list[str], list[str]]:
    """Run a spec's command in the repository with a python stand-in; (check argv, torchrun argv)."""
    python = _standins(tmp_path, "python") / "python"
    proc = subprocess.run(command, cwd=REPO, env=_script_env(tmp_path, PYTHON=str(python), STANDIN_CUDA="0",
                                                             **env),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    check, call = _calls(tmp_path / "calls.jsonl")
    return check["argv"], call["argv"]


def _expected(nodes: int, node_rank: int, nproc: int, endpoint: str, world: int) -> tuple[list, list]:
    overrides = ["train.output_dir=/checkpoints/7b_128k_1024gpu", "train.resume=auto"]
    check = ["-m", "tsp_trainer", "check", "--world-size", str(world), "--first-rank",
             str(node_rank * nproc), RECIPE, *overrides]
    return check, _torchrun_line(str(nodes), str(node_rank), str(nproc), endpoint, RECIPE, *overrides)


# ---- SkyPilot ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sky():
    return yaml.safe_load(SKYPILOT.read_text())


def test_skypilot_task_uses_skypilots_keys_and_the_recipe(sky):
    assert set(sky) <= SKYPILOT_TASK_KEYS, set(sky) - SKYPILOT_TASK_KEYS
    assert set(sky["resources"]) <= SKYPILOT_RESOURCE_KEYS, set(sky["resources"]) - SKYPILOT_RESOURCE_KEYS
    assert sky["envs"]["RECIPE"] == RECIPE


def test_skypilot_processes_are_the_recipes_world_in_node_local_tsp_groups(sky, recipe):
    per_node = int(sky["envs"]["GPUS_PER_NODE"])
    gpus = int(sky["resources"]["accelerators"].split(":")[1])
    assert per_node == gpus == 8
    assert sky["num_nodes"] * per_node == recipe["world"] == 1024
    assert per_node % recipe["tsp"] == 0


def test_skypilot_recovery_resumes_from_a_folder_outside_the_vms(sky, recipe):
    """A spot VM goes without a signal: the loss is bounded by checkpoint.every; the managed job
    relaunches (a stop at a checkpoint always) and resumes from the mounted bucket."""
    recovery = sky["resources"]["job_recovery"]
    assert sky["resources"]["use_spot"] is True and recipe["checkpoint_every"] > 0
    assert EXIT_PREEMPTED in recovery["recover_on_exit_codes"]
    assert recovery["max_restarts_on_errors"] >= 1 and recovery["strategy"] in ("FAILOVER", "EAGER_NEXT_REGION")
    assert "train.resume=auto" in sky["run"]
    output = re.search(r"train\.output_dir=(\S+)", sky["run"]).group(1)
    assert any(output.startswith(mount + "/") for mount in sky["file_mounts"]), output


def test_skypilot_run_starts_torchrun_with_the_nodes_rank_and_the_head_node(sky, recipe, tmp_path):
    check, torchrun = _run_command(
        tmp_path, ["bash", "-c", sky["run"]], RECIPE=RECIPE, GPUS_PER_NODE=str(sky["envs"]["GPUS_PER_NODE"]),
        SKYPILOT_NUM_NODES=str(sky["num_nodes"]), SKYPILOT_NODE_RANK="5", SKYPILOT_TASK_ID="sky-1",
        SKYPILOT_NODE_IPS="10.0.0.1\n10.0.0.2\n10.0.0.3")
    want_check, want_torchrun = _expected(128, 5, 8, "10.0.0.1:29500", recipe["world"])
    assert check == want_check
    assert torchrun[:torchrun.index("--rdzv_id")] == want_torchrun[:want_torchrun.index("--rdzv_id")]
    assert torchrun[torchrun.index("--rdzv_id") + 1] == "tsp-7b-128k-sky-1"


# ---- Kubeflow Trainer -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kube():
    docs = {d["kind"]: d for d in yaml.safe_load_all(KUBEFLOW.read_text())}
    assert set(docs) == {"TrainingRuntime", "TrainJob"}
    for doc in docs.values():
        assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    return docs


def _node_pod(runtime: dict) -> dict:
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node"
    assert job["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    return job["template"]["spec"]["template"]["spec"]


def test_kubeflow_trainjob_names_its_torch_runtime_and_the_recipes_world(kube, recipe):
    runtime, job = kube["TrainingRuntime"], kube["TrainJob"]
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "kind": "TrainingRuntime"}
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    trainer, policy = job["spec"]["trainer"], runtime["spec"]["mlPolicy"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (policy["numNodes"], policy["torch"]["numProcPerNode"])
    assert trainer["numNodes"] * trainer["numProcPerNode"] == recipe["world"] == 1024
    assert trainer["numProcPerNode"] % recipe["tsp"] == 0
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]
    assert [c["name"] for c in _node_pod(runtime)["containers"]] == ["node"]


def test_kubeflow_grace_period_covers_the_final_save_and_the_jobset_restarts(kube):
    """SIGTERM -> torchrun forwards it and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT for the ranks'
    checkpoint; Kubernetes SIGKILLs after terminationGracePeriodSeconds; the JobSet restarts."""
    runtime, trainer = kube["TrainingRuntime"], kube["TrainJob"]["spec"]["trainer"]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    pod = _node_pod(runtime)
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) + TEARDOWN_MARGIN_S <= pod["terminationGracePeriodSeconds"]
    assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] >= 1
    volume = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}["checkpoints"]
    assert "train.resume=auto" in trainer["command"][-1]
    assert re.search(r"train\.output_dir=(\S+)", trainer["command"][-1]).group(1).startswith(volume + "/")


def test_kubeflow_command_maps_the_torch_policys_environment_onto_torchrun(kube, recipe, tmp_path):
    trainer = kube["TrainJob"]["spec"]["trainer"]
    env = {e["name"]: e["value"] for e in trainer["env"] if e["name"] != "PYTHON"}
    command = [*trainer["command"][:-1], trainer["command"][-1].replace("cd /workspace/tsp_trainer &&", "")]
    check, torchrun = _run_command(
        tmp_path, command, **env, PET_NNODES=str(trainer["numNodes"]), PET_NODE_RANK="127",
        PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]), PET_MASTER_ADDR="tsp-7b-128k-node-0-0.tsp-7b-128k",
        PET_MASTER_PORT="29500")
    want_check, want_torchrun = _expected(128, 127, 8, "tsp-7b-128k-node-0-0.tsp-7b-128k:29500", recipe["world"])
    assert (check, torchrun) == (want_check, want_torchrun)
