"""Is a Hugging Face Hub model here, or can it be fetched?  Asked before anything loads.

``transformers`` finds out only after tokenising, with a long traceback offline; here it is one line with the fix.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from huggingface_hub import constants, try_to_load_from_cache
from omegaconf import DictConfig

KEYS = ("name_or_path", "tokenizer")
# A file every model or tokenizer folder on the Hub has one of.
MARKERS = ("config.json", "tokenizer_config.json")
CONNECT_TIMEOUT_S = 3.0


def hub_problems(cfg: DictConfig) -> list[str]:
    """One line per ``model.<key>`` Hub id that is not local, not cached, and the Hub unreachable (:func:`unreachable_reason`);
    each id once.  A model with a ``fetch`` (which installs its files) is not checked."""
    model = cfg.get("model")
    if model is None or model.get("fetch"):
        return []
    missing: dict[str, str] = {}
    for key in KEYS:
        value = model.get(key)
        if isinstance(value, str) and value and value not in missing.values() and not available(value):
            missing[f"model.{key}"] = value
    if not missing:
        return []
    reason = unreachable_reason()
    if reason is None:
        return []
    return [
        f"{key}={value!r} is not a folder on this machine nor in its Hugging Face cache ({constants.HF_HUB_CACHE}), and the Hub "
        f"cannot be reached ({reason}); fix: on a machine with internet run `hf download {value} --local-dir "
        f"models/{value.rsplit('/', 1)[-1]}`, copy that folder here, then {key}=models/{value.rsplit('/', 1)[-1]}"
        for key, value in missing.items()
    ]


def available(name_or_path: str) -> bool:
    """A local folder or file, or a Hub id with a marker file in the Hub cache."""
    if os.path.exists(name_or_path):
        return True
    try:
        return any(isinstance(try_to_load_from_cache(name_or_path, marker), str) for marker in MARKERS)
    except ValueError:  # not a valid repo id (an absolute or ../ path that does not exist): transformers fails on it too
        return False


def unreachable_reason() -> str | None:
    """Why the Hub cannot be reached (``HF_HUB_OFFLINE``, no TCP connection in :data:`CONNECT_TIMEOUT_S` s), else ``None``."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as error:
        return f"{host}: {error.strerror or error}"
