"""Secrets never written: credentials refused in the config, secret values masked in every file
and log line the project writes.

- **Refused**: a credential typed into the config (a leaf named like :data:`CREDENTIAL_LEAF`:
  ``api_key``, ``password``, ``secret``, ...; or a URL with ``user:password@``) -- it would land in
  ``.hydra/``, the logs and the W&B run.  Fix: the tool's own environment variable
  (``WANDB_API_KEY``) or login (``wandb login``), or ``${oc.env:NAME}`` in the config.
- **Masked**: a value interpolated from an environment variable whose name contains KEY, TOKEN,
  SECRET or PASSWORD (``${oc.env:WANDB_API_KEY}``) is replaced by ``***`` wherever this project
  writes the config or prints it (``config_tree.log`` and the terminal, ``.hydra/``, the CSV,
  TensorBoard and W&B hyperparameters, checkpoints' stored settings, log lines: the terminal and
  Hydra's ``<job>.log``); so is the password of any
  URL (``scheme://user:***@host``, e.g. an Optuna storage URL).  Masking is by value: a secret that
  reached another key through an interpolation is masked there too.

:func:`register` (at the start of each entry point) records the secret values of the composed
config; :func:`mask` masks a string, mapping or list with them.  Keys such as
``model.tokenizer`` are not credentials: leaves are matched by whole words.
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
    """One line per credential typed into ``cfg`` (read raw: interpolations are not resolved, and
    one of an environment variable is the fix, not a problem)."""
    problems = []
    for path, value in _leaves(OmegaConf.to_container(cfg, resolve=False), ""):
        if not isinstance(value, str) or not value or ENV_REFERENCE.search(value):
            continue
        leaf = path.rsplit(".", 1)[-1]
        if CREDENTIAL_LEAF.search(leaf):
            problems.append(
                f"{path}=*** is a credential typed into the config, and would be written to .hydra/, the logs and the W&B run; "
                f"fix: drop it and set the tool's environment variable (WANDB_API_KEY for W&B) or log in (wandb login), "
                f"or write {path}='${{oc.env:YOUR_VARIABLE}}' (read from the environment, masked in every file)"
            )
        elif any(match.group("password") and not match.group("password").startswith("$") for match in URL_PASSWORD.finditer(value)):
            problems.append(
                f"{path}={mask_url_passwords(value)!r} carries a password in its URL, which would be written to .hydra/ and the logs; "
                f"fix: put the URL in an environment variable and write {path}='${{oc.env:YOUR_URL_VARIABLE}}', or use the "
                "tool's own credential file"
            )
    return problems


def register(*configs: DictConfig | None) -> set[str]:
    """Record the values of the environment variables with secret names that ``configs``
    interpolate (``${oc.env:NAME}``); return them.  Idempotent; values shorter than 4 characters
    are not recorded (masking them would mask ordinary text)."""
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
    """A logging filter that writes each record's message with :func:`mask` applied (installed on
    the root logger's handlers by :func:`register`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _SECRET_VALUES or "://" in str(record.msg):
            record.msg, record.args = mask(record.getMessage()), ()
        return True


def mask(value: object) -> object:
    """``value`` (a string, or mappings and lists of them, at any depth) with every registered
    secret and every URL password replaced by ``***``; other values as they are."""
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
    """Mixin for a Lightning logger: the hyperparameters it is given (the config, the module's
    stored groups) pass through :func:`mask` before it writes them (``hparams.yaml``, TensorBoard's
    and W&B's config)."""

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
