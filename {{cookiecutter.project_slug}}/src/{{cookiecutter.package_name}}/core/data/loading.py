"""Load one split from local files or the Hugging Face Hub, with clear errors on bad input."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import datasets

from ..errors import DataError
from ..identity.hashes import content_cache_dir

log = logging.getLogger(__name__)

# File suffix -> (datasets builder, kwargs); csv/tsv cells are read as written: no "NA" guessing, strings (csv_as_written).
AS_WRITTEN = {"keep_default_na": False, "na_filter": False}
BUILDERS = {
    ".csv": ("csv", {"sep": ",", **AS_WRITTEN}),
    ".tsv": ("csv", {"sep": "\t", **AS_WRITTEN}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
}


# What a well-formed file of each kind looks like, for the message when one cannot be parsed.
FORMAT_HINTS = {
    "csv": "one header line, then rows with as many fields as the header (quote fields that hold the separator)",
    "json": "one JSON object per line (jsonl), keys in double quotes",
    "parquet": "a parquet file as pandas/pyarrow write it",
}


def split_field(split: str) -> str:
    """The setting a user typed for ``split``, for messages: ``input`` for predict, else ``data.splits.<split>``."""
    return "input" if split == "predict" else f"data.splits.{split}"


def load_split(
    split: str,
    source: str,
    hub_name: str | None,
    hub_config: str | None,
    cache_dir: str | None,
) -> datasets.Dataset:
    """Load one split as a ``datasets.Dataset``; ``source`` is a local file, or the Hub's split name with ``hub_name``.

    Raises:
        DataError: the file is missing, empty, without rows, not UTF-8, of an unknown suffix or unparsable (the reader's message).
    """
    field = split_field(split)
    if hub_name is not None:
        return datasets.load_dataset(hub_name, hub_config, split=source, cache_dir=cache_dir)
    path = Path(source)
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in BUILDERS)[:3]
        example = f" (it holds {', '.join(inside)})" if inside else ""
        raise DataError(f"{field}={source!r} is a folder, not a file; fix: point {field} at one file in it{example}")
    if path.suffix.lower() not in BUILDERS:
        raise DataError(f"{field}={source!r}: unknown file type {path.suffix!r}; fix: a file ending in one of {sorted(BUILDERS)}")
    if not path.is_file():
        raise DataError(f"{field}={source!r} does not exist; fix: point {field} at an existing file")
    builder, kwargs = BUILDERS[path.suffix.lower()]
    head = path.read_bytes()[:65536]
    if not head.strip():
        wanted = "a header line and at least one row" if builder == "csv" else "at least one row (one JSON object a line for jsonl)"
        raise DataError(f"{field}={source!r} is empty; fix: give it {wanted}")
    whole_file_read = path.stat().st_size <= len(head)
    if builder == "csv" and whole_file_read and len([line for line in head.splitlines() if line.strip()]) < 2:
        raise DataError(f"{field}={source!r} has a header but no rows; fix: add rows or choose another file")
    try:
        if builder == "csv":
            kwargs = {**kwargs, "features": csv_as_written(path, kwargs["sep"], field)}
        # Cached by content hash: datasets keys by path and mtime, so a rewrite keeping its mtime would serve old data.
        cache = content_cache_dir(cache_dir, [str(path)])
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache, **kwargs)
    except DataError:
        raise
    except Exception as error:  # datasets wraps the reader's error (decoding, parsing) in DatasetGenerationError
        bad = first_non_utf8([str(path)]) if builder != "parquet" else None
        if bad is not None:
            raise DataError(
                f"{field}={source!r}: {bad} is not UTF-8 text; fix: re-encode it, e.g. "
                f"iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}"
            ) from error
        cause = error.__cause__ or error.__context__ or error
        raise DataError(
            f"{field}={source!r} cannot be read as {path.suffix.lstrip('.').lower()}: "
            f"{type(cause).__name__}: {str(cause).strip()[:300]}; fix: {FORMAT_HINTS[builder]}"
        ) from error
    if len(dataset) == 0:
        raise DataError(f"{field}={source!r} has a header but no rows; fix: add rows or choose another file")
    return dataset


def csv_as_written(path: Path, sep: str, field: str = "data file") -> datasets.Features:
    """Every header column of a csv/tsv as a string column, so cells stay as written ("007", "1.50", "NA").

    Raises:
        DataError: a row has more cells than the header.
        UnicodeDecodeError, csv.Error: the file cannot be read (reported as a DataError).
    """
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # a long document is one cell (the default stops at 128 KiB)
    # utf-8-sig: drop a byte-order mark (Excel's "CSV UTF-8") from the first name, as pandas does.
    with path.open(newline="", encoding="utf-8-sig") as file:
        reader = csv.reader(file, delimiter=sep)
        header = next(reader, [])
        # pandas would take a longer row's extra leading cells as an index and shift the rest, cutting its text.
        for fields in reader:
            if len(fields) > len(header):
                raise DataError(
                    f"{field}={str(path)!r}: line {reader.line_num} has {len(fields)} cells but the header has {len(header)} "
                    f'(an unquoted {sep!r} inside a cell?); fix: quote cells that contain the separator, e.g. "a, b"'
                )
    names: list[str] = []
    for index, name in enumerate(header):  # the names pandas gives: "Unnamed: 0" (a saved index), "a.1" (a repeat)
        name = name or f"Unnamed: {index}"
        base, repeat = name, 0
        while name in names:
            repeat += 1
            name = f"{base}.{repeat}"
        names.append(name)
    return datasets.Features({name: datasets.Value("string") for name in names})


def rows_as_read(path: str | None, loaded: datasets.Dataset) -> list[dict]:
    """The rows of an input file as the file holds them, for an output that copies them: a jsonl file's own objects (their
    keys only, in their order: ``datasets`` gives every row each key of the file, null where the row has none), else
    ``loaded``'s rows (a csv or parquet file's rows share its columns), as they are when the objects are not one a row."""
    if path is None or Path(path).suffix.lower() != ".jsonl":
        return list(loaded)
    with Path(path).open(encoding="utf-8") as file:
        objects = [json.loads(line) for line in file if line.strip()]
    return objects if len(objects) == len(loaded) else list(loaded)


def require_columns(dataset: datasets.Dataset, split: str, source: str, fields: dict[str, str | None]) -> None:
    """Raise if a configured column (``fields``: config field -> column, ``None`` = unused) is missing.

    Raises:
        DataError: one line per missing column, with the split's columns.
    """
    missing = [(field, column) for field, column in fields.items() if column is not None and column not in dataset.column_names]
    if missing:
        lines = [
            f"data.{field}={column!r} is not a column of {split_field(split)}={source!r}; "
            f"its columns are {dataset.column_names}; fix: data.{field}=<one of them>"
            for field, column in missing
        ]
        raise DataError("\n".join(lines))


def require_column_types(
    dataset: datasets.Dataset, split: str, source: str, text: dict[str, str | None], labels: dict[str, str | None]
) -> None:
    """Raise if a text column does not hold text, or a label column holds lists, records or mixed types (JSON
    lines can read ``1`` and ``"negative"`` into one column); ``text``/``labels`` as in :func:`require_columns`.

    Raises:
        DataError: one line per such column, with the fix.
    """
    lines = []
    for field, column, wants_text in [(f, c, True) for f, c in text.items()] + [(f, c, False) for f, c in labels.items()]:
        if column is None or column not in dataset.column_names:
            continue
        feature = dataset.features[column]
        if isinstance(feature, datasets.ClassLabel) and not wants_text:
            continue
        dtype = getattr(feature, "dtype", None) if isinstance(feature, datasets.Value) else None
        if (wants_text and dtype in ("string", "large_string")) or (not wants_text and dtype is not None):
            continue
        seen = sorted({type(value).__name__ for value in dataset[:1000][column]})  # (the first rows only: not the whole column)
        holds = f"values of mixed types ({', '.join(seen)})" if len(seen) > 1 else f"{feature!r} values"
        fix = "one string per row" if wants_text else "every label written the same way (all text, or all integers)"
        lines.append(
            f"data.{field}={column!r} in {split_field(split)}={source!r} holds {holds}, not {'text' if wants_text else 'one label per row'}; fix: {fix}"
        )
    if lines:
        raise DataError("\n".join(lines))


def first_non_utf8(files: list[str]) -> str | None:
    """The first file that does not decode as UTF-8, with the byte offset; ``None`` if all do."""
    for path in files:
        data = Path(path).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            return f"{path} (byte {error.start}: {data[error.start : error.start + 1]!r})"
    return None


def is_blank(value: object) -> bool:
    """Missing (null) text, or text that is empty or only whitespace."""
    return value is None or not str(value).strip()


def drop_blank_rows(dataset: datasets.Dataset, split: str, columns: list[str]) -> datasets.Dataset:
    """Drop (with a warning) the rows whose text ``columns`` are null, empty or whitespace.

    Raises:
        DataError: no row is left.
    """

    def keep(row: dict) -> bool:
        return not any(is_blank(row[column]) for column in columns)

    kept = dataset.filter(keep, desc=f"Dropping blank rows of {split}")
    if len(kept) == 0:
        raise DataError(
            f"{split_field(split)}: all {len(dataset)} row(s) have empty or whitespace-only text in {columns}; "
            "fix: point it at a file with text, or data.text_column=<the column that holds it>"
        )
    if len(kept) < len(dataset):
        log.warning(
            "%s: dropped %d of %d rows whose %s is empty, whitespace or missing",
            split_field(split),
            len(dataset) - len(kept),
            len(dataset),
            " / ".join(columns),
        )
    return kept


PROMPT_FILES = 'a .txt file, one prompt a line (a literal \\n in it is a newline), or a .jsonl file of {"prompt": "..."} rows'


def read_prompt_file(field: str, value: str) -> list[str]:
    r"""The prompts of a prompt file, in order: ``.jsonl``/``.json`` rows ``{"prompt": text}``, any other suffix plain text,
    one prompt a non-blank line (a literal ``\n`` in it a newline).  ``field``: the setting that named the file (messages).

    Raises:
        DataError: a missing file or one not UTF-8; a jsonl line that is not an object with ``prompt`` text (by line); no prompt.
    """
    path = Path(value)
    if not path.is_file():
        raise DataError(f"{field}={value!r} is not a file; fix: {PROMPT_FILES}")
    data = path.read_bytes()
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DataError(
            f"{field}={value!r} is not UTF-8 text (byte {error.start}: {data[error.start : error.start + 1]!r}); "
            f"fix: re-encode it, e.g. iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}"
        ) from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.suffix.lower() not in (".jsonl", ".json"):
            prompts.append(line.replace("\\n", "\n"))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f'{field}={value!r} line {number} is not a JSON object ({error.msg}); fix: one {{"prompt": "..."}} a line, '
                "or plain text in a .txt file"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise DataError(f'{field}={value!r} line {number} has no prompt text; fix: {{"prompt": "..."}}')
        prompts.append(row["prompt"])
    if not prompts:
        raise DataError(f"{field}={value!r} has no prompt; fix: {PROMPT_FILES}")
    return prompts
