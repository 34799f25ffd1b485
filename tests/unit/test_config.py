"""Config: schema, loading (strict, one-line errors naming the key) and cross-field validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tsp_trainer.config.load import config_to_yaml, load_config, save_resolved_config
from tsp_trainer.config.model import ModelConfig, model_config
from tsp_trainer.config.schema import ModelSection, TrainConfig
from tsp_trainer.config.validate import check_parallel_shapes, resolve_dp_degree, validate_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# World size each shipped recipe is meant for.
RECIPE_WORLD = {"base": 1, "tiny_cpu": 4, "tiny_longest_cpu": 4, "7b_128k_1024gpu": 1024}


def with_(cfg: TrainConfig, **changes) -> TrainConfig:
    """Copy of `cfg` with dotted keys changed (`train__steps=5` sets train.steps)."""
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        changed = dataclasses.replace(getattr(cfg, section), **{key: value})
        cfg = dataclasses.replace(cfg, **{section: changed})
    return cfg


def valid(**changes) -> TrainConfig:
    # tiny model, tsp 2, steps >= warmup: passes validate_config at world size 4
    base = with_(TrainConfig(), parallel__tsp_degree=2)
    return with_(base, **changes)


def raises(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert match in message, message
    assert "\n" not in message, message
    return message


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# Schema


def test_defaults_load_and_validate():
    assert load_config(None) == TrainConfig()
    validate_config(valid(), world_size=4)


def test_model_section_overrides_every_model_config_field():
    from tsp_trainer.config.model_source import FOLDER_ONLY

    names = {f.name for f in dataclasses.fields(ModelConfig)} - set(FOLDER_ONLY)
    assert names <= {f.name for f in dataclasses.fields(ModelSection)}


def test_model_section_applies_only_non_none_overrides():
    section = ModelSection(size="tiny", num_layers=3, rope_theta=500000.0)
    assert section.to_model_config() == model_config("tiny", num_layers=3, rope_theta=500000.0)
    assert ModelSection(size="7b").to_model_config() == model_config("7b")


def test_sections_are_frozen_and_to_dict_nests():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 5
    assert cfg.to_dict()["parallel"]["tsp_degree"] == 1


# ---------------------------------------------------------------------------------------------
# Loading


def test_dotlist_overrides_beat_recipe_beat_base(tmp_path):
    write(tmp_path, "base.yaml", "train:\n  steps: 10\n  grad_accum: 2\noptim:\n  lr: 0.1\n")
    recipe = write(tmp_path, "r.yaml", "base: base.yaml\ntrain:\n  steps: 20\n")
    cfg = load_config(recipe, ["train.steps=30", "parallel.tsp_degree=2", "data.eval_split=null"])
    assert (cfg.train.steps, cfg.train.grad_accum, cfg.optim.lr) == (30, 2, 0.1)
    assert cfg.parallel.tsp_degree == 2 and cfg.data.eval_split is None


def test_base_chain_is_relative_to_each_recipe(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path, "root.yaml", "train:\n  seed: 7\n")
    write(tmp_path, "sub/mid.yaml", "base: ../root.yaml\ntrain:\n  steps: 11\n")
    top = write(tmp_path, "top.yaml", "base: sub/mid.yaml\n")
    cfg = load_config(top)
    assert (cfg.train.seed, cfg.train.steps) == (7, 11)


def test_base_cycle_and_missing_base(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: a.yaml\n")
    raises("includes itself through 'base:'", load_config, tmp_path / "a.yaml")
    recipe = write(tmp_path, "c.yaml", "base: nope.yaml\n")
    message = raises("does not exist", load_config, recipe)
    assert "nope.yaml" in message and "c.yaml" in message


def test_unknown_key_suggests_the_nearest(tmp_path):
    raises("config key 'train.stpes' is not a known key (did you mean 'train.steps'?)",
           load_config, None, ["train.stpes=10"])
    recipe = write(tmp_path, "r.yaml", "train:\n  seq_len: 128\n")
    message = raises("config key 'train.seq_len' is not a known key (did you mean 'data.seq_len'?)",
                     load_config, recipe)
    assert "r.yaml" in message
    raises("config key 'train.zzz' is not a known key (known keys of 'train': steps",
           load_config, None, ["train.zzz=1"])


def test_wrong_types_name_key_value_and_type():
    raises("config key 'train.steps'='ten' must be an int", load_config, None, ["train.steps=ten"])
    raises("config key 'train.steps'=1.5 must be an int", load_config, None, ["train.steps=1.5"])
    raises("config key 'model.seed'=null must be an int", load_config, None, ["model.seed=null"])
    raises("config key 'logging.jsonl'=2 must be a bool", load_config, None, ["logging.jsonl=2"])
    raises("config key 'optim.lr'='fast' must be a number", load_config, None, ["optim.lr=fast"])
    raises("config key 'train'=5 must be a section", load_config, None, ["train=5"])
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0   # an int is a fine float


def test_yaml_bool_trap_in_a_string_field():
    message = raises("config key 'data.eval_split'=False must be a string or null", load_config, None,
                     ["data.eval_split=no"])
    assert "quote" in message


def test_choice_fields_list_the_choices():
    raises("config key 'train.dtype'='fp16' must be one of 'auto', 'fp32', 'bf16'",
           load_config, None, ["train.dtype=fp16"])
    raises("config key 'parallel.scheme'='ring' must be one of 'tsp'", load_config, None,
           ["parallel.scheme=ring"])
    raises("config key 'train.attention_gqa'='expanded' must be one of 'auto', 'native', 'fused'",
           load_config, None, ["train.attention_gqa=expanded"])


def test_file_errors_are_one_line(tmp_path):
    raises("config file", load_config, tmp_path / "missing.yaml")
    bad = write(tmp_path, "bad.yaml", "train:\n  steps: [1,\n")
    raises("is not valid YAML: ", load_config, bad)
    dup = write(tmp_path, "dup.yaml", "train:\n  steps: 1\n  steps: 2\n")
    raises("duplicate key", load_config, dup)
    listed = write(tmp_path, "list.yaml", "- a\n- b\n")
    raises("must hold a mapping", load_config, listed)
    raises("must look like section.key=value", load_config, None, ["train.steps"])


@pytest.mark.parametrize("text", ["", "\n\n", "# a recipe still to write\n# model: tiny\n"])
def test_empty_recipe_is_refused_not_trained_on_defaults(tmp_path, text):
    empty = write(tmp_path, "empty.yaml", text)
    message = raises(f"config file '{empty}' is empty (or only comments)", load_config, empty)
    assert "\n" not in message
    named = write(tmp_path, "recipe.yaml", "base: empty.yaml\ntrain:\n  steps: 2\n")
    raises("is empty (or only comments)", load_config, named)   # an empty base too


def test_interpolation_resolves_and_reports_its_key():
    cfg = load_config(None, ["logging.run_name=${train.output_dir}"])
    assert cfg.logging.run_name == "runs/default"
    raises("config key 'train.steps'='${nope}'", load_config, None, ["train.steps=${nope}"])


def test_round_trip_save_and_load(tmp_path):
    cfg = load_config(RECIPES / "7b_128k_8gpu_tp4xsp2.yaml", ["optim.eps=1e-10", "train.resume=none"])
    path = save_resolved_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(path) == cfg
    assert "tp_degree: 4" in config_to_yaml(cfg)
    assert "base" not in path.read_text().split("\n", 1)[1]   # the base chain is resolved away


# ---------------------------------------------------------------------------------------------
# Validation: single fields


@pytest.mark.parametrize("key,value", [("train__steps", 0), ("data__seq_len", -4),
                                       ("data__micro_batch_size", 0), ("checkpoint__keep_last", 0),
                                       ("parallel__head_buckets", 0), ("train__eval_every", -1),
                                       ("parallel__dp_degree", 0)])
def test_positive_ints(key, value):
    dotted = key.replace("__", ".")
    raises(f"{dotted}={value} must be an integer >= ", validate_config, valid(**{key: value}))


@pytest.mark.parametrize("key,value,rule", [("optim__lr", 0.0, "in (0, 1)"), ("optim__lr", 1e39, "in (0, 1)"),
                                            ("optim__lr", 1.0, "in (0, 1)"),
                                            ("model__init_std", 1e30, "in (0, 1)"),
                                            ("model__init_std", 1.0, "in (0, 1)"),
                                            ("optim__beta2", 1.0, "in [0, 1)"),
                                            ("optim__max_grad_norm", -1.0, ">= 0"),
                                            ("optim__eps", 0, "> 0")])
def test_float_ranges(key, value, rule):
    raises(f"{key.replace('__', '.')}={value!r} must be {rule}", validate_config, valid(**{key: value}))


def test_choices_when_built_in_python():
    raises("logging.wandb_mode='cloud' is not one of 'disabled', 'offline', 'online'",
           validate_config, valid(logging__wandb_mode="cloud"))
    raises("data.on_layout_change='ignore' is not one of", validate_config,
           valid(data__on_layout_change="ignore"))


def test_zero_stage():
    message = raises("zero.stage=3 with parallel.scheme='tsp': ZeRO-3 shards the weights over the "
                     "axis x dp, which only sp and ulysses leave whole", validate_config, valid(zero__stage=3))
    assert "use zero.stage 0, 1 or 2, or auto" in message and "\n" not in message
    raises("zero.stage=5 must be auto, 0, 1, 2 or 3", validate_config, valid(zero__stage=5))
    for stage in (1, 2, "auto"):
        validate_config(valid(zero__stage=stage))
    for scheme in ("sp", "ulysses"):
        validate_config(valid(zero__stage=3, parallel__scheme=scheme))
    validate_config(valid(zero__stage=0, train__nonfinite="stop"))
    raises("train.nonfinite='skip' needs zero.stage 1 or 2", validate_config, valid(zero__stage=0))


def test_optimizer_offload_needs_a_zero_partition():
    message = raises("zero.offload_optimizer='cpu' with zero.stage=0", validate_config,
                     valid(zero__stage=0, zero__offload_optimizer="cpu", train__nonfinite="stop"))
    assert "offloaded only under ZeRO 1, 2 or 3" in message and "\n" not in message
    assert "or zero.offload_optimizer='none'" in message
    for stage in (1, 2):
        validate_config(valid(zero__stage=stage, zero__offload_optimizer="cpu"))
    # ZeRO-3 (sp and ulysses, explicit or auto) with the optimizer offloaded: DeepSpeed's ZeRO-3 offload
    for scheme in ("sp", "ulysses"):
        for stage in (3, "auto"):
            validate_config(valid(zero__stage=stage, zero__offload_optimizer="cpu", parallel__scheme=scheme))
    # stage 3 where ZeRO-3 is not used is refused whether offloaded or not
    raises("zero.stage=3 with parallel.scheme='tsp'", validate_config,
           valid(zero__stage=3, zero__offload_optimizer="cpu"))
    raises("zero.offload_optimizer='nvme' is not one of 'none', 'cpu'", validate_config,
           valid(zero__offload_optimizer="nvme"))


def test_model_errors_name_model_keys():
    raises("model.size='13b' is not a known size", validate_config, valid(model__size="13b"))
    raises("model.hidden_size=102 must be divisible by model.num_heads=4", validate_config,
           valid(model__hidden_size=102))


# ---------------------------------------------------------------------------------------------
# Validation: parallel shapes


def test_tsp_degree_must_divide_kv_heads_with_allowed_list():
    cfg = valid(model__num_heads=16, model__num_kv_heads=8, model__hidden_size=256,
                model__intermediate_size=512, parallel__tsp_degree=3)
    raises("parallel.tsp_degree=3 and model.num_kv_heads=8 divide neither way (K/V heads are split over "
           "the D ranks, or each copied on D / num_kv_heads ranks when fewer); use one of 1, 2, 4, 8, 16",
           validate_config, cfg)


@pytest.mark.parametrize("field,value", [("intermediate_size", 130)])
def test_tsp_degree_must_divide_mlp_and_vocab(field, value):
    raises(f"parallel.tsp_degree=4 does not divide model.{field}={value}", validate_config,
           valid(parallel__tsp_degree=4, model__num_kv_heads=4, **{f"model__{field}": value}))


def test_zigzag_needs_2d_to_divide_seq_len():
    raises("data.seq_len=100 is not divisible by 2 x parallel.tsp_degree = 8", validate_config,
           valid(parallel__tsp_degree=4, model__num_kv_heads=4, data__seq_len=100))


def test_sequence_rule_per_scheme():
    tiny = model_config("tiny", num_kv_heads=4)
    check_parallel_shapes(tiny, scheme="tp_sp", degree=4, seq_len=12)   # contiguous: D | seq_len
    raises("data.seq_len=10 is not divisible by parallel.tsp_degree=4", check_parallel_shapes, tiny,
           scheme="tp_sp", degree=4, seq_len=10)
    check_parallel_shapes(tiny, scheme="tp", degree=4, seq_len=10)      # TP keeps whole sequences
    check_parallel_shapes(tiny, scheme="sp", degree=3, seq_len=12)      # SP replicates the weights
    check_parallel_shapes(tiny, scheme="tsp", degree=4, seq_len=None)   # no sequence rule when unknown


def test_head_buckets():
    cfg = valid(model__num_kv_heads=4, parallel__head_buckets=3)
    raises("parallel.head_buckets=3 does not divide model.num_kv_heads / parallel.tsp_degree = 4 / 2 = 2",
           validate_config, cfg)
    validate_config(valid(model__num_kv_heads=4, parallel__head_buckets=2))
    raises("parallel.head_buckets=2 is only used by parallel.scheme='tsp'", validate_config,
           valid(parallel__scheme="tp", parallel__head_buckets=2))


def test_attention_chunk_tokens():
    """parallel.attention_chunk_tokens: auto (default) or a count >= 1, TSP's only."""
    assert TrainConfig().parallel.attention_chunk_tokens == "auto"
    validate_config(valid(parallel__attention_chunk_tokens=3))
    validate_config(valid(parallel__scheme="tp"))
    raises("parallel.attention_chunk_tokens=0 must be an integer >= 1", validate_config,
           valid(parallel__attention_chunk_tokens=0))
    raises("parallel.attention_chunk_tokens=4 with parallel.scheme='tp': only parallel.scheme='tsp' "
           "gathers K/V in chunks; set parallel.attention_chunk_tokens=auto", validate_config,
           valid(parallel__scheme="tp", parallel__attention_chunk_tokens=4))


