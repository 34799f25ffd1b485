"""train.attention_kernel: the selection (pure, availability given), the pre-check of the
check-inputs phase, the route it makes, and the activation in torch's dispatcher (mocked)."""

import re

import pytest
import torch

from tsp_trainer.model import attention_kernel as ak
from tsp_trainer.model import attention_route
from tsp_trainer.model.attention_kernel import Choice, precheck_attention_kernel, select_attention_kernel

H100, A100, B200 = (9, 0), (8, 0), (10, 0)
ALL = frozenset({"fa2", "fa3", "fa4", "cudnn"})
TORCH_ONLY = frozenset({"fa2", "cudnn"})


def select(requested="auto", *, capability=H100, dtype="bf16", head_dim=128, gqa=True,
           available=ALL, needs_varlen=False, needs_prefix=True):
    return select_attention_kernel(requested, capability=capability, dtype=dtype, head_dim=head_dim,
                                   gqa=gqa, available=available, needs_varlen=needs_varlen,
                                   needs_prefix=needs_prefix)


def test_auto_on_h100_with_fa3_installed_takes_fa3():
    assert select() == Choice("fa3", "auto")


def test_auto_without_fa3_takes_fa4_then_fa2_and_says_why():
    choice = select(available=frozenset({"fa2", "fa4"}))
    assert choice.kernel == "fa4"
    assert "fa3 is not installed" in choice.reason
    choice = select(available=TORCH_ONLY)
    assert choice.kernel == "fa2"
    assert "fa3 is not installed" in choice.reason and "fa4 is not installed" in choice.reason


def test_auto_on_a100_skips_the_hopper_kernels_and_on_b200_takes_fa4():
    choice = select(capability=A100)
    assert choice.kernel == "fa2"
    assert "fa3 needs compute capability sm90 (Hopper), this GPU is sm80" in choice.reason
    assert select(capability=B200).kernel == "fa4"


def test_auto_in_fp32_or_wide_heads_runs_memory_efficient():
    assert select(dtype="fp32").kernel == "efficient"
    assert select(head_dim=512).kernel == "efficient"


def test_auto_never_picks_cudnn_and_fails_on_a_pre_ampere_gpu():
    assert select(needs_prefix=False).kernel == "fa3"
    with pytest.raises(ValueError, match=r"^train.attention_kernel=auto: no flash kernel runs here"):
        select(capability=(7, 5))


@pytest.mark.parametrize("requested, kwargs, message", [
    ("fa3", dict(available=TORCH_ONLY), "train.attention_kernel=fa3: fa3 is not installed (it needs "
                                        "flash_attn_interface"),
    ("fa4", dict(available=TORCH_ONLY), "train.attention_kernel=fa4: fa4 is not installed (it needs "
                                        "the flash-attn-4 package"),
    ("fa3", dict(capability=B200), "fa3 needs compute capability sm90 (Hopper), this GPU is sm100"),
    ("fa4", dict(capability=A100), "fa4 needs compute capability sm90 or sm100"),
    ("fa2", dict(dtype="fp32"), "train.attention_kernel=fa2: fa2 takes bf16 or fp16, train.dtype is fp32"),
    ("fa3", dict(head_dim=512), "fa3 takes head_dim <= 256, the model's is 512"),
    ("cudnn", dict(needs_prefix=True), "cudnn has no bottom-right causal call"),
    ("cudnn", dict(needs_prefix=False, needs_varlen=True), "cudnn has no varlen call "
                                                           "(data.document_masking needs it)"),
])
def test_a_forced_kernel_that_cannot_run_is_one_line_naming_the_key(requested, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        select(requested, **kwargs)
    assert "\n" not in str(err.value) and str(err.value).endswith("use auto or another kernel")


def test_forced_kernels_that_can_run_are_taken():
    assert select("fa2", capability=A100).kernel == "fa2"
    assert select("fa4").kernel == "fa4"
    assert select("fa3", needs_varlen=True).kernel == "fa3"
    cudnn = select("cudnn", needs_prefix=False)
    assert cudnn == Choice("cudnn", "train.attention_kernel, K/V heads expanded for GQA")


def test_cpu_takes_auto_and_refuses_a_forced_gpu_kernel():
    assert select(capability=None, dtype="fp32", available=frozenset()) == Choice("cpu", "CPU: SDPA's CPU kernels")
    with pytest.raises(ValueError, match=r"^train.attention_kernel=fa3: a CPU run has no fa3 kernel"):
        select("fa3", capability=None, available=frozenset())


def _precheck(requested, *, cuda=True, available=ALL, dtype="bf16", needs_prefix=True):
    precheck_attention_kernel(requested, cuda=cuda, dtype=dtype, head_dim=128, available=available,
                              needs_varlen=False, needs_prefix=needs_prefix)


def test_precheck_refuses_what_needs_no_cuda_context_and_leaves_the_capability_for_later():
    _precheck("auto")
    _precheck("auto", cuda=False, available=frozenset())
    _precheck("fa3")                                   # capability not read here
    with pytest.raises(ValueError, match="a CPU run has no fa4 kernel"):
        _precheck("fa4", cuda=False)
    with pytest.raises(ValueError, match="fa3 is not installed"):
        _precheck("fa3", available=TORCH_ONLY)
    with pytest.raises(ValueError, match="cudnn has no bottom-right"):
        _precheck("cudnn")


def test_the_setting_is_a_checked_choice_of_train():
    from tsp_trainer.config import load_config
    from tsp_trainer.config.validate import validate_config

    cfg = load_config("recipes/tiny_cpu.yaml", ["train.attention_kernel=fa3"])
    assert cfg.train.attention_kernel == "fa3"
    with pytest.raises(ValueError, match="train.attention_kernel"):
        validate_config(load_config("recipes/tiny_cpu.yaml", ["train.attention_kernel=fa5"]), 2)


def test_use_attention_kernel_activates_fa3_and_fa4_and_restores_fa2(monkeypatch):
    from torch.nn import attention

    calls, active = [], [None]
    monkeypatch.setattr(attention, "activate_flash_attention_impl",
                        lambda impl: (calls.append(("activate", impl)), active.__setitem__(0, impl)))
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: active[0])
    monkeypatch.setattr(attention, "restore_flash_attention_impl",
                        lambda: (calls.append(("restore",)), active.__setitem__(0, None)))
    attention_route.use_attention_kernel(Choice("fa3", "auto"))
    attention_route.use_attention_kernel(Choice("fa4", "auto"))
    attention_route.use_attention_kernel(Choice("fa2", "auto"))
    attention_route.use_attention_kernel(Choice("efficient", "auto"))
    assert calls == [("activate", "FA3"), ("activate", "FA4"), ("restore",)]


