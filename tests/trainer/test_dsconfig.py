"""longspec.training.dsconfig: key checks, step planning and the DeepSpeed block built from trainer keys.

Pure functions on plain dicts; the defaults come from the real longspec/conf/config.yaml.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from longspec.training import dsconfig

CONFIG = Path(__file__).resolve().parents[2] / "longspec" / "conf" / "config.yaml"
TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "deepspeed"


def base_conf(**over) -> dict:
    conf = yaml.safe_load(CONFIG.read_text())
    conf.pop("defaults")
    conf.pop("hydra")
    conf.update(model_name_or_path="/t", train_file="/d.jsonl", output_dir="/o")
    conf["ds_cfg"] = {
        "train_micro_batch_size_per_gpu": conf["per_gpu_train_batch_size"],
        "gradient_accumulation_steps": conf["gradient_accumulation_steps"],
        "optimizer": {"type": "AdamW", "params": {"lr": conf["learning_rate"], "betas": conf["adam_betas"]}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_type": "linear"}},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    for key, value in over.items():
        node, *path = key.split("__")
        target = conf
        for part in [node, *path][:-1]:
            target = target[part]
        target[[node, *path][-1]] = value
    return conf


def build(conf, world=1, total=100, warmup=10, on_cpu=False, cpu_adam_error=None):
    return dsconfig.build_ds_config(conf, world_size=world, total_steps=total, warmup_steps=warmup,
                                    on_cpu=on_cpu, cpu_adam_error=cpu_adam_error)


# ----------------------------------------------------------------------------- key checks

def test_shipped_defaults_pass_the_key_check():
    assert dsconfig.check_config(base_conf()) == []


@pytest.mark.parametrize("key,value,needle", [
    ("max_steps", "abc", "max_steps must be a number"),
    ("max_steps", 2.5, "max_steps must be a whole number"),
    ("learning_rate", -1.0, "learning_rate"),
    ("precision", "fp8", "precision = 'fp8' is not one of"),
    ("data__on_bad_record", "ignore", "data.on_bad_record"),
    ("cross_attn_lag", 9, "cross_attn_lag = 9 is out of range"),
    ("force", "yes", "force must be true or false"),
    ("adam_betas", [0.9], "adam_betas"),
])
def test_wrong_type_or_range_names_the_key(key, value, needle):
    problems = dsconfig.check_config(base_conf(**{key: value}))
    assert any(needle in p for p in problems), problems


def test_unknown_key_gets_a_did_you_mean():
    conf = base_conf()
    conf["learning_rat"] = 1e-3
    conf["data"]["max_seq_lenght"] = 10
    problems = dsconfig.check_config(conf)
    assert "learning_rat: unknown key (did you mean learning_rate?)" in problems
    assert "data.max_seq_lenght: unknown key (did you mean data.max_seq_length?)" in problems


def test_all_problems_are_collected_at_once():
    problems = dsconfig.check_config(base_conf(max_steps="x", seed="y", precision="z"))
    assert len(problems) == 3


# ----------------------------------------------------------------------------- schedule

def test_plan_steps_max_steps_wins_and_warmup_proportion():
    conf = base_conf(max_steps=40, warmup_proportion=0.25)
    assert dsconfig.plan_steps(conf, batches_per_epoch=1000) == (40, 10)


def test_plan_steps_from_epochs_and_accumulation():
    conf = base_conf(max_steps=0, num_train_epochs=2, gradient_accumulation_steps=4, warmup_steps=3)
    assert dsconfig.plan_steps(conf, batches_per_epoch=10) == (5, 3)      # ceil(2 * 10 / 4)


def test_plan_steps_with_no_batches_is_an_error():
    with pytest.raises(dsconfig.ConfigError, match="no batch"):
        dsconfig.plan_steps(base_conf(max_steps=0), batches_per_epoch=0)


# ----------------------------------------------------------------------------- DeepSpeed block

def test_trainer_keys_fill_the_block():
    conf = base_conf(learning_rate=2e-4, gradient_accumulation_steps=8, per_gpu_train_batch_size=3,
                     max_grad_norm=0.5, adam_epsilon=1e-8, weight_decay=0.0)
    conf["ds_cfg"] = {}
    ds, notes = build(conf, world=4, total=77, warmup=7)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 8
    assert ds["train_batch_size"] == 3 * 8 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True, "fused": True}}
    assert ds["scheduler"]["type"] == "WarmupCosineLR"
    assert ds["scheduler"]["params"]["total_num_steps"] == 77
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 7
    assert ds["zero_optimization"] == {"stage": 1}
    assert notes == []


@pytest.mark.parametrize("path,value,needle", [
    (("optimizer", "params", "lr"), 1e-4, "ds_cfg.optimizer.params.lr = 0.0001 but learning_rate"),
    (("optimizer", "params", "betas"), [0.9, 0.999], "ds_cfg.optimizer.params.betas"),
    (("gradient_accumulation_steps",), 128, "ds_cfg.gradient_accumulation_steps = 128"),
    (("train_micro_batch_size_per_gpu",), 7, "per_gpu_train_batch_size"),
    (("scheduler", "params", "total_num_steps"), 5, "total_num_steps = 5"),
])
def test_a_hard_coded_value_that_differs_is_refused(path, value, needle):
    conf = base_conf()
    node = conf["ds_cfg"]
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    with pytest.raises(dsconfig.ConfigError) as err:
        build(conf)
    assert any(needle in p for p in err.value.problems), err.value.problems


def test_an_equal_hard_coded_value_is_accepted():
    conf = base_conf(learning_rate=5e-4)
    conf["ds_cfg"]["optimizer"]["params"]["lr"] = 0.0005
    ds, _ = build(conf)
    assert ds["optimizer"]["params"]["lr"] == 5e-4


@pytest.mark.parametrize("precision,fp16,bf16", [("bf16", False, True), ("fp16", True, False),
                                                  ("fp32", False, False)])
def test_precision_maps_to_one_block(precision, fp16, bf16):
    ds, _ = build(base_conf(precision=precision))
    assert ds["fp16"]["enabled"] is fp16 and ds["bf16"]["enabled"] is bf16
    if fp16:
        assert ds["fp16"]["loss_scale"] == 0           # dynamic loss scaling


def test_precision_contradicted_by_the_block_is_refused():
    conf = base_conf(precision="bf16")
    conf["ds_cfg"]["fp16"] = {"enabled": True}
    with pytest.raises(dsconfig.ConfigError, match="precision is the only precision setting"):
        build(conf)


def test_fp16_on_cpu_is_refused_with_the_alternatives():
    with pytest.raises(dsconfig.ConfigError, match="use precision=bf16 or precision=fp32 on CPU"):
        build(base_conf(precision="fp16"), on_cpu=True)


def test_global_batch_size_must_match_the_product():
    conf = base_conf(global_batch_size=64, per_gpu_train_batch_size=2, gradient_accumulation_steps=4)
    conf["ds_cfg"].pop("train_micro_batch_size_per_gpu")
    conf["ds_cfg"].pop("gradient_accumulation_steps")
    assert build(conf, world=8)[0]["train_batch_size"] == 64
    with pytest.raises(dsconfig.ConfigError, match="global_batch_size = 64"):
        build(conf, world=2)


def test_cpu_offload_falls_back_to_torch_adamw_when_cpu_adam_cannot_build():
    ds, notes = build(base_conf(), on_cpu=True, cpu_adam_error="no compiler")
    assert "offload_optimizer" not in ds["zero_optimization"]
    assert ds["optimizer"]["params"]["torch_adam"] is True
    assert len(notes) == 1 and "no compiler" in notes[0] and "torch.optim.AdamW" in notes[0]


def test_cpu_offload_kept_when_cpu_adam_builds_and_pinning_is_off_on_cpu():
    ds, notes = build(base_conf(), on_cpu=True)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert "torch_adam" not in ds["optimizer"]["params"]
    assert notes == []


def test_offload_device_none_means_no_offload():
    conf = base_conf()
    conf["ds_cfg"]["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    ds, _ = build(conf, on_cpu=True)
    assert "offload_optimizer" not in ds["zero_optimization"]
    assert ds["optimizer"]["params"]["torch_adam"] is True


def test_unknown_scheduler_or_optimizer_is_refused():
    conf = base_conf()
    conf["ds_cfg"]["scheduler"]["type"] = "OneCycle"
    conf["ds_cfg"]["optimizer"]["type"] = "Lamb"
    with pytest.raises(dsconfig.ConfigError) as err:
        build(conf)
    assert len(err.value.problems) == 2


@pytest.mark.parametrize("name", sorted(p.stem for p in TEMPLATES.glob("*.yaml")) if TEMPLATES.is_dir() else [])
def test_shipped_deepspeed_templates_build(name):
    """The templates' `${...}` lines point at trainer keys, so they never contradict them."""
    from omegaconf import OmegaConf

    text = (TEMPLATES / f"{name}.yaml").read_text()
    text = text.replace("{{offload_device}}", "cpu").replace("{{pin_memory}}", "true")
    conf = base_conf()
    root = OmegaConf.create({**{k: v for k, v in conf.items() if k != "ds_cfg"},
                             "ds_cfg": OmegaConf.create(yaml.safe_load(text))})
    conf = OmegaConf.to_container(root, resolve=True)
    ds, _ = build(conf, world=2, on_cpu=True)
    assert ds["optimizer"]["params"]["lr"] == conf["learning_rate"]
    assert ds["scheduler"]["params"]["total_num_steps"] == 100