def test_tsp_recompute():
    """parallel.tsp_recompute: auto (default), full or selective; selective is TSP's, and refused
    with a whole-layer checkpoint or activation offload (each with the reason and what to set);
    auto takes either (plan/auto.py chooses a mode the rules allow)."""
    assert TrainConfig().parallel.tsp_recompute == "auto"
    validate_config(valid(parallel__scheme="tp", train__activation_checkpointing="auto"))
    validate_config(valid(parallel__tsp_recompute="selective", train__activation_checkpointing="auto"))
    validate_config(valid(parallel__tsp_recompute="selective"))
    raises("config key 'parallel.tsp_recompute'='partial' must be one of 'auto', 'full', 'selective', 'none'",
           load_config, None, ["parallel.tsp_recompute=partial"])
    raises("parallel.tsp_recompute='partial' is not one of 'auto', 'full', 'selective', 'none'", validate_config,
           valid(parallel__tsp_recompute="partial"))
    raises("parallel.tsp_recompute='selective' with parallel.scheme='tp': only parallel.scheme='tsp' "
           "recomputes by shard; set parallel.tsp_recompute=full", validate_config,
           valid(parallel__scheme="tp", parallel__tsp_recompute="selective"))
    validate_config(valid(parallel__scheme="tp", parallel__tsp_recompute="full"))
    message = raises("parallel.tsp_recompute='selective' with train.activation_checkpointing=true",
                     validate_config, valid(parallel__tsp_recompute="selective",
                                            train__activation_checkpointing=True))
    assert "recomputes the whole layer" in message and "set parallel.tsp_recompute=full" in message
    message = raises("parallel.tsp_recompute='selective' with train.offload_activations=true",
                     validate_config, valid(parallel__tsp_recompute="selective",
                                            train__offload_activations=True))
    assert "not offloaded" in message
    validate_config(valid(train__activation_checkpointing=True, train__offload_activations=True))


