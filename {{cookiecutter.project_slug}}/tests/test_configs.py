"""Every config file composes and resolves; bad options fail with Hydra's or our clear error."""

from __future__ import annotations

import importlib.util
from importlib import resources

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

{% if cookiecutter.tasks != "causal_lm" %}from {{ cookiecutter.package_name }}.core.config.resolvers import to_plain
{% endif %}from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.tasks import check_config

from .conftest import compose_config

CONFIG_ROOT = resources.files("{{ cookiecutter.package_name }}") / "configs"
# Each task of this project, and a data config that task reads.
TASK_DATA = {
{%- if cookiecutter.tasks != "causal_lm" %}
    "classification": "vader_movie_reviews",
    "token_classification": "token_files",
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}
    "causal_lm": "shakespeare",
    "preference": "preference",
    "reward": "reward",
    "grpo": "prompts",
{%- endif %}
}
ENTRY_CONFIGS = ("train", "eval", "plan", "quantize"
{%- if cookiecutter.tasks != "causal_lm" %}, "predict"{% endif %}
{%- if cookiecutter.tasks != "classification" %}, "generate", "chat", "serve", "export"{% endif %})
# Groups merged into Hydra's own node, not ours: composed, not resolved.
HYDRA_GROUPS = ("hydra",)
# Options that need a CUDA GPU (and flash-attn): on a machine without one, validate_config must
# refuse them with this message instead of letting Lightning or transformers fail later.
HAS_CUDA = torch.cuda.is_available()
NEEDS_GPU = {
    ("precision", "16-mixed"): ("needs a CUDA GPU", HAS_CUDA),
    ("attention", "flash_attention_2"): ("pip install flash-attn", HAS_CUDA and importlib.util.find_spec("flash_attn") is not None),
    ("attention", "flex_attention"): ("trains on a CUDA GPU only", HAS_CUDA),
    ("experiment", "lm_llama31_8b_qlora_chat_64k"): ("trains on a CUDA GPU only", HAS_CUDA),  # (flex_attention)
    ("loss", "liger"): ("liger-kernel", HAS_CUDA and importlib.util.find_spec("liger_kernel") is not None),
    ("trainer", "fsdp"): ("CUDA GPU", torch.cuda.device_count() >= 2),
    ("trainer", "gpu"): ("needs a CUDA GPU", HAS_CUDA),
    ("trainer", "ddp"): ("CUDA GPU", torch.cuda.device_count() >= 2),
}


def every_group_option() -> list[tuple[str, str]]:
    """(group, option) for every YAML file below configs/, found by walking the tree."""
    options = []
    for path in sorted(CONFIG_ROOT.rglob("*.yaml")):
        relative = path.relative_to(CONFIG_ROOT)
        if len(relative.parts) > 1:
            options.append(("/".join(relative.parts[:-1]), relative.stem))
    return options


def test_the_walk_finds_every_group():
    groups = {group for group, _ in every_group_option()}
    assert {
        "task",
        "model",
        "data",
        "precision",
        "batch",
        "optimizer",
        "lr_schedule",
        "callbacks",
        "logger",
        "trainer",
        "paths",
        "hydra",
        "debug",
        "experiment",
    } <= groups


def task_contexts(group: str, option: str) -> list[list[str]]:
    """Overrides under which a group option may be used: as is, or with a task that reads it."""
    if group.startswith("hydra/sweeper/"):  # e.g. hydra/sweeper/sampler: a part of our sweeper's config
        return [["hydra/sweeper=resumable_optuna"]]
    if group == "task":
        return [[f"data={TASK_DATA[option]}"]]
    if group == "data":
        return [[f"task={task}"] for task in TASK_DATA] + ([["task=preference", "objective=kto"]] if "preference" in TASK_DATA else [])
    if group == "grpo":  # selected by configs/task/grpo.yaml
        return [["task=grpo", "data=prompts"]]
    if group == "objective":  # selected by configs/task/preference.yaml: no other task has the group
        return [["task=preference", "data=preference"], ["task=preference", "data=unpaired"]]  # (pairs; KTO's unpaired answers)
    return [[]] + [[f"task={task}", f"data={data}"] for task, data in TASK_DATA.items()]


