"""Bake the template and check what comes out.

The default bake (``tasks=both``) is installed (non-editable, from its own pyproject.toml) into
this environment and its whole test suite runs, both real-data demos included.  The
single-task bakes hold none of the other task's files, import every module, resolve every
``_target_``, compose every config and run one ``fast_dev_run``.  Bakes with awkward names compose their configs, import, and run one
``fast_dev_run``.  Names that cannot become a Python package are refused by the
pre-generation hook, and nothing is generated.
"""

from __future__ import annotations

import keyword
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
UNRENDERED = re.compile(r"\{\{\s*cookiecutter|\{%|cookiecutter\.")


def bake(output_dir: Path, **context: str) -> Path:
    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output_dir), extra_context=context))


def run(command: list[str], cwd: Path, timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def package_of(project: Path) -> str:
    (package,) = [p.name for p in (project / "src").iterdir() if p.is_dir() and p.name != "hydra_plugins"]
    return package


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    """The default bake, installed with its dependencies (as a user would: pip install .)."""
    project = bake(tmp_path_factory.mktemp("default"))
    run([sys.executable, "-m", "pip", "install", "--quiet", f"{project}[dev]"], cwd=project, timeout=1500)
    return project


def test_default_bake_renders_every_file(default_project):
    files = [p for p in default_project.rglob("*") if p.is_file()]
    leftovers = [str(p) for p in files if UNRENDERED.search(p.read_text(errors="ignore")) or "cookiecutter" in str(p)]
    assert not leftovers
    workflow = (default_project / ".github" / "workflows" / "ci.yml").read_text()
    assert "${{ matrix.python-version" in workflow  # GitHub's own interpolation survives
    batch = (default_project / "src" / "my_4090_project" / "configs" / "batch" / "default.yaml").read_text()
    assert "${accumulate:${.global_batch_size},${.micro_batch_size}," in batch  # so does Hydra's


def test_default_bake_yaml_and_toml_parse(default_project):
    for path in default_project.rglob("*.y*ml"):
        yaml.safe_load(path.read_text())
    project = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]
    assert project["name"] == "my_4090_project"
    assert set(project["scripts"]) == {f"my_4090_project-{name}" for name in ("train", "eval", "plan", "doctor", "plot", "predict", "generate", "export")}
    assert all(">=" in dep and "==" not in dep for dep in project["dependencies"])  # lower bounds, no pins


def test_installed_console_script_finds_its_configs(default_project, tmp_path):
    # Run from an unrelated folder: the configs must come from the installed package.
    script = Path(sys.executable).with_name("my_4090_project-train")
    result = run([str(script), "--cfg", "job", "model=tiny_bert", "experiment=demo_classification"], cwd=tmp_path, timeout=300)
    assert "accumulate_grad_batches" in result.stdout and "tiny_bert" not in result.stdout
    assert not (tmp_path / "logs").exists()


def test_default_bake_full_test_suite_with_the_real_demo(default_project):
    """The generated project's own tests, all of them, including the real-data demo."""
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=default_project, timeout=1800)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary), summary
    for word in ("failed", "skipped", "deselected", "error"):  # the real-data demo ran too
        assert word not in summary, summary


# What only one task uses: none of it may be left in a project generated for the other task.
TASK_MARKERS = {
    "classification": ("SequenceClassificationModule", "ClassificationDataModule", "vader", "predict.py"),
    "causal_lm": ("CausalLMModule", "TextDataModule", "LoraConfig", "shakespeare", "gguf", "generate.py", "export.py"),
}