def test_tsp_recompute_none_is_refused_where_selective_is():
    """parallel.tsp_recompute=none (selective's kept attention + the MLP's gate/up) is TSP's and
    gets selective's refusals, each naming the value, the rule and what to set; unknown values
    list all three."""
    validate_config(valid(parallel__tsp_recompute="none"))
    assert load_config(None, ["parallel.tsp_recompute=none"]).parallel.tsp_recompute == "none"
    raises("config key 'parallel.tsp_recompute'='partial' must be one of 'auto', 'full', 'selective', 'none'",
           load_config, None, ["parallel.tsp_recompute=partial"])
    raises("parallel.tsp_recompute='none' with parallel.scheme='sp': only parallel.scheme='tsp' "
           "recomputes by shard; set parallel.tsp_recompute=full", validate_config,
           valid(parallel__scheme="sp", parallel__tsp_recompute="none"))
    message = raises("parallel.tsp_recompute='none' with train.activation_checkpointing=true",
                     validate_config, valid(parallel__tsp_recompute="none",
                                            train__activation_checkpointing=True))
    assert "MLP gate/up pre-activations none keeps" in message
    assert "recomputes the whole layer" in message and "set parallel.tsp_recompute=full" in message
    message = raises("parallel.tsp_recompute='none' with train.offload_activations=true",
                     validate_config, valid(parallel__tsp_recompute="none",
                                            train__offload_activations=True))
    assert "not offloaded" in message and "train.offload_activations=false" in message
    assert "\n" not in message


