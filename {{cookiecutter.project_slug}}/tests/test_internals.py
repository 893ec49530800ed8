"""Public ground: ``src/`` touches no private internal of another library outside the modules
``docs/internals.md`` lists (ruff's SLF001 covers attribute access; this covers what it does not
see: private names imported or reached through a module, and ``getattr`` with a private name)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
THIRD_PARTY = r"torch|L|lightning|hydra|optuna|transformers|datasets|peft|omegaconf|wandb|np|numpy|bnb|bitsandbytes|torchao|torchmetrics"
PRIVATE = [
    (re.compile(r"getattr\([^,()]+,\s*[\"']_[A-Za-z]"), "getattr with a private name"),
    (re.compile(r"^\s*(from|import)\s+(?!\.)[\w.]*\._[A-Za-z]"), "a private module imported"),
    (re.compile(r"^\s*from\s+(?!\.)[\w.]+\s+import\s+.*(?<![\w.])_[A-Za-z]"), "a private name imported"),
    (re.compile(rf"(?<![\w.])({THIRD_PARTY})(\.\w+)*\._[A-Za-z]"), "a private attribute of a library module"),
]


def listed_modules() -> set[str]:
    """The ``src/`` modules that ``pyproject.toml`` exempts from SLF001, as ``*/core/memory/tracer.py`` paths."""
    ignores = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["per-file-ignores"]
    return {pattern for pattern, rules in ignores.items() if pattern.startswith("src/") and "SLF001" in rules}


def test_the_modules_exempt_from_slf001_are_few_and_listed_in_docs_internals():
    exempt = listed_modules()
    internals = (ROOT / "docs" / "internals.md").read_text()
    assert 1 <= len(exempt) <= 3
    for pattern in exempt:
        assert f"`{pattern.split('/', 2)[2]}`" in internals, f"{pattern} is exempt from SLF001 but not in docs/internals.md"


def test_src_touches_no_private_internals_outside_the_listed_modules():
    exempt = {Path(p.split("/", 2)[2]) for p in listed_modules()}
    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        if any(path.match(f"*/{module}") for module in exempt):
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#", 1)[0]
            found += [f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}" for pattern, what in PRIVATE if pattern.search(code)]
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind():
    lines = [
        'x = getattr(trainer, "_logger_connector")',
        "from hydra._internal.utils import get_args_parser",
        "from lightning.fabric.loggers.csv_logs import _ExperimentWriter as W",
        "torch._foreach_mul_(grads, 2.0)",
    ]
    assert [[what for pattern, what in PRIVATE if pattern.search(line)] != [] for line in lines] == [True] * 4
    public = ["super().__init__()", "from .run import _helper", "self._window.zero_()", "torch.__version__", 'getattr(x, "procs", None)']
    assert not [line for line in public for pattern, _ in PRIVATE if pattern.search(line)]