def test_the_readme_configuration_table_lists_every_option_of_its_groups():
    """Each row of the README's configuration table names exactly the option files of its group
    (an option added without the README, or a README option that is gone, fails here)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| group | options |") :].split("\n\n")[0]
    listed: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        cells = row.split("|")
        group = cells[1].strip().strip("`")
        listed.setdefault(group, set()).update(re.findall(r"`([\w-]+)`", cells[2]))
    assert len(listed) > 15, listed
    for group, options in listed.items():
        files = {entry.name.removesuffix(".yaml") for entry in (CONFIG_ROOT / group).iterdir() if entry.name.endswith(".yaml")}
        assert options == files, f"README table, group {group}: lists {sorted(options)}, the folder holds {sorted(files)}"


@pytest.mark.parametrize(("group", "option"), every_group_option())
def test_every_config_file_composes_and_resolves(group, option, tmp_path):
    """Every option composes, resolves and validates, with at least one task of the project."""
    problems = []
    refused_here = (group, option) in NEEDS_GPU and not NEEDS_GPU[group, option][1]
    for context in task_contexts(group, option):
        cfg = compose_config("train", [f"paths.output_dir={tmp_path}", *context, f"{group}={option}"])
        if group.split("/")[0] in HYDRA_GROUPS:
            return
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        if refused_here:  # must be refused in every context, with the install/GPU message in one
            with pytest.raises(ConfigError) as error:
                check_config(cfg)
            problems.append(str(error.value))
            continue
        try:
            check_config(cfg)
            return
        except ConfigError as error:
            problems.append(f"{context}: {error}")
    if refused_here:
        assert any(NEEDS_GPU[group, option][0] in problem for problem in problems), problems
        return
    pytest.fail("\n".join(problems))


@pytest.mark.parametrize("config_name", ENTRY_CONFIGS)
def test_entry_configs_compose(config_name, tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"")
    required = {
        "train": [],
        "eval": [f"ckpt_path={ckpt}"],
        "predict": [f"ckpt_path={ckpt}", f"input={ckpt}"],
        "generate": [f"ckpt_path={ckpt}"],
        "chat": [f"ckpt_path={ckpt}"],
        "serve": [f"ckpt_path={ckpt}"],
        "export": [f"ckpt_path={ckpt}"],
        "plan": [],
        "quantize": [f"ckpt_path={ckpt}"],
    }
    cfg = compose_config(config_name, [f"paths.output_dir={tmp_path}", *required[config_name]])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    check_config(cfg, required=tuple(o.split("=")[0] for o in required[config_name]))
    assert cfg.task_name == config_name


def test_eval_requires_a_checkpoint(tmp_path):
    cfg = compose_config("eval", [f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"give exactly one of ckpt_path=.* or model_dir="):
        evaluate(cfg)


def test_the_default_precision_follows_the_machine_and_a_named_one_wins(tmp_path, monkeypatch):
    from {{ cookiecutter.package_name }}.core.memory.planner import for_the_card

    def precision(*overrides):
        return compose_config("train", [f"paths.output_dir={tmp_path}", *overrides]).trainer.precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision() == "32-true"  # a CPU: fp32, not bf16 autocast
    assert precision("precision=bf16-mixed") == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # an RTX 4090
    assert precision() == "bf16-mixed"  # a bf16 GPU
    assert precision("trainer=cpu") == "32-true"  # a GPU machine told to train on its CPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert precision() == "32-true"  # a GPU without native bf16 (a T4)
    assert precision("precision=16-mixed") == "16-mixed"
    card = compose_config("plan", [f"paths.output_dir={tmp_path}", "hardware=rtx4090_24gb"])
    assert for_the_card(card).trainer.precision == "bf16-mixed"  # plan: the hardware group's card, not this machine
    assert for_the_card(compose_config("plan", [f"paths.output_dir={tmp_path}", "hardware.bf16=false"])).trainer.precision == "16-mixed"
    named = compose_config("plan", [f"paths.output_dir={tmp_path}", "precision=32-true"])
    assert for_the_card(named) is named


def test_accumulation_is_derived_from_global_and_micro_batch(tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "batch.global_batch_size=64", "batch.micro_batch_size=16"])
    assert cfg.trainer.accumulate_grad_batches == 4
    assert cfg.data.batch_size == 16


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("trainer.accumulate_grad_batches=4", "batch.global_batch_size=64"),
        ("batch.accumulate_grad_batches=3", "batch.global_batch_size=48"),
        ("batch.device_batch_size=8", "batch.micro_batch_size=8"),
        ("data.batch_size=4", "batch.micro_batch_size=4"),
    ],
)
def test_a_derived_batch_key_set_by_hand_is_refused_with_the_batch_setting_it_meant(tmp_path, override, fix):
    """Set by hand, accumulation would stack on the batch group's and the global batch would be
    other than batch.global_batch_size says (4 x 16 = 64 samples a step instead of 16)."""
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "batch.global_batch_size=16", "batch.micro_batch_size=16", override])
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"{key}={value} is derived by the batch group .* fix: drop it and set {fix}"):
        check_config(cfg)


@pytest.mark.parametrize(
    "override",
    [
        "lr_schedule.warmup_ratio=1.5",
        "lr_schedule.min_lr_ratio=-1",
        "optimizer.weight_decay=-0.1",
        "data.val_fraction=1.5",
        "peft=lora peft.dropout=1.0",
        "optimizer.lr=0",
        "seed=abc",
        "optimizer.lr=nan",
        "optimizer.lr=inf",
        "optimizer.weight_decay=-inf",
        "trainer.gradient_clip_val=nan",
        "trainer.max_steps=0",
        "trainer.max_steps=-5",
        "trainer.max_steps=1.5",
        "trainer.max_epochs=0",
    ],
)
def test_every_out_of_range_value_is_refused_naming_field_value_and_a_fix(tmp_path, override):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", *override.split()])
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
    (line,) = [line for line in str(error.value).splitlines() if override.split()[-1].split("=")[0] in line]
    assert override.split()[-1].split("=")[1] in line and ("fix:" in line or "e.g." in line), line


def test_indivisible_global_batch_names_both_fields_and_a_fix(tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "batch.global_batch_size=30", "batch.micro_batch_size=8"])
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
    message = str(error.value)
    assert "batch.global_batch_size=30" in message and "batch.micro_batch_size=8" in message
    assert "batch.micro_batch_size=6" in message  # the suggested fix: the largest divisor <= 8


def test_validate_collects_every_problem_at_once(tmp_path):
    cfg = compose_config(
        "train",
        [
            f"paths.output_dir={tmp_path}",
            "batch.micro_batch_size=0",
            "optimizer.lr=-1",
            "lr_schedule.warmup_ratio=1.5",
            "data.text_column=",
            "seed=abc",
        ],
    )
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
    message = str(error.value)
    for field in ("batch.micro_batch_size", "optimizer.lr", "lr_schedule.warmup_ratio", "data.text_column", "seed"):
        assert field in message


def test_seed_zero_is_a_seed(tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "seed=0"])
    check_config(cfg)
    assert cfg.seed == 0


def test_unknown_key_is_rejected_by_name(tmp_path):
    with pytest.raises(ConfigCompositionException, match="max_epoch"):
        compose_config("train", [f"paths.output_dir={tmp_path}", "trainer.max_epoch=3"])


@pytest.mark.parametrize(
    ("override", "key", "valid"),
    [
        ("+callbacks.model_checkpoint.save_top=2", "callbacks.model_checkpoint.save_top", "save_top_k"),  # a _target_ node
        ("+optimizer.weight_decy=0.1", "optimizer.weight_decy", "weight_decay"),  # a node named from a table, with keys of ours
        ("+trainer.max_epoch=3", "trainer.max_epoch", "max_epochs"),
        ("+model.nme=tiny", "model.nme", "name_or_path"),  # a group without _target_: its declared keys
        ("+batch.micro_batch=4", "batch.micro_batch", "micro_batch_size"),
        ("+sed=3", "sed", "seed"),  # the top level
        ("+trainer.plugins.0.dirpath=x", "trainer.plugins[0].dirpath", "AtomicCheckpointIO"),  # inside a list
    ],
)
def test_a_misspelt_key_added_with_plus_names_itself_the_node_and_the_valid_keys(tmp_path, override, key, valid):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", override])
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
    line = next(line for line in str(error.value).splitlines() if key in line)
    assert f"{key} is not a key of" in line and valid in line, line


@pytest.mark.parametrize(
    ("overrides", "key", "valid"),
    [
{%- if cookiecutter.tasks != "causal_lm" %}
        (["model=tiny_bert", "+model.config.num_hiden_layers=3"], "model.config.num_hiden_layers", "num_hidden_layers"),
        (["+model.architecture.hiden_size=384"], "model.architecture.hiden_size", "hidden_size"),
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}
        (
            ["task=causal_lm", "data=text_files", "model=tiny_llama", "+model.config.rms_norm_epsilon=1e-5"],
            "model.config.rms_norm_epsilon",
            "rms_norm_eps",
        ),
        (["task=causal_lm", "data=text_files", "model=tiny_gpt2", "+model.config.n_embed=64"], "model.config.n_embed", "n_embd"),
{%- endif %}
    ],
)
def test_a_misspelt_field_of_a_transformers_config_is_refused(tmp_path, overrides, key, valid):
    """transformers' config classes keep any attribute: a misspelt one would be silently unused."""
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
    line = next(line for line in str(error.value).splitlines() if key in line)
    assert f"{key} is not a key of" in line and "did you mean" in line and valid in line, line