def test_tp_x_sp_axes():
    seven = model_config("7b")
    kw = dict(scheme="tp_x_sp", degree=8, seq_len=131072)
    raises("needs parallel.tp_degree and parallel.sp_degree", check_parallel_shapes, seven, **kw)
    raises("parallel.tp_degree x parallel.sp_degree = 4 x 4 = 16 is not parallel.tsp_degree=8",
           check_parallel_shapes, seven, **kw, tp_degree=4, sp_degree=4)
    raises("parallel.tp_degree=3 and model.num_kv_heads=32 divide neither way", check_parallel_shapes, seven,
           scheme="tp_x_sp", degree=6, seq_len=131072, tp_degree=3, sp_degree=2)
    raises("data.seq_len=12 is not divisible by 2 x parallel.sp_degree = 8", check_parallel_shapes,
           seven, scheme="tp_x_sp", degree=8, seq_len=12, tp_degree=2, sp_degree=4)
    raises("parallel.tp_degree=4 is only used by parallel.scheme='tp_x_sp'", check_parallel_shapes,
           seven, scheme="tsp", degree=8, seq_len=131072, tp_degree=4)


def test_unknown_scheme_in_check_parallel_shapes():
    raises("parallel.scheme='ring' is not one of", check_parallel_shapes, model_config("tiny"),
           scheme="ring", degree=2, seq_len=256)


