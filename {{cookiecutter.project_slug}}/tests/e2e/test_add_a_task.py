"""Adding a task: the README's worked example ("Add your own task") written into a copy of the
package (its folder and its YAML, nothing else; beside a helper folder that is no task), then
trained from the command line; no file under ``core/`` changes, and its checkpoints name the new task."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import {{ cookiecutter.package_name }}

from ..conftest import {% if cookiecutter.tasks != "causal_lm" %}tiny_overrides{% else %}lm_overrides{% endif %}
from ..processes import subprocess_env

PACKAGE = Path({{ cookiecutter.package_name }}.__file__).parent
README = Path(__file__).resolve().parents[2] / "README.md"


def example_files() -> dict[str, str]:
    """The README section's code blocks, by the path their first line names."""
    section = README.read_text().split("## Add your own task", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", section, re.S)
    return {next(line[2:] for line in block.splitlines() if line.startswith("# src/")): block for block in blocks}


def digest(folder: Path) -> str:
    files = sorted(path for path in folder.rglob("*") if path.is_file() and "__pycache__" not in path.parts)
    return hashlib.sha256(b"".join(path.relative_to(folder).as_posix().encode() + path.read_bytes() for path in files)).hexdigest()


{% if cookiecutter.tasks != "causal_lm" -%}
def test_the_readme_example_task_trains_from_its_folder_and_yaml_alone(tokenizer_dir, toy_data, tmp_path):
    overrides = [o for o in tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run") if not o.startswith("task=")]
{%- else -%}
def test_the_readme_example_task_trains_from_its_folder_and_yaml_alone(lm_tokenizer_dir, lm_text, tmp_path):
    overrides = [o for o in lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "run") if not o.startswith("task=")]
{%- endif %}
    files = example_files()
    name = PACKAGE.name
    assert sorted(files) == [
        f"src/{name}/configs/task/smoothed.yaml",
        f"src/{name}/tasks/smoothed/__init__.py",
        f"src/{name}/tasks/smoothed/module.py",
    ]
    shutil.copytree(PACKAGE, tmp_path / "src" / name, ignore=shutil.ignore_patterns("__pycache__"))
    core = digest(tmp_path / "src" / name / "core")
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    (tmp_path / "src" / name / "tasks" / "helpers").mkdir()  # a folder the tasks share, with no TASK: not a task
    (tmp_path / "src" / name / "tasks" / "helpers" / "__init__.py").write_text('"""Helpers."""\n')
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "src"), env["PYTHONPATH"]])  # the copy, before the installed package
    command = [sys.executable, "-m", name, "train", "task=smoothed", *overrides, "debug=fdr", "logger=csv"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.json").is_file()
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["task"] == "smoothed"
    assert digest(tmp_path / "src" / name / "core") == core  # nothing under core/ was edited
