"""Secrets never written: credentials refused in the config, secret values masked in every file and log line we write.

- **Refused**: a credential typed into the config (a leaf matching :data:`CREDENTIAL_LEAF` by whole words, or a URL with
  ``user:password@``): it would land in ``.hydra/``, the logs and W&B.  Fix: an environment variable or ``${oc.env:NAME}``.
- **Masked** (``***``, by value, wherever we write or print the config, hyperparameters or log lines): values of
  ``${oc.env:NAME}`` where NAME contains KEY, TOKEN, SECRET or PASSWORD (recorded by :func:`register`), and URL passwords.
"""

from __future__ import annotations

import argparse
import logging
import os
import re

from omegaconf import DictConfig, OmegaConf

MASK = "***"
# A leaf whose name ends in one of these words (after `_`/`-` or at the start) holds a credential.
CREDENTIAL_LEAF = re.compile(
    r"(?:^|[_-])(?:api[_-]?key|password|passwd|secret|secret[_-]key|access[_-]token|auth[_-]token)$", re.IGNORECASE
)
# `${oc.env:NAME...}` inside a config string, and the names whose values are secrets.
ENV_REFERENCE = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")
SECRET_ENV_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
# scheme://user:password@host -> the password part (a literal, not an interpolation).
URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:)(?P<password>[^@\s/]+)(?P<at>@)")

# The secret values of this process's config (register); masked by `mask`.
_SECRET_VALUES: set[str] = set()


def credential_problems(cfg: DictConfig) -> list[str]:
    """One line per credential typed into ``cfg`` (read unresolved: an ``oc.env`` interpolation is the fix, not a problem)."""
    found = (credential_problem(path, value) for path, value in _leaves(OmegaConf.to_container(cfg, resolve=False), ""))
    return [problem for problem in found if problem]


def credential_problem(path: str, value: object) -> str | None:
    """Why the value of config key ``path`` is a typed credential (a secret-named leaf, or a URL with a password), else
    ``None``; also for a command-line override (a multirun's lands in Hydra's ``multirun.yaml`` before any job runs)."""
    if not isinstance(value, str) or not value or ENV_REFERENCE.search(value):
        return None
    if CREDENTIAL_LEAF.search(path.rsplit(".", 1)[-1]):
        return (
            f"{path}=*** is a credential typed into the config, and would be written to .hydra/ (a multirun's multirun.yaml), "
            f"the logs and the W&B run; fix: drop it and set the tool's environment variable (WANDB_API_KEY for W&B) or log "
            f"in (wandb login), or write {path}='${{oc.env:YOUR_VARIABLE}}' (read from the environment, masked in every file)"
        )
    if any(match.group("password") and not match.group("password").startswith("$") for match in URL_PASSWORD.finditer(value)):
        return (
            f"{path}={mask_url_passwords(value)!r} carries a password in its URL, which would be written to .hydra/ and the logs; "
            f"fix: put the URL in an environment variable and write {path}='${{oc.env:YOUR_URL_VARIABLE}}', or use the "
            "tool's own credential file"
        )
    return None


def register(*configs: DictConfig | None) -> set[str]:
    """Record (and return) secret-named env values ``configs`` interpolate; install :class:`MaskingFilter`.  Idempotent;
    values under 4 characters are skipped (masking them would mask ordinary text)."""
    for cfg in configs:
        if cfg is None:
            continue
        for _path, value in _leaves(OmegaConf.to_container(cfg, resolve=False), ""):
            for name in ENV_REFERENCE.findall(value) if isinstance(value, str) else ():
                secret = os.environ.get(name)
                if SECRET_ENV_NAME.search(name) and secret and len(secret) >= 4:
                    _SECRET_VALUES.add(secret)
    for handler in logging.getLogger().handlers:  # the terminal and Hydra's <job>.log in the run folder
        if not any(isinstance(existing, MaskingFilter) for existing in handler.filters):
            handler.addFilter(MaskingFilter())
    return set(_SECRET_VALUES)


class MaskingFilter(logging.Filter):
    """A logging filter applying :func:`mask` to each record's message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _SECRET_VALUES or "://" in str(record.msg):
            record.msg, record.args = mask(record.getMessage()), ()
        return True


def mask(value: object) -> object:
    """``value`` (strings in nested mappings and lists) with registered secrets and URL passwords replaced by ``***``."""
    if isinstance(value, str):
        for secret in sorted(_SECRET_VALUES, key=len, reverse=True):
            value = value.replace(secret, MASK)
        return mask_url_passwords(value)
    if isinstance(value, dict):
        return {mask(key): mask(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask(item) for item in value)
    return value


def mask_url_passwords(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host``, everywhere in ``text``."""
    return URL_PASSWORD.sub(lambda match: f"{match.group('head')}{MASK}{match.group('at')}", text)


class MaskedHyperparameters:
    """Mixin for a Lightning logger: hyperparameters pass through :func:`mask` before they are written."""

    def log_hyperparams(self, params: object, *args, **kwargs) -> None:
        plain = vars(params) if isinstance(params, argparse.Namespace) else dict(params)
        super().log_hyperparams(mask(plain), *args, **kwargs)


def forget() -> None:
    """Drop the registered values (tests; one process running several configs)."""
    _SECRET_VALUES.clear()


def _leaves(node: object, path: str):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, f"{path}[{index}]")
    else:
        yield path, node