# ---------------------------------------------------------------------------------------------
# Validation: world size, batch, schedule, paths


def test_world_size_rules():
    raises("world size 6 is not dp_degree x tsp_degree = 2 x 4", resolve_dp_degree,
           valid(parallel__tsp_degree=4, parallel__dp_degree=2).parallel, 6)
    raises("world size 6 is not divisible by parallel.tsp_degree=4", validate_config,
           valid(parallel__tsp_degree=4, model__num_kv_heads=4), world_size=6)
    assert resolve_dp_degree(valid().parallel, 4) == 2
    assert resolve_dp_degree(valid(parallel__dp_degree=3).parallel, None) == 3


def test_global_batch_size_matches_micro_accum_dp():
    cfg = valid(train__global_batch_size=8, train__grad_accum=2)   # 2 x 2 x dp
    validate_config(cfg, world_size=4)
    raises("train.global_batch_size=8 is not data.micro_batch_size x train.grad_accum x dp_degree = "
           "2 x 2 x 1 = 4", validate_config, cfg, world_size=2)
    raises("train.global_batch_size=6 is not a multiple of", validate_config,
           valid(train__global_batch_size=6, train__grad_accum=2))


def test_schedule_rules():
    raises("data.seq_len=2048 exceeds model.max_seq_len=1024", validate_config,
           valid(data__seq_len=2048))
    raises("optim.min_lr=0.01 is above optim.lr=0.001", validate_config,
           valid(optim__lr=1e-3, optim__min_lr=1e-2))
    raises("optim.warmup_steps=200 exceeds train.steps=100", validate_config,
           valid(optim__warmup_steps=200))
    raises("train.eval_every=10 needs data.eval_split", validate_config,
           valid(train__eval_every=10, data__eval_split=None))


