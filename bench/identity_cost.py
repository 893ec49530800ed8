"""What recording and checking a run's identity costs (``core/identity/fingerprint.py``, ``core/identity/hashes.py``).

    python bench/identity_cost.py                               # the default config's base model and data
    python bench/identity_cost.py --files models/my_base data/train.csv

For each path (a file, or a model folder: its files) it prints:

- its size in bytes;
- the time of its first hash, with every byte read and sha256-ed, and the rate of that hash;
- the time of a cached hash, which is what the next launch pays: the cache file read and each
  file's stat looked up.

Then it prints the per-launch overhead of the checks, with the cache warm. That is what a resume
adds before anything loads: the config compared key by key, and the file entries of the config
rebuilt.

The last line is ``first_s=<s> cached_s=<s> launch_check_s=<s> gb_per_s=<r>``.

With no ``--files``, the default config's base model and data are measured (installed on first
use, as ``train`` would). A first hash reads from the page cache when the files were read
recently; after a reboot it reads from the disk and is bounded by the disk's speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def paths_of_default_config(out: Path) -> tuple[list[Path], object]:
    """The base model folder and data files of the default ``train`` config (installed if
    missing), and the config."""
    from hydra import compose, initialize_config_module

    from my_4090_project.core.assets import fetch_model_files

    with initialize_config_module(version_base="1.3", config_module="my_4090_project.configs"):
        cfg = compose("train", [f"paths.output_dir={out}", f"paths.log_dir={out}/logs"])
    if cfg.model.get("fetch") and not Path(cfg.model.name_or_path).exists():
        fetch_model_files(dict(cfg.model.fetch))
    if cfg.data.get("fetch"):
        import hydra

        hydra.utils.instantiate(cfg.data.fetch)()
    files = [Path(cfg.model.name_or_path)] + [Path(str(p)) for p in cfg.data.splits.values() if p is not None]
    return files, cfg


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", type=Path, help="files or model folders (default: the default config's)")
    args = parser.parse_args()

    from my_4090_project.core.identity import hashes as file_hashes
    from my_4090_project.core.identity.fingerprint import config_changes, named_files, plain_config, resume_problems

    with tempfile.TemporaryDirectory() as scratch:
        os.environ[file_hashes.CACHE_ENV] = str(Path(scratch) / "file_hashes.json")  # a cold cache, this bench's own
        cfg = None
        paths = args.files
        if not paths:
            paths, cfg = paths_of_default_config(Path(scratch) / "run")
        rows, first_total, cached_total, size_total = [], 0.0, 0.0, 0
        for path in paths:
            files = files_of(path)
            size = sum(f.stat().st_size for f in files)
            start = time.perf_counter()
            for f in files:
                file_hashes.file_sha256(f)
            first = time.perf_counter() - start
            file_hashes.forget()  # (as a new process: the cache file is read again)
            start = time.perf_counter()
            for f in files:
                file_hashes.file_sha256(f)
            cached = time.perf_counter() - start
            rows.append((str(path), size, first, cached))
            first_total, cached_total, size_total = first_total + first, cached_total + cached, size_total + size
        launch = 0.0
        if cfg is not None:
            start = time.perf_counter()
            config = plain_config(cfg)
            named_files(config)
            resume_problems(config_changes(config, plain_config(cfg)), (), [], "ckpt_path=bench")
            launch = time.perf_counter() - start
    width = max(len(r[0]) for r in rows)
    print(f"{'path':<{width}}  {'MiB':>9}  {'first s':>8}  {'GB/s':>6}  {'cached s':>9}")
    for name, size, first, cached in rows:
        print(f"{name:<{width}}  {size / 2**20:9.1f}  {first:8.3f}  {size / 1e9 / max(first, 1e-9):6.2f}  {cached:9.4f}")
    rate = size_total / 1e9 / max(first_total, 1e-9)
    print(f"first_s={first_total:.3f} cached_s={cached_total:.4f} launch_check_s={launch:.4f} gb_per_s={rate:.2f}")


if __name__ == "__main__":
    sys.exit(main())
