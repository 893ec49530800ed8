"""No silent wrong results: a setting that would give a result other than the one asked for is
refused (field, value, fix) before anything loads, or honoured exactly; each right value is a test.

The task-specific kinds (chat masks, saved weights, tied outputs) sit beside their task's tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import configs
from {{ cookiecutter.package_name }}.core.config.validate import stopping_problems
from {{ cookiecutter.package_name }}.core.data.loading import load_split
from {{ cookiecutter.package_name }}.core.errors import ConfigError, DataError
from {{ cookiecutter.package_name }}.core.run.entry import command_line_problems
from {{ cookiecutter.package_name }}.tasks import check_config
from {{ cookiecutter.package_name }}.train import train

from .conftest import compose_config
from .processes import run_module


@pytest.fixture
def tiny_cfg(request):
    """``tiny_cfg(*overrides)``: a tiny offline train config of this project's task."""
{%- if cookiecutter.tasks != "causal_lm" %}
    return request.getfixturevalue("make_cfg")
{%- else %}
    return request.getfixturevalue("make_lm_cfg")
{%- endif %}


# ------------------------------------------------------------------------ stopping rules
def test_max_steps_binds_past_the_default_epochs(tiny_cfg, tmp_path):
    """2 batches an epoch, the default 3 epochs: 6 steps; ``trainer.max_steps=8`` runs 8 (Lightning
    alone stops at whichever limit comes first, and exited 0 after 6)."""
    cfg = tiny_cfg("trainer.limit_train_batches=2", "trainer.max_steps=8", "test_after_fit=false", "callbacks.progress_bar=null")
    check_config(cfg)
    assert cfg.trainer.max_epochs == -1
    train(cfg)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 8


def test_without_max_steps_the_default_epochs_end_the_run(tiny_cfg):
    cfg = tiny_cfg()
    assert (cfg.trainer.max_steps, cfg.trainer.max_epochs) == (-1, 3)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.max_steps=30", "trainer.max_epochs=2"],
        ["trainer.max_epochs=5", "trainer.max_steps=7"],
        ["debug=limit", "trainer.max_steps=30", "trainer.max_epochs=4"],
    ],
)
def test_max_steps_and_max_epochs_both_set_are_refused_naming_both_and_the_fix_runs(tiny_cfg, overrides):
    with pytest.raises(ConfigError) as error:
        check_config(tiny_cfg(*overrides))
    (line,) = [line for line in str(error.value).splitlines() if "max_steps" in line]
    assert "trainer.max_epochs=" in line and "fix:" in line
    steps = next(o for o in overrides if o.startswith("trainer.max_steps="))
    for fix in ("trainer.max_epochs=-1", "trainer.max_steps=-1"):  # both fixes the line names are accepted
        assert fix in line
        cfg = tiny_cfg(*overrides, fix)
        check_config(cfg)
        if fix == "trainer.max_epochs=-1":  # exactly the asked steps, no epoch limit
            assert (f"trainer.max_steps={cfg.trainer.max_steps}", cfg.trainer.max_epochs) == (steps, -1)


@pytest.mark.parametrize("epochs", ["-1", "null"])
def test_max_steps_with_no_epoch_limit_set_by_hand_is_accepted(tiny_cfg, epochs):
    check_config(tiny_cfg("trainer.max_steps=30", f"trainer.max_epochs={epochs}"))


@pytest.mark.parametrize("epochs", ["-1", "null", "0"])
def test_no_step_limit_needs_a_positive_number_of_epochs(tiny_cfg, epochs):
    with pytest.raises(ConfigError, match=rf"trainer.max_epochs={'None' if epochs == 'null' else epochs} must be a positive number"):
        check_config(tiny_cfg(f"trainer.max_epochs={epochs}"))


def shipped_groups(group: str) -> list[str]:
    folder = Path(configs.__file__).parent / group
    return sorted(path.stem for path in folder.glob("*.yaml"))


SHIPPED_STOPS = [f"debug={name}" for name in shipped_groups("debug")] + [f"experiment={name}" for name in shipped_groups("experiment")]