def test_resume_and_init_paths(tmp_path):
    raises("train.resume='/no/such/ckpt' is not 'none', 'auto' or an existing checkpoint path",
           validate_config, valid(train__resume="/no/such/ckpt"))
    validate_config(valid(train__resume=str(tmp_path)))
    validate_config(valid(train__resume="auto"))
    raises("model.init_from='/no/such/llama' is not an existing folder", validate_config,
           valid(model__init_from="/no/such/llama"))


# ---------------------------------------------------------------------------------------------
# Shipped recipes


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_load_and_validate(recipe, tmp_path):
    cfg = load_config(recipe)
    if cfg.model.init_from is not None:      # a placeholder the user edits: stand in a folder
        with pytest.raises(ValueError, match=f"model.init_from='{cfg.model.init_from}' is not an existing folder"):
            validate_config(cfg, world_size=RECIPE_WORLD.get(recipe.stem, 8))
        cfg = load_config(recipe, [f"model.init_from={_llama31_folder(tmp_path)}"])
        assert cfg.model.to_model_config().rope_scaling.rope_type == "llama3"
    validate_config(cfg, world_size=RECIPE_WORLD.get(recipe.stem, 8))


def _llama31_folder(path: Path) -> Path:
    """Llama-3.1-8B's config.json (no weights) and the bundled tokenizer, as a stand-in folder."""
    import json
    import shutil

    from tests.helpers.hf_models import LLAMA31_8B

    (path / "config.json").write_text(json.dumps(LLAMA31_8B))
    for f in (RECIPES.parent / "data" / "tokenizer").iterdir():
        shutil.copy(f, path / f.name)
    return path


def test_expected_recipes_are_shipped():
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert names >= {"base", "tiny_cpu", "7b_128k_8gpu", "7b_128k_1024gpu", "7b_128k_8gpu_tp",
                     "7b_128k_8gpu_tp_sp", "7b_128k_8gpu_sp", "7b_128k_8gpu_tp4xsp2",
                     "llama3_8b_128k_continue"}


def test_tiny_cpu_recipe_shape():
    cfg = load_config(RECIPES / "tiny_cpu.yaml")
    assert resolve_dp_degree(cfg.parallel, 4) == 2
    assert (cfg.train.dtype, cfg.zero.stage, cfg.logging.wandb_mode) == ("fp32", "auto", "disabled")
    assert cfg.optim.beta2 == 0.95   # from base.yaml


def test_1024gpu_recipe_refuses_the_wrong_world():
    cfg = load_config(RECIPES / "7b_128k_1024gpu.yaml")
    assert cfg.train.global_batch_size == 128 and cfg.data.seq_len == 131072
    raises("world size 512 is not dp_degree x tsp_degree = 128 x 8", validate_config, cfg, world_size=512)



def test_zero_stage_auto_resolves_by_scheme():
    """zero.stage auto: ZeRO-3 over every rank where the axis' ranks hold the same weights (sp,
    ulysses), ZeRO-1 over dp where the axis shards them; an explicit stage stays."""
    from tsp_trainer.config import resolve_config

    for scheme, stage in (("tsp", 1), ("tp_sp", 1), ("sp", 3), ("ulysses", 3)):
        assert resolve_config(valid(parallel__scheme=scheme), world_size=4, cuda=False).zero.stage == stage
    assert resolve_config(valid(parallel__scheme="sp", zero__stage=1), world_size=4, cuda=False).zero.stage == 1