@pytest.mark.parametrize(
    ("config_name", "override", "expected"),
    [
        ("train", "+dtype=bfloat16", "dtype is not a key of the top level"),  # export's key, not train's
        ("eval", "+input=x.csv", "input is not a key of the top level"),  # predict's key, not eval's
        (
            "train",
            "callbacks.progress_bar=false",
            "callbacks.progress_bar=False: an entry is a config with a _target_, or null; fix: callbacks.progress_bar=null",
        ),
        (
            "train",
            "+callbacks.model_chekpoint.save_top_k=2",
            "callbacks.model_chekpoint has no _target_: did you mean callbacks.model_checkpoint?",
        ),
        ("train", "+model.config.hidden_dropout_prob=0.2", "model.config has no model_type"),
        ("train", "+trainer.logger=true", "trainer.logger is set by this project, not by the config"),
        ("train", "+optimizer.params=1", "optimizer.params is set by this project"),
        (
            "train",
            "optimizer.name=adamww",
            "optimizer.name='adamww' is not one of ['adamw', 'adamw_8bit', 'paged_adamw_8bit', 'sgd']: did you mean adamw?",
        ),
        ("train", "+optimizer._target_=torch.optim.AdamW", "optimizer names what it builds by name, not by a class path"),
        ("train", "model.fetch.kind=pip_wheel", "model.fetch.kind='pip_wheel' is not one of ["),
        ("train", "+model.fetch.requirment=x", "model.fetch.requirment is not a key of model.fetch: did you mean model.fetch.requirement?"),
        ("train", "~lr_schedule.decay", "lr_schedule.decay is missing (removed with ~?)"),
    ],
)
def test_stray_and_missing_keys_are_named_with_the_fix(tmp_path, config_name, override, expected):
    cfg = compose_config(config_name, [f"paths.output_dir={tmp_path}", override])
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
    assert expected in str(error.value), str(error.value)


