"""Reading a run's CSV log (:mod:`.csv_log` writes it): one ``metrics.csv`` per launch, merged.

Only the standard library here: ``plot`` reads logs without importing torch or Lightning.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

METRICS_FILE = "metrics.csv"  # the name Lightning's CSV writer gives each launch's file
LAUNCH_FOLDER = re.compile(r"version_(\d+)")


def launch_files(csv_dir: Path) -> list[Path]:
    """The ``metrics.csv`` of each launch under ``csv_dir`` (``<run>/csv``), oldest first."""
    folders = [(int(m.group(1)), p) for p in Path(csv_dir).glob("version_*") if (m := LAUNCH_FOLDER.fullmatch(p.name))]
    return [p / METRICS_FILE for _, p in sorted(folders) if (p / METRICS_FILE).is_file()]


def read_metrics(csv_dir: Path) -> list[dict[str, str]]:
    """A run's CSV log (``csv_dir``: ``<run>/csv``), launches merged: each launch's rows before the next one's first step
    (that launch resumed earlier and logged them again).

    Returns:
        One dict per row, cells as written (``""`` where empty); empty when nothing was logged.
    """
    launches = []
    for path in launch_files(csv_dir):
        with path.open(newline="") as file:
            launches.append([row for row in csv.DictReader(file) if row.get("step", "") != ""])
    columns = sorted({key for rows in launches for row in rows for key in row})
    merged: list[dict[str, str]] = []
    cut = math.inf
    for rows in reversed(launches):
        merged = [row for row in rows if int(float(row["step"])) < cut] + merged
        cut = min([cut, *(int(float(row["step"])) for row in rows)])
    return [{column: row.get(column) or "" for column in columns} for row in merged]