@pytest.mark.parametrize("choice", SHIPPED_STOPS)
def test_max_steps_alone_lifts_the_epochs_of_every_shipped_experiment_and_debug_group(choice):
    """An experiment's or a debug group's epochs are a default: ``trainer.max_steps=N`` alone runs
    N steps (docs/configuration.md's promise), and without it their own limit stands (epochs, or steps)."""
    stepped = compose_config("train", [choice, "trainer.max_steps=30"])
    assert stopping_problems(stepped.trainer) == []
    assert (stepped.trainer.max_steps, stepped.trainer.max_epochs) == (30, -1)
    plain = compose_config("train", [choice])
    assert stopping_problems(plain.trainer) == []
    limits = (plain.trainer.max_steps, plain.trainer.max_epochs)
    assert (limits[0] == -1 and limits[1] > 0) or (limits[0] > 0 and limits[1] == -1), limits  # one limit binds


# ----------------------------------------------------------- a Hub model on a machine without it
def test_a_hub_model_this_machine_cannot_have_is_one_line_before_anything_runs(tiny_cfg, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg = tiny_cfg("model.name_or_path=no-such-org/no-such-model", "model.config=null")
    with pytest.raises(ConfigError) as error:
        train(cfg)
    (line,) = str(error.value).splitlines()
    assert line.startswith("model.name_or_path='no-such-org/no-such-model' is not a folder on this machine nor in its Hugging Face cache")
    assert "(HF_HUB_OFFLINE is set); fix: on a machine with internet run `hf download no-such-org/no-such-model --local-dir" in line
    assert line.endswith("then model.name_or_path=models/no-such-model")
    assert not (tmp_path / "run").exists()  # nothing ran: no run folder, no tokenised data


def test_a_local_folder_or_a_reachable_hub_is_not_a_problem(tiny_cfg, tmp_path, monkeypatch):
    from {{ cookiecutter.package_name }}.core.run import hub

    monkeypatch.setattr(hub, "unreachable_reason", lambda: None)
    assert hub.hub_problems(tiny_cfg("model.name_or_path=no-such-org/no-such-model", "model.config=null")) == []
    monkeypatch.setattr(hub, "unreachable_reason", lambda: "no network")
    assert hub.hub_problems(tiny_cfg(f"model.name_or_path={tmp_path}", "model.config=null")) == []


# --------------------------------------------------------------------------- the terminal
def test_the_config_tree_is_saved_always_and_printed_only_with_print_config(tiny_cfg, tmp_path, capsys):
    from {{ cookiecutter.package_name }}.core.run.entry import print_config_tree

    cfg = tiny_cfg()
    assert cfg.print_config is False
    print_config_tree(cfg, tmp_path / "quiet.log", show=cfg.print_config)
    assert capsys.readouterr().out == "" and "CONFIG" in (tmp_path / "quiet.log").read_text()
    cfg = tiny_cfg("print_config=true")
    print_config_tree(cfg, tmp_path / "shown.log", show=cfg.print_config)
    assert "CONFIG" in capsys.readouterr().out


def test_the_results_show_each_figure_once_with_its_start_and_where_things_are():
    from {{ cookiecutter.package_name }}.core.callbacks.terminal import results_lines

    metrics = {
        "val/loss": 0.5,
        "val/loss_start": 2.0,
        "test/acc": 0.91234,
        "perf/tokens_per_sec": 5e3,
        "seconds": 12.0,
        "rows": {"train": 3},
    }
    lines = results_lines(metrics, [("metrics.json", "/run/metrics.json")])
    assert lines[0] == "results"
    assert [line.split()[0] for line in lines[1:]] == ["test/acc", "val/loss", "seconds", "metrics.json"]
    assert "0.9123" in lines[1] and "0.5  (start 2)" in lines[2] and lines[-1].endswith("/run/metrics.json")


def test_the_importance_plot_has_one_title(tmp_path, monkeypatch):
    import optuna

    from {{ cookiecutter.package_name }} import plot

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}", sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda trial: trial.suggest_float("lr", 1e-4, 1e-2) + trial.suggest_int("r", 1, 8), n_trials=6)
    titles = {}

    def keep_titles(fig, path):
        titles[path.name] = [(loc, fig.axes[0].get_title(loc=loc)) for loc in ("left", "center", "right") if fig.axes[0].get_title(loc=loc)]
        return path

    monkeypatch.setattr(plot, "save", keep_titles)
    plot.plot_study(f"sqlite:///{tmp_path / 'study.db'}", tmp_path / "plots")
    (only,) = titles["importances.png"]  # Optuna's own title and ours were drawn over each other
    assert only[1].startswith("Parameter importance (fANOVA)")


