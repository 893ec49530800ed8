"""What a user sees: a tiny ``train`` on a real 120-column pseudo-terminal prints a header, one
progress bar with room to draw, and one results table, in at most 40 lines (it printed 336)."""

from __future__ import annotations

import re

{% if cookiecutter.tasks != "causal_lm" -%}
from ..conftest import tiny_overrides
{%- else -%}
from ..conftest import lm_overrides
{%- endif %}
from ..processes import run_in_terminal, screen_lines, without_output_dir

MAX_LINES = 40


def test_a_tiny_train_fits_a_screen_with_a_visible_progress_bar_and_one_results_table(request, tmp_path):
{%- if cookiecutter.tasks != "causal_lm" %}
    tokenizer, data = request.getfixturevalue("tokenizer_dir"), request.getfixturevalue("toy_data")
    overrides = without_output_dir(tiny_overrides(tokenizer, data, tmp_path / "run")) + ["trainer.max_epochs=2"]
{%- else %}
    tokenizer, data = request.getfixturevalue("lm_tokenizer_dir"), request.getfixturevalue("lm_text")
    overrides = without_output_dir(lm_overrides(tokenizer, data, tmp_path / "run")) + ["trainer.max_steps=6"]
{%- endif %}
    run_dir = tmp_path / "run"
    overrides = [o for o in overrides if not o.startswith("logger=")] + ["logger=[csv,wandb]"]  # the default loggers
    code, output = run_in_terminal("train", [*overrides, f"hydra.run.dir={run_dir}"], columns=120)
    lines = screen_lines(output, columns=120)
    screen = "\n".join(lines)
    assert code == 0, screen
    # A printed command wraps over as many rows as its paths need (this test's tmp paths: ~10 rows):
    # a row that continues a full-width row is not counted.
    rows = [line for before, line in zip(["", *lines], lines) if len(before) < 120]
    assert len(rows) <= MAX_LINES, f"{len(rows)} lines:\n{screen}"
    # One header: run folder, model, data sizes, batch and precision, memory ("not planned" on a CPU).
    header = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in ("run", "model", "data", "batch", "memory")}
    assert set(header) == {"run", "model", "data", "batch", "memory"}, screen
    assert str(run_dir) in header["run"] and "parameters" in header["model"] and "train" in header["data"]
    assert "precision 32-true" in header["batch"] and header["memory"].endswith("not planned (CPU)")
    # The training bar has room to draw: at least 20 cells of bar on its line.
    assert any(re.search(r"Epoch \d+: +\d+%\|[█▏▎▍▌▋▊▉ ]{20,}\|", line) for line in lines), screen
    # One results table, with where the figures are and what to run next.
    assert lines.count("results") == 1
    assert re.search(rf"metrics.json +{re.escape(str(run_dir / 'metrics.json'))}", screen)
    assert "resume" in screen and "evaluate" in screen
    # Nothing of the noise: the config tree, Lightning's notices, third-party warnings, W&B's summary.
    for noise in ("CONFIG", "GPU available", "Seed set to", "Run summary", "Traceback", "torchao", "Warning", "LeafSpec"):
        assert noise not in screen, f"{noise!r} on screen:\n{screen}"
    assert "CONFIG" in (run_dir / "config_tree.log").read_text()  # the whole config is in the run folder
