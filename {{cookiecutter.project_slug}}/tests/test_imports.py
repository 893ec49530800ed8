"""The package's import structure: no import circle; ``core/`` (the template's plumbing) imports
nothing of ``tasks/``, and ``core/errors.py`` nothing at all; no module outside ``tasks/`` compares
a task's name.

Imports are read from the source (``ast``), function-level ones included: an import inside a
function is an edge all the same, only a later one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import {{ cookiecutter.package_name }}

PACKAGE = Path({{ cookiecutter.package_name }}.__file__).parent
NAME = PACKAGE.name
CORE, TASKS_PACKAGE, ERRORS = f"{NAME}.core", f"{NAME}.tasks", f"{NAME}.core.errors"
# A comparison with any task's name (the task folders'), e.g. ``cfg.task.name == "classification"``.
TASKS = "|".join(sorted((path.name for path in (PACKAGE / "tasks").iterdir() if (path / "__init__.py").is_file()), key=len, reverse=True))
TASK_NAME = re.compile(r"""(==|!=|\bin\b)\s*[(\[{]?\s*["'](""" + TASKS + r""")["']|["'](""" + TASKS + r""")["']\s*(==|!=)""")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (``from x import y``:
    ``x.y`` when that is a module, else ``x``)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                anchor = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        edges[name] = {target for target in found if target in modules and target != name}
    return edges


def inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_import_circle():
    edges = imports()
    circles = []
    for start in edges:  # a depth-first walk from each module: one that reaches itself is in a circle
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for target in edges[node]:
                if target == start:
                    circles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    # a package __init__ re-exporting its own children is not a circle of design
    circles = [c for c in circles if not all(m.startswith(c.split(" -> ")[0]) for m in c.split(" -> "))]
    assert not circles, "\n".join(sorted(set(circles))[:10])


def test_core_stands_below_the_tasks():
    """Nothing under ``core/`` imports ``tasks`` (by an import, or a name handed to ``import_module``):
    the entry points resolve the task and hand it down; ``core/errors.py`` imports nothing of the package."""
    upward = [
        f"{name} imports {target}"
        for name, targets in imports().items()
        if inside(name, CORE)
        for target in targets
        if inside(target, TASKS_PACKAGE) or (name == ERRORS and target != NAME)
    ]
    upward += [
        f"{path.relative_to(PACKAGE)} imports a tasks module by name"
        for path in (PACKAGE / "core").rglob("*.py")
        if re.search(r"import_module\([^)]*\btasks\b", path.read_text(encoding="utf-8"))
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_task_name_is_compared_outside_the_task_folders():
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "tasks"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if TASK_NAME.search(line) and not line.strip().startswith("#")
    ]
    assert not found, "\n".join(found)


def test_no_task_module_reads_the_trainers_data_module():
    """A task module is handed its data's facts (``core/models/inputs.py``: ``connect``, ``ConnectData``);
    no task's ``module.py`` nor anything under ``core/models/`` but that hand-over reads ``trainer.datamodule``."""
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if (path.relative_to(PACKAGE).parts[0] == "tasks" and path.name == "module.py")
        or (path.relative_to(PACKAGE).parts[:2] == ("core", "models") and path.name != "inputs.py")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "trainer.datamodule" in line and not line.strip().startswith("#")
    ]
    assert not found, "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path, monkeypatch):
    """The walk sees a function-level import of a task from core/, a circle, a task name compared and
    the data module read (so the tests above can fail)."""
    package = tmp_path / NAME
    for folder in ("core", "tasks"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "tasks" / "module.py").write_text("def setup(self):\n    tokenizer = self.trainer.datamodule.tokenizer\n")
    (package / "core" / "errors.py").write_text("from .a import f\n")
    (package / "core" / "a.py").write_text("def f():\n    from ..b import g\n    from ..tasks import module\n")
    a_task = TASKS.split("|")[0]  # a task folder of this bake
    (package / "b.py").write_text(f"from .core.a import f\nif cfg.task.name == '{a_task}':\n    pass\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", package)
    edges = imports()
    assert edges[f"{NAME}.core.a"] == {f"{NAME}.b", f"{NAME}.tasks.module"} and edges[f"{NAME}.b"] == {f"{NAME}.core.a"}
    for test in (
        test_no_import_circle,
        test_core_stands_below_the_tasks,
        test_no_task_name_is_compared_outside_the_task_folders,
        test_no_task_module_reads_the_trainers_data_module,
    ):
        try:
            test()
        except AssertionError:
            continue
        raise AssertionError(f"{test.__name__} passed on a package that breaks it")


def test_importing_an_entry_point_prints_nothing():
    """torchao logs as it loads (missing CUDA kernels, pytree registrations), before Hydra has set up logging: no entry
    point may import it at module level (``export`` did, and printed that noise where ``train`` prints none)."""
    import subprocess
    import sys

    verbs = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "__main__"))
    code = "; ".join(f"import {NAME}.{verb}" for verb in verbs) + "; import sys; print('torchao' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]
    assert not done.stderr.strip(), done.stderr[-2000:]
