"""The README and docs/ keep their word: every ``_target_`` they (or the configs) name resolves, and
every command line they give composes into a config whose keys the entry point accepts (the verb
exists, the groups and options exist, every key binds to its signature, the overrides parse).
What a command names on the user's disk (their data, a checkpoint) is not checked here; the demos'
commands are run for real by tests/real_data/."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import hydra
import pytest
import yaml
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser

import {{ cookiecutter.package_name }}
from {{ cookiecutter.package_name }}.__main__ import VERBS, available
from {{ cookiecutter.package_name }}.core.config.keys import unknown_key_problems
from {{ cookiecutter.package_name }}.core.run.entry import command_line_problems
from {{ cookiecutter.package_name }}.tasks import task_of

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = Path({{ cookiecutter.package_name }}.__file__).parent
NAME = PACKAGE.name
PAGES = [PROJECT / "README.md", *sorted((PROJECT / "docs").rglob("*.md"))]
# The config each Hydra verb composes (doctor and plot take their own flags).
CONFIGS = {
    "train": "train",
    "eval": "eval",
    "predict": "predict",
    "generate": "generate",
    "chat": "chat",
    "serve": "serve",
    "export": "export",
    "quantize": "quantize",
    "plan": "plan",
    "inspect-data": "inspect_data",
}


def shell_lines(text: str) -> list[str]:
    """The lines of the ``bash`` blocks of a page, continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```(?:bash|shell|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.extend(part.strip() for part in re.split(r"&&|;", line))
    return lines


def commands() -> list[tuple[str, str, list[str]]]:
    """``(page, verb, arguments)`` of every entry-point command of the README and docs/."""
    found = []
    for page in PAGES:
        for line in shell_lines(page.read_text()):
            words = shlex.split(line)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
                words = words[1:]
            if words[:2] == ["python", "-m"] and len(words) > 2 and words[2].startswith(f"{NAME}."):
                verb, args = words[2].split(".", 1)[1].replace("_", "-"), words[3:]
            elif words[:1] == [NAME] and len(words) > 1 and not words[1].startswith("-"):
                verb, args = words[1], words[2:]
            else:
                continue
            found.append((page.relative_to(PROJECT).as_posix(), verb, args))
    return found


COMMANDS = commands()


def test_the_pages_give_commands():
    assert len(COMMANDS) > 20 and {verb for _, verb, _ in COMMANDS} >= {"train", "eval", "plan"}


@pytest.mark.parametrize(("page", "verb", "args"), COMMANDS, ids=[f"{p}:{v}:{i}" for i, (p, v, _) in enumerate(COMMANDS)])
def test_every_command_composes_with_keys_its_entry_point_accepts(page, verb, args):
    assert verb in available(), f"{page}: `{NAME} {verb}` is not a verb of this project ({sorted(available())})"
    if verb not in CONFIGS or "--help" in args:
        return
    assert not command_line_problems(args), f"{page}: {' '.join(args)}"
    overrides = [a for a in args if "=" in a and not a.startswith(("-", "hydra.", "+hydra", "~hydra"))]
    parsed = OverridesParser.create().parse_overrides(overrides)  # a multirun's sweep: its first value
    overrides = [f"{o.get_key_element()}={next(o.sweep_string_iterator())}" if o.is_sweep_override() else o.input_line for o in parsed]
    with initialize_config_module(version_base="1.3", config_module=f"{NAME}.configs"):
        cfg = compose(config_name=CONFIGS[verb], overrides=overrides)
    problems = unknown_key_problems(cfg, task_of(cfg).config_groups)
    assert not problems, f"{page}: {verb} {' '.join(args)}: {problems}"


def targets(node: object):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == "_target_" else targets(value)
    elif isinstance(node, list):
        for value in node:
            yield from targets(value)


def test_every_target_in_the_configs_and_the_pages_resolves():
    named = {target for path in (PACKAGE / "configs").rglob("*.yaml") for target in targets(yaml.safe_load(path.read_text()))}
    for page in PAGES:
        named |= set(re.findall(r"_target_[=:]\s*([A-Za-z_][\w.]*)", page.read_text()))
    ours = {target for target in named if isinstance(target, str) and not target.startswith("${")}
    assert any(target.startswith(f"{NAME}.core.") for target in ours)
    unresolved = []
    for target in sorted(ours):
        try:
            hydra.utils.get_object(target)
        except Exception as error:  # hydra wraps ImportError/AttributeError
            unresolved.append(f"{target}: {type(error).__name__}")
    assert not unresolved, unresolved


def test_the_verbs_table_names_modules():
    assert set(CONFIGS) <= set(VERBS) and all(module.isidentifier() for module, _ in VERBS.values())