def test_a_misspelt_key_in_an_experiment_file_is_refused(tmp_path):
    """``weight_decy: 0.1`` under ``optimizer:`` in a user's experiment YAML (on Hydra's search path)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text("# @package _global_\noptimizer:\n  weight_decy: 0.1\n")
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", f"hydra.searchpath=[file://{tmp_path}]", "experiment=typo"])
    with pytest.raises(ConfigError, match=r"optimizer.weight_decy is not a key of optimizer: did you mean optimizer.weight_decay\?"):
        check_config(cfg)


def test_an_old_group_name_selects_the_renamed_group_and_says_so(tmp_path):
    """``checkpointing`` and ``scheduler`` became ``activation_checkpointing`` and ``lr_schedule``; the
    old names select the new groups' files (on the command line and in a user's experiment file),
    and train/plan warn with the new spelling."""
    from hydra.core.hydra_config import HydraConfig

    from {{ cookiecutter.package_name }}.core.config.validate import config_warnings

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /checkpointing: full\n  - override /scheduler: cosine_warmup\n"
    )
    for overrides in (["checkpointing=full", "scheduler=cosine_warmup"], [f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"]):
        with initialize_config_module(version_base="1.3", config_module="{{ cookiecutter.package_name }}.configs"):
            cfg = compose("train", [f"paths.output_dir={tmp_path}", *overrides], return_hydra_config=True)
        assert cfg.activation_checkpointing.mode == "full" and cfg.lr_schedule.decay == "cosine", overrides
        assert "checkpointing" not in cfg and "scheduler" not in cfg
        HydraConfig.instance().set_config(cfg)
        try:
            warnings = config_warnings(cfg)
        finally:
            HydraConfig.instance().cfg = None
        assert "checkpointing=full is the deprecated name of activation_checkpointing=full" in " ".join(warnings), warnings
        assert "scheduler=cosine_warmup is the deprecated name of lr_schedule=cosine_warmup" in " ".join(warnings), warnings
        del cfg.hydra
        check_config(cfg)
    default = compose_config("train", [f"paths.output_dir={tmp_path}"])
    assert default.activation_checkpointing.mode == "none" and default.lr_schedule.decay == "linear"


def test_a_credential_on_the_command_line_is_refused_before_hydra_writes_anything():
    """A multirun's overrides land in Hydra's multirun.yaml before any job (and its config check) runs."""
    from {{ cookiecutter.package_name }}.core.run.entry import command_line_problems

    problems = command_line_problems(
        ["+logger.wandb.api_key=sk-abc123", "+data.url=https://me:hunter22@host/x", "+logger.wandb.api_key=${oc.env:KEY}", "seed=1,2"]
    )
    assert len(problems) == 2, problems
    assert problems[0].startswith("logger.wandb.api_key=*** is a credential typed into the config") and "sk-abc123" not in problems[0]
    assert "data.url='https://me:***@host/x' carries a password" in problems[1] and "hunter22" not in problems[1]


def test_a_key_under_an_old_group_name_is_refused_naming_the_new_key(tmp_path):
    """Hydra cannot forward ``scheduler.warmup_ratio=0.1`` to ``lr_schedule``: refused before
    anything composes (the command line) or loads (a ``scheduler:`` node in a YAML file)."""
    from {{ cookiecutter.package_name }}.core.run.entry import command_line_problems

    problems = command_line_problems(["scheduler.warmup_ratio=0.1", "+checkpointing.mode=full", "scheduler=constant"])
    assert len(problems) == 2, problems
    assert "scheduler.warmup_ratio=0.1: the scheduler group is now named lr_schedule" in problems[0]
    assert "fix: lr_schedule.warmup_ratio=0.1" in problems[0]
    assert "fix: activation_checkpointing.mode=full" in problems[1]
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\nscheduler:\n  warmup_ratio: 0.1\n")
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", f"hydra.searchpath=[file://{tmp_path}]", "experiment=old"])
    with pytest.raises(
        ConfigError, match=r"scheduler.warmup_ratio: the scheduler group is now named lr_schedule.*fix: lr_schedule.warmup_ratio"
    ):
        check_config(cfg)


def test_an_unknown_task_name_is_refused_with_the_tasks_there_are(tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "task.name=regression"])
    with pytest.raises(ConfigError, match=r"task.name='regression' is not one of this project's tasks \[.*\]; fix: task="):
        check_config(cfg)


def test_every_target_in_every_config_file_has_its_keys_checked():
    """Each ``_target_`` of the shipped configs, and each entry of the tables a config names by a
    word (optimizer.name, model.fetch.kind), takes named arguments only, or FORWARDS says where its
    ``**kwargs`` go: no node is left unchecked without being listed."""
    import importlib.util

    import yaml

    from {{ cookiecutter.package_name }}.core.config.keys import NAMED_NODES, accepted_keys
    from {{ cookiecutter.package_name }}.core.config.named import class_path_of

    def targets(node):
        if isinstance(node, dict):
            yield from ([node["_target_"]] if "_target_" in node else [])
            for value in node.values():
                yield from targets(value)
        elif isinstance(node, list):
            for value in node:
                yield from targets(value)

    found = {target for path in CONFIG_ROOT.rglob("*.yaml") for target in targets(yaml.safe_load(path.read_text()))}
    named = {class_path_of(table_of(), name) for _key, table_of, _how in NAMED_NODES.values() for name in table_of()}
    # (a single-task bake lacks the other task's fetcher module)
    found |= {path for path in named if importlib.util.find_spec(path.rsplit(".", 1)[0]) is not None}
    assert "torch.optim.AdamW" in found and "lightning.pytorch.Trainer" in found
    unchecked = [target for target in sorted(found) if not target.startswith("${") and not accepted_keys(target)[1]]
    assert unchecked == [], f"**kwargs targets with no entry in config_keys.FORWARDS: {unchecked}"


def test_unknown_group_option_lists_the_available_ones(tmp_path):
    with pytest.raises(MissingConfigException) as error:
        compose_config("train", [f"paths.output_dir={tmp_path}", "model=bert_huge"])
    available = "{% if cookiecutter.tasks == 'causal_lm' %}tiny_llama{% else %}tiny_bert{% endif %}"
    assert "bert_huge" in str(error.value) and available in str(error.value)
{%- if cookiecutter.tasks != "classification" %}


@pytest.mark.parametrize("data", ["shakespeare", "text_files", "chat", "vader_sft"])
def test_lm_data_with_the_classification_task_or_the_reverse_is_refused(tmp_path, data):
    {%- if cookiecutter.tasks == "both" %}
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "task=classification", f"data={data}"])
    with pytest.raises(ConfigError, match=r"data._target_=.*(TextDataModule|ChatDataModule).* is not a data module of task=classification"):
        check_config(cfg)
    {%- endif %}
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "task=causal_lm", f"data={data}", "peft=lora"])
    check_config(cfg)  # the right pairing passes
{%- endif %}
{%- if cookiecutter.tasks != "causal_lm" %}


def test_peft_with_the_classification_task_is_accepted_and_its_values_checked(tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "experiment=demo_classification", "peft=lora"])
    assert "peft" in cfg.task.module_args
    check_config(cfg)
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "experiment=demo_classification", "peft=lora", "peft.r=0"])
    with pytest.raises(ConfigError, match=r"peft.r=0 must be a positive integer"):
        check_config(cfg)


def test_sst2_recipe_maps_the_labelled_validation_split_to_test(tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "experiment=sst2_bert_base"])
    assert cfg.model.name_or_path == "bert-base-uncased"
    assert cfg.data.hub_name == "nyu-mll/glue" and cfg.data.hub_config == "sst2"
    assert cfg.data.splits.test == "validation" and cfg.data.splits.validation is None
    assert cfg.data.tokenizer == "bert-base-uncased"
{%- endif %}


def test_sequence_length_has_one_home(tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "data.max_length=77"])
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    assert resolved.count("max_length: 77") == 1


{%- if cookiecutter.tasks != "causal_lm" %}


def test_demo_data_config_defers_the_download_and_eval_can_drop_it(tmp_path, tokenizer_dir):
    import functools

    import hydra
    from transformers import AutoTokenizer

    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache", "experiment=demo_classification"])
    datamodule = hydra.utils.instantiate(cfg.data)
    assert isinstance(datamodule.fetch, functools.partial)  # called in prepare_data, not now
    assert not (tmp_path / "cache").exists()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    datamodule = hydra.utils.instantiate(to_plain(cfg.data), fetch=None, tokenizer=tokenizer, label2id={"negative": 0, "positive": 1})
    assert datamodule.fetch is None and datamodule.tokenizer is tokenizer
    assert datamodule.splits["test"] == f"{tmp_path}/cache/data/vader_movie_reviews/test.csv"
{%- endif %}