def test_a_plan_table_uses_a_unit_in_which_no_row_reads_zero():
    from {{ cookiecutter.package_name }}.core.memory.planner import table_unit

    assert table_unit([20 * 2**30, 3 * 2**30]) == ("GiB", 2**30)
    assert table_unit([2 * 2**20, 500 * 2**20, 0]) == ("MiB", 2**20)  # a tiny model: 0.00 GiB before
    assert table_unit([3 * 2**10]) == ("KiB", 2**10)


# ------------------------------------------------------------- bad values: field, value, fix
BAD_COMMAND_LINE = [
    ("trainer.max_steps=[1,", r"'trainer.max_steps=\[1,': the value of trainer.max_steps is not valid override syntax .*fix: quote"),
    ("data.text_column='unclosed", r"the value of data.text_column is not valid override syntax"),
    ("+optimizer.betas=[0.9,", r"the value of optimizer.betas is not valid"),
    ("hydra.run.dir={file}", r"hydra.run.dir='.*a_file' is a file, not a folder; fix: hydra.run.dir=<a folder path>"),
    ("paths.output_dir={file}", r"paths.output_dir='.*a_file' is a file, not a folder"),
]


@pytest.mark.parametrize(("arg", "expected"), BAD_COMMAND_LINE)
def test_a_bad_override_is_named_by_its_key(arg, expected, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    (problem,) = command_line_problems([arg.format(file=tmp_path / "a_file")])
    assert re.search(expected, problem), problem


def test_a_bad_command_line_exits_1_with_every_problem_before_hydra_runs(tmp_path):
    """Through the real entry point: Hydra's own parser message names no key, and a run folder
    that is a file was a FileExistsError traceback after composing."""
    (tmp_path / "a_file").write_text("not a folder")
    result = run_module("train", [arg.format(file=tmp_path / "a_file") for arg, _ in BAD_COMMAND_LINE], cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for _, expected in BAD_COMMAND_LINE:
        assert re.search(expected, result.stderr), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "logs").exists()


def test_command_line_problems_leave_valid_overrides_and_flags_alone(tmp_path):
    (tmp_path / "a_file").write_text("x")
    valid = ["-m", "--cfg", "job", "optimizer.lr=1e-3,3e-3", "data.text_column='a b'", f"hydra.run.dir={tmp_path}", "~logger", "+x.y=[1,2]"]
    assert command_line_problems(valid) == []


def test_a_folder_given_as_a_data_file_is_named_a_folder(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "part1.csv").write_text("text,label\nhi,a\n")
    with pytest.raises(DataError, match=r"data.splits.train='.*texts' is a folder, not a file; fix: .* \(it holds part1.csv\)"):
        load_split("train", str(tmp_path / "texts"), None, None, str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"^input='.*texts' is a folder"):  # predict's file is typed as input=
        load_split("predict", str(tmp_path / "texts"), None, None, str(tmp_path / "cache"))


{%- if cookiecutter.tasks != "causal_lm" %}


# ------------------------------------------------------- weights the base files do not hold
@pytest.fixture(scope="module")
def encoder_without_pooler(tmp_path_factory, tokenizer_dir) -> Path:
    """A "pretrained" tiny BERT folder saved without its pooler (as encoder checkpoints often are)."""
    from transformers import BertConfig, BertModel, BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(tokenizer_dir)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("encoder_without_pooler")
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("rows", "suffix", "expected"),
    [
        (
            [{"text": "a good film", "label": 1}, {"text": "a bad film", "label": "negative"}] * 4,
            ".jsonl",
            r"data.label_column='label' in data.splits.train='.*' holds values of mixed types \(int, str\), not one label per row; fix: every label",
        ),
        (
            [{"text": ["a", "good", "film"], "label": "positive"}, {"text": ["bad"], "label": "negative"}] * 4,
            ".parquet",
            r"data.text_column='text' in data.splits.train='.*' holds List\(.*\) values, not text; fix: one string per row",
        ),
        (
            [{"text": 7, "label": "positive"}, {"text": 3, "label": "negative"}] * 4,
            ".jsonl",
            r"data.text_column='text' .* holds Value\('int64'\) values, not text",
        ),
    ],
    ids=["mixed-label-types", "text-lists", "text-numbers"],
)
def test_columns_of_the_wrong_kind_are_refused_naming_field_file_and_fix(make_cfg, tmp_path, rows, suffix, expected):
    import json

    import pandas as pd

    path = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        pd.DataFrame(rows).to_parquet(path)
    with pytest.raises(DataError) as error:
        train(make_cfg(f"data.splits.train={path}", "~data.splits.validation", "callbacks.progress_bar=null"))
    assert re.search(expected, str(error.value)), str(error.value)


