"""Load one split from local files or the Hugging Face Hub, with clear errors on bad input."""

from __future__ import annotations

from pathlib import Path

import datasets

# File suffix -> (datasets builder, extra builder kwargs).
BUILDERS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
}


class DataError(ValueError):
    """The data does not match the data config; the message names the field and the fix."""


def load_split(
    split: str,
    source: str,
    hub_name: str | None,
    hub_config: str | None,
    cache_dir: str | None,
) -> datasets.Dataset:
    """Load one split as a ``datasets.Dataset`` (cached as Arrow by ``datasets``).

    Args:
        split: our split name (``train``, ``validation``, ``test``, ``predict``), for messages.
        source: a local file path, or the hub's split name when ``hub_name`` is set.

    Raises:
        DataError: the file is missing, has an unknown suffix, is empty or has no rows.
    """
    field = f"data.splits.{split}"
    if hub_name is not None:
        return datasets.load_dataset(hub_name, hub_config, split=source, cache_dir=cache_dir)
    path = Path(source)
    if path.suffix.lower() not in BUILDERS:
        raise DataError(f"{field}={source!r}: unknown file type {path.suffix!r}; use one of {sorted(BUILDERS)}")
    if not path.is_file():
        raise DataError(f"{field}={source!r} does not exist; fix: point {field} at an existing file")
    builder, kwargs = BUILDERS[path.suffix.lower()]
    head = path.read_bytes()[:65536]
    if not head.strip():
        raise DataError(f"{field}={source!r} is empty; fix: give it a header line and at least one row")
    whole_file_read = path.stat().st_size <= len(head)
    if builder == "csv" and whole_file_read and len([line for line in head.splitlines() if line.strip()]) < 2:
        raise DataError(f"{field}={source!r} has a header but no rows; fix: add rows or choose another file")
    dataset = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir, **kwargs)
    if len(dataset) == 0:
        raise DataError(f"{field}={source!r} has a header but no rows; fix: add rows or choose another file")
    return dataset


def require_columns(dataset: datasets.Dataset, split: str, source: str, fields: dict[str, str | None]) -> None:
    """Raise if a configured column is missing from ``dataset``.

    Args:
        fields: config field name (e.g. ``"text_column"``) -> the column it names (``None`` = unused).

    Raises:
        DataError: one line per missing column, with the columns the split does have.
    """
    missing = [(field, column) for field, column in fields.items() if column is not None and column not in dataset.column_names]
    if missing:
        lines = [
            f"data.{field}={column!r} is not a column of the {split} split ({source}); "
            f"its columns are {dataset.column_names}; fix: data.{field}=<one of them>"
            for field, column in missing
        ]
        raise DataError("\n".join(lines))
