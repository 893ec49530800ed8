"""The package versions this project was tested with, and how this environment differs.

``tested_versions.txt`` (next to ``__init__.py``) is a pip constraints file of every distribution ``.[dev]`` needs,
transitively, as installed when the tests last passed; ``doctor`` reports differences.  Never edit it by hand: after a
dependency change, run the tests in a fresh environment, then ``python -m <package>.doctor --write-tested-versions ...``.
torch (with triton and ``nvidia-*``) is left out: its build (CPU, CUDA 12.x) is the user's choice.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TESTED_VERSIONS = Path(__file__).resolve().parents[2] / "tested_versions.txt"
TESTED_EXTRAS = ("dev",)  # what CI installs: tests, lint, sweeps, SLURM, tensorboard
# torch and its CUDA runtime: a range only, so a GPU machine keeps its build.  nvidia-ml-py (NVML) is pinned.
NOT_PINNED = re.compile(r"^(torch|triton|nvidia-(?!ml-py$).+)$")


def project_distribution() -> str:
    """The installed distribution that provides this package.

    Raises:
        LookupError: the package is not installed (no ``pip install -e .``).
    """
    package = __package__.split(".")[0]
    names = metadata.packages_distributions().get(package)
    if names:
        return names[0]
    for distribution in metadata.distributions():  # an editable install lists no files: its console scripts tell
        if any(entry.value.startswith(f"{package}.") for entry in distribution.entry_points):
            return distribution.metadata["Name"]
    raise LookupError(f"the package {package!r} is not installed; fix: pip install -e . in the project folder")


def dependency_versions(root: str, extras: tuple[str, ...] = TESTED_EXTRAS) -> dict[str, str]:
    """``{distribution: installed version}`` of what ``root[extras]`` needs, transitively; names normalised (PEP 503).

    Skips false markers, uninstalled distributions, ``root`` and :data:`NOT_PINNED`.
    """
    found: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    pending = [(root, extra) for extra in ("", *extras)]
    while pending:
        name, extra = pending.pop()
        key = canonicalize_name(name)
        if (key, extra) in seen or NOT_PINNED.match(key):
            continue
        seen.add((key, extra))
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if key != canonicalize_name(root):
            found[key] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                pending += [(requirement.name, more) for more in ("", *requirement.extras)]
    return found


def read_tested_versions(path: Path = TESTED_VERSIONS) -> dict[str, str]:
    """``{distribution: version}`` of a constraints file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not ``name==version`` (named in the message).
    """
    versions = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        if not match:
            raise ValueError(f"{path}:{number}: {line!r} is not name==version")
        versions[canonicalize_name(match.group(1))] = match.group(2)
    return versions


def version_differences(tested: dict[str, str], installed: dict[str, str]) -> list[str]:
    """One line per distribution installed at another version than tested, or needed but not in the tested set."""
    lines = [
        f"{name}=={installed[name]} is installed; tested with {name}=={version}"
        for name, version in sorted(tested.items())
        if name in installed and installed[name] != version
    ]
    lines += [
        f"{name}=={version} is installed and needed, but not in the tested set"
        for name, version in sorted(installed.items())
        if name not in tested
    ]
    return lines


def write_tested_versions(path: Path, versions: dict[str, str], package: str) -> None:
    """Write ``versions`` as a constraints file, with a header saying how it was made."""
    import platform

    header = [
        "# The exact versions this project's tests passed with (a pip constraints file), written by",
        f"#   python -m {package}.doctor --write-tested-versions src/{package}/tested_versions.txt",
        f"# on Python {platform.python_version()}, with the extras {', '.join(TESTED_EXTRAS)}. Install that set with",
        f'#   pip install -c src/{package}/tested_versions.txt -e ".[dev]"',
        "# torch is not pinned here: pick its build (CPU or CUDA) yourself; pyproject.toml gives its range.",
    ]
    path.write_text("\n".join([*header, *(f"{name}=={version}" for name, version in sorted(versions.items()))]) + "\n")