def test_predictions_for_10000_classes_are_joined_at_once_and_keep_the_input_cells():
    import warnings

    import pandas as pd

    from {{ cookiecutter.package_name }}.tasks.classification import prediction_frame

    rows = pd.DataFrame({"text": ["a", "b", "c"], "id": ["007", "1.50", "NA"]})
    names = [f"class{i}" for i in range(10_000)]
    probabilities = torch.softmax(torch.randn(3, len(names)), dim=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pandas' PerformanceWarning, once per inserted column before
        frame = prediction_frame(rows, probabilities, names)
    assert list(frame.columns[:3]) == ["text", "id", "predicted_label"] and frame.shape == (3, 3 + len(names))
    assert frame["id"].tolist() == ["007", "1.50", "NA"]
    assert frame["predicted_label"].tolist() == [names[i] for i in probabilities.argmax(dim=-1).tolist()]
    with pytest.raises(DataError, match=r"input has column\(s\) \['predicted_label'\] that predict writes; fix: rename"):
        prediction_frame(rows.assign(predicted_label="x"), probabilities, names)


def test_weights_the_base_lacks_are_saved_with_the_adapters_and_two_evals_agree(make_cfg, encoder_without_pooler, tmp_path):
    """LoRA on an encoder folder without pooler weights: the pooler (and the new head) are drawn
    at random when the base loads, so the adapter checkpoint keeps them; two evals of it agree
    exactly, and a checkpoint without them is refused instead of drawing them anew."""
    from {{ cookiecutter.package_name }}.eval import evaluate

    lora = [f"model.name_or_path={encoder_without_pooler}", "model.config=null", "peft=lora", "peft.r=4"]
    train(make_cfg(*lora, "trainer.max_epochs=1", "callbacks.progress_bar=null", "test_after_fit=false"))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    pooler = [key for key in checkpoint["state_dict"] if ".pooler." in key and "lora_" not in key]
    assert pooler, sorted(checkpoint["state_dict"])[:20]

    def evaluated(path: Path, folder: str) -> dict:
        return evaluate(make_cfg(*lora, f"ckpt_path={path}", f"paths.output_dir={tmp_path / folder}", config_name="eval"))

    first, second = evaluated(ckpt, "eval_1"), evaluated(ckpt, "eval_2")
    assert first["test/loss"] == second["test/loss"] and first["test/acc"] == second["test/acc"]

    for key in pooler:  # the format before: trained weights only
        del checkpoint["state_dict"][key]
    torch.save(checkpoint, tmp_path / "without_pooler.ckpt")
    with pytest.raises(ConfigError, match=r"would draw them at random.*pooler.*fix: retrain"):
        evaluated(tmp_path / "without_pooler.ckpt", "eval_3")
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}


# ------------------------------------------------------------ LoRA on a tied output layer
@pytest.fixture(scope="module")
def tied_lm_dir(lm_tokenizer_dir, tmp_path_factory) -> Path:
    """A "pretrained" tiny Llama whose lm_head shares the input embedding (tie_word_embeddings)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .conftest import tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    config = tiny_llama_config(
        len(tokenizer), tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tied_lm")
    model = AutoModelForCausalLM.from_config(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_lora_on_a_tied_output_layer_is_refused_before_the_weights_load(make_lm_cfg, tied_lm_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    cfg = make_lm_cfg(
        f"model.name_or_path={tied_lm_dir}", "model.config=null", "peft=lora", "peft.r=4", "peft.target_modules=[q_proj,lm_head]"
    )
    with pytest.raises(ConfigError, match=r"'lm_head' adapts the output layer 'lm_head', which shares its weight .* fix: drop 'lm_head'"):
        train(cfg)


def test_a_tied_model_exported_after_lora_scores_as_its_checkpoint(make_lm_cfg, tied_lm_dir, tmp_path):
    """Adapters on the other layers of a tied model: the merged export gives the checkpoint's logits."""
    from transformers import AutoModelForCausalLM

    from {{ cookiecutter.package_name }}.core.checkpoints.io import load_trained_module
    from {{ cookiecutter.package_name }}.export import export
    from {{ cookiecutter.package_name }}.tasks.causal_lm.module import CausalLMModule

    lora = [f"model.name_or_path={tied_lm_dir}", "model.config=null", "peft=lora", "peft.r=4", "callbacks.progress_bar=null"]
    train(make_lm_cfg(*lora, "trainer.max_steps=4", "optimizer.lr=1e-2", "callbacks.sample_generation=null"))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    export(
        make_lm_cfg(f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'exported'}", f"paths.output_dir={tmp_path / 'x'}", config_name="export")
    )
    module = load_trained_module(CausalLMModule, make_lm_cfg(*lora, config_name="export"), ckpt).eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    ids = module.tokenizer("the king speaks to a fool.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, module.model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("generation.max_new_tokens=0", "generation.max_new_tokens=0"),
        ("generation.max_new_tokens=-3", "generation.max_new_tokens=-3"),
        ("generation.top_p=0", "generation.top_p=0"),
        ("generation.temperature=0", "generation.temperature=0"),
        ("generation.batch_size=0", "generation.batch_size=0"),
    ],
)
def test_bad_generation_settings_are_refused_before_the_weights_load(make_lm_cfg, tmp_path, monkeypatch, override, field):
    from {{ cookiecutter.package_name }} import generate as entry

    monkeypatch.setattr(entry, "load_generator", lambda cfg: pytest.fail("the weights were loaded before the refusal"))
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "config.json").write_text("{}")
    cfg = make_lm_cfg(f"model_dir={tmp_path / 'exported'}", "prompts=[hello]", override, config_name="generate")
    with pytest.raises(ConfigError, match=rf"{re.escape(field)} must be .*fix:"):
        entry.generate(cfg)