def test_plan_steps_warmup_is_at_least_one_step():
    assert dsconfig.plan_steps(base_conf(max_steps=6, warmup_proportion=0.1), 100) == (6, 1)


def test_without_offload_a_gpu_run_takes_torch_fused_adamw_and_a_user_choice_stands():
    conf = base_conf()
    conf["ds_cfg"]["zero_optimization"].pop("offload_optimizer")
    ds, notes = build(conf, on_cpu=False)
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True
    assert notes == []
    cpu, _ = build(conf, on_cpu=True)           # torch's AdamW on the CPU, its default kernel
    assert cpu["optimizer"]["params"]["torch_adam"] is True and "fused" not in cpu["optimizer"]["params"]
    conf["ds_cfg"]["optimizer"] = {"type": "AdamW", "params": {"torch_adam": False}}
    own, _ = build(conf, on_cpu=False)          # DeepSpeed's FusedAdam, asked for by name
    assert own["optimizer"]["params"]["torch_adam"] is False and "fused" not in own["optimizer"]["params"]


def test_deepspeed_builds_torch_fused_adamw_from_that_block():
    """DeepSpeed itself turns the block into torch.optim.AdamW(fused=True) (its engine's own
    optimizer factory, not a copy of it): on CUDA nothing is compiled before the first step."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    conf = base_conf()
    conf["ds_cfg"]["zero_optimization"].pop("offload_optimizer")
    ds, _ = build(conf, on_cpu=False)
    params = dict(ds["optimizer"]["params"])
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)          # only its optimizer factory is used
    engine.zero_use_cpu_optimizer = lambda: False
    cls, kwargs = engine.get_optimizer_configuration(params, adam_w_mode=True)
    opt = cls([torch.nn.Parameter(torch.zeros(2))], **params, **kwargs)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True


def test_the_reduce_bucket_is_sized_to_the_draft_unless_the_block_sets_one():
    """DeepSpeed allocates reduce_bucket_size elements whatever the model (default 5e8: 1 GB in
    bf16, twice a 7B target's draft): the trainer asks for the draft's own count, up to that
    default; a size in ds_cfg stands, and ZeRO-0 gets none."""
    conf = base_conf()
    ds, _ = dsconfig.build_ds_config(conf, world_size=1, total_steps=100, warmup_steps=10, on_cpu=False,
                                     draft_trainable=259_000_000)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 259_000_000
    ds, _ = dsconfig.build_ds_config(conf, world_size=1, total_steps=100, warmup_steps=10, on_cpu=False,
                                     draft_trainable=900_000_000)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    conf["ds_cfg"]["zero_optimization"]["reduce_bucket_size"] = 2e8
    ds, _ = dsconfig.build_ds_config(conf, world_size=1, total_steps=100, warmup_steps=10, on_cpu=False,
                                     draft_trainable=259_000_000)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2e8
    conf = base_conf()
    conf["ds_cfg"]["zero_optimization"] = {"stage": 0}
    ds, _ = dsconfig.build_ds_config(conf, world_size=1, total_steps=100, warmup_steps=10, on_cpu=False,
                                     draft_trainable=259_000_000)
    assert "reduce_bucket_size" not in ds["zero_optimization"]
