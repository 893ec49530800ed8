"""The rows of ``shakespeare_next_line.yaml``: the jsonl file beside this one as lm-eval's test split (read here because
lm-eval resolves a task's ``dataset_kwargs`` paths from the working directory, not from the task's folder)."""

from pathlib import Path

import datasets


def docs(**metadata: object) -> datasets.DatasetDict:
    """``{"test": rows}``, each ``{"context", "choices", "label"}``."""
    return datasets.DatasetDict(
        {"test": datasets.load_dataset("json", data_files=str(Path(__file__).with_suffix(".jsonl")), split="train")}
    )