def test_a_prompts_file_that_is_not_utf8_is_named_with_the_byte_and_the_fix(make_lm_cfg, tmp_path, monkeypatch):
    from {{ cookiecutter.package_name }} import generate as entry

    monkeypatch.setattr(entry, "load_generator", lambda cfg: pytest.fail("the weights were loaded before the refusal"))
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "config.json").write_text("{}")
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("café au lait\n".encode("latin-1"))
    cfg = make_lm_cfg(f"model_dir={tmp_path / 'exported'}", f"prompts_file={prompts}", config_name="generate")
    with pytest.raises(DataError, match=r"prompts_file=.* is not UTF-8 text \(byte 3: b'\\xe9'\); fix: re-encode it"):
        entry.generate(cfg)


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp16"])
def test_export_to_a_dtype_it_cannot_write_is_refused_before_the_checkpoint_is_read(make_lm_cfg, tmp_path, dtype):
    from {{ cookiecutter.package_name }}.export import export

    fake = tmp_path / "not_read.ckpt"
    fake.write_bytes(b"never unpickled")
    cfg = make_lm_cfg(f"ckpt_path={fake}", f"output_dir={tmp_path / 'out'}", f"dtype={dtype}", config_name="export")
    with pytest.raises(ConfigError, match=rf"dtype='{dtype}' is not one of \('float32', 'bfloat16', 'float16'\).*fix:"):
        export(cfg)
    assert not (tmp_path / "out").exists()
{%- endif %}
{%- if cookiecutter.tasks == "both" %}


# ------------------------------------------------------------ a checkpoint of the other task
def test_a_checkpoint_of_the_other_task_is_refused_naming_both_tasks(classifier_ckpt, make_cfg, make_lm_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.eval import evaluate
    from {{ cookiecutter.package_name }}.export import export

    train(make_lm_cfg("trainer.max_steps=2", "callbacks.sample_generation=null", "callbacks.progress_bar=null"))
    lm_ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"holds a model of task=causal_lm .* this config runs task=classification; fix: task=causal_lm"):
        evaluate(make_cfg(f"ckpt_path={lm_ckpt}", f"paths.output_dir={tmp_path / 'e1'}", config_name="eval"))
    classifier, _ = classifier_ckpt
    with pytest.raises(ConfigError, match=r"holds a classification model, which export does not write as format=hf .*fix: use it"):
        export(
            make_lm_cfg(
                f"ckpt_path={classifier}", f"output_dir={tmp_path / 'x'}", f"paths.output_dir={tmp_path / 'e2'}", config_name="export"
            )
        )
    # a checkpoint from before the task was stored: told by its settings
    checkpoint = torch.load(lm_ckpt, map_location="cpu", weights_only=True)
    del checkpoint["task"]
    torch.save(checkpoint, tmp_path / "older.ckpt")
    with pytest.raises(ConfigError, match=r"holds a model of task=another task \(its stored settings include loss\)"):
        evaluate(make_cfg(f"ckpt_path={tmp_path / 'older.ckpt'}", f"paths.output_dir={tmp_path / 'e3'}", config_name="eval"))
{%- endif %}