@pytest.mark.parametrize("tasks", ["classification", "causal_lm"])
def test_single_task_bake_holds_only_its_task_and_its_tests_pass(tasks, default_project, tmp_path):
    project = bake(tmp_path, project_name=f"only {tasks}", tasks=tasks)
    package = package_of(project)
    other = "causal_lm" if tasks == "classification" else "classification"
    code = [p for p in project.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".toml") and ".pytest_cache" not in p.parts]
    for path in code:
        text = path.read_text()
        leaked = [marker for marker in TASK_MARKERS[other] if marker in text or marker in path.name]
        assert not leaked, f"{path.relative_to(project)} mentions {leaked}"
    for marker in TASK_MARKERS[tasks][:2]:  # its own task is there
        assert any(marker in path.read_text() for path in code), marker
    scripts = set(tomllib.loads((project / "pyproject.toml").read_text())["project"]["scripts"])
    assert (f"{package}-predict" in scripts) == (tasks == "classification")
    assert (f"{package}-generate" in scripts) == (tasks == "causal_lm")
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    # Every module imports, and every _target_ of every config names something that exists.
    check = (
        "import importlib, pathlib, pkgutil, yaml, hydra\n"
        f"import {package}\n"
        f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'): importlib.import_module(m.name)\n"
        f"root = pathlib.Path({package}.__file__).parent / 'configs'\n"
        "def targets(node):\n"
        "    if isinstance(node, dict):\n"
        "        for k, v in node.items():\n"
        "            if k == '_target_': yield v\n"
        "            else: yield from targets(v)\n"
        "    elif isinstance(node, list):\n"
        "        for v in node: yield from targets(v)\n"
        "for path in root.rglob('*.yaml'):\n"
        "    for target in targets(yaml.safe_load(path.read_text())):\n"
        "        hydra.utils.get_object(target)\n"
    )
    run([sys.executable, "-c", check], cwd=project, timeout=300, env=env)
    # Composition of every config file, and one fast_dev_run of the task (the CI budget; the
    # default bake runs every test of both tasks).
    fast_dev_run = {
        "classification": "tests/test_train.py::test_fast_dev_run_writes_metrics",
        "causal_lm": "tests/test_causal_lm.py::test_scratch_fast_dev_run_writes_start_and_final_validation",
    }[tasks]
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_configs.py", fast_dev_run],
                 cwd=project, timeout=1200, env=env)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "skipped" not in summary, summary


HOSTILE_NAMES = {
    'Café "Ünïcode" Model': "cafe_unicode_model",
    "my project's  name": "my_project_s_name",
    "  Trailing Spaces-and-dashes  ": "trailing_spaces_and_dashes",
}


@pytest.mark.parametrize(("project_name", "package"), HOSTILE_NAMES.items())
def test_awkward_names_bake_into_a_working_package(project_name, package, default_project, tmp_path):
    project = bake(tmp_path, project_name=project_name)
    assert package_of(project) == package and package.isidentifier() and not keyword.iskeyword(package)
    assert project.name == package
    for path in project.rglob("*.y*ml"):
        yaml.safe_load(path.read_text())
    tomllib.loads((project / "pyproject.toml").read_text())
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    run([sys.executable, "-c", f"import {package}.train, {package}.eval, {package}.predict"], cwd=project, timeout=300, env=env)
    run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_configs.py",
         "tests/test_train.py::test_fast_dev_run_writes_metrics", "-k", "composes or fast_dev_run"],
        cwd=project, timeout=600, env=env,
    )


@pytest.mark.parametrize(
    "context",
    [
        {"project_slug": "2-bad.name"},
        {"project_name": "4090 trainer"},          # derives to 4090_trainer: leading digit
        {"project_name": "class"},                 # a keyword
        {"project_name": "!!!"},                   # derives to nothing
        {"package_name": "my-package"},
        {"project_slug": 'quote"d'},
    ],
)
def test_bad_names_are_refused_and_nothing_is_generated(context, tmp_path):
    with pytest.raises(FailedHookException):
        bake(tmp_path, **context)
    assert list(tmp_path.iterdir()) == []


def test_cli_refusal_says_value_rule_and_example(tmp_path):
    out = tmp_path / "OUT2"
    cli = shutil.which("cookiecutter") or str(Path(sys.executable).with_name("cookiecutter"))
    result = subprocess.run([cli, "--no-input", "-o", str(out), str(TEMPLATE), "project_slug=2-bad.name"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    message = result.stderr + result.stdout
    assert "project_slug='2-bad.name'" in message and "not a valid Python identifier" in message
    assert "project_slug=bert_4090" in message
    assert not out.exists() or list(out.iterdir()) == []