def test_the_cudnn_route_expands_kv_and_refuses_a_prefix_call():
    route = attention_route.sdpa_route("cuda", torch.bfloat16, gqa=True, head_dim=64, kernel="cudnn")
    assert (route.kernel, route.expand_kv) == ("cudnn", True)
    assert attention_route.sdpa_route("cuda", torch.float32, gqa=True, head_dim=64,
                                      kernel="cudnn").kernel == "efficient"
    assert attention_route.sdpa_route("cuda", torch.bfloat16, gqa=True, head_dim=64, kernel="fa3").kernel == "flash"
    assert attention_route.sdpa_route("cuda", torch.bfloat16, gqa=True, head_dim=64).kernel == "flash"
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="a query block of 4 against 8 keys needs a bottom-right"):
        route.segment(q, torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), gqa=False)


def test_installed_kernels_need_the_entry_points_torch_activates(monkeypatch, tmp_path):
    """A module of the right name is not enough: PyPI's flash_attn_interface 0.0.1 is an empty
    placeholder (no torch.ops.flash_attn_3), which must not count as FA3."""
    (tmp_path / "flash_attn_interface").mkdir()
    (tmp_path / "flash_attn_interface" / "__init__.py").write_text("name = 'placeholder'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = ak.installed_attention_kernels()
    assert "fa3" not in found and "fa4" not in found
    assert ("fa2" in found) == torch.backends.cuda.is_flash_attention_available()
    fake_fa4 = type("Module", (), {"_flash_attn_fwd": None, "_flash_attn_bwd": None})
    monkeypatch.setattr(ak, "_imports", lambda name: fake_fa4 if name == "flash_attn.cute.interface" else None)
    assert "fa4" in ak.installed_attention_kernels()


def test_check_inputs_refuses_a_forced_kernel_on_a_cpu_run_and_accepts_auto(monkeypatch):
    from tsp_trainer.config import load_config
    from tsp_trainer.run import inputs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^train.attention_kernel=fa4: a CPU run has no fa4 kernel"):
        inputs.check_inputs(load_config("recipes/tiny_cpu.yaml", ["train.attention_kernel=fa4"]), world_size=2)
    ak.check_run_attention_kernel(*_run(load_config("recipes/tiny_cpu.yaml", [])))


def test_check_inputs_on_a_gpu_machine_refuses_a_missing_kernel_without_touching_cuda(monkeypatch):
    from tsp_trainer.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ak, "installed_attention_kernels", lambda: TORCH_ONLY)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: pytest.fail("CUDA touched"))
    with pytest.raises(ValueError, match=r"^train.attention_kernel=fa3: fa3 is not installed"):
        ak.check_run_attention_kernel(*_run(load_config("recipes/tiny_cpu.yaml", ["train.attention_kernel=fa3"])))
    ak.check_run_attention_kernel(*_run(load_config("recipes/tiny_cpu.yaml", ["train.attention_kernel=fa2", "train.dtype=auto"])))


def test_the_trainers_selection_reads_the_devices_capability(monkeypatch):
    from tsp_trainer.config import load_config

    monkeypatch.setattr(ak, "installed_attention_kernels", lambda: ALL)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: A100)
    cfg, model_cfg = _run(load_config("recipes/tiny_cpu.yaml", ["train.dtype=bf16"]))
    choice = ak.run_attention_kernel(cfg, model_cfg, device=torch.device("cuda", 0))
    assert choice.kernel == "fa2" and "this GPU is sm80" in choice.reason
    assert ak.run_attention_kernel(cfg, model_cfg, device=torch.device("cpu")).kernel == "cpu"


def _run(cfg):
    return cfg, cfg.model.to_model_config()
