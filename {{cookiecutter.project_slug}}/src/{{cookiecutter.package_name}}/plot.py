"""Plot a run or a sweep from its local files: no W&B, no server, no network.

    python -m <package>.plot logs/train/runs/<run>          # -> <run>/plots/*.png
    python -m <package>.plot logs/train/sweeps/<study>      # -> <sweep>/plots/*.png
    python -m <package>.plot logs/train/multiruns/<sweep>   # a grid multirun: the objective per job
    python -m <package>.plot logs/quantize/runs/<run>/compressed   # or its compress_report.json

A run (its ``csv/version_<n>/metrics.csv``) gives loss, lr, throughput (tokens/s) and GPU memory (GiB) panels,
skipping those it did not log; an Optuna study ``objective.png`` and ``importances.png`` (fANOVA); a grid
multirun the objective from each job's ``metrics.json``; a ``quantize`` report ``compression.png`` (the metric
against size in MB and p50 latency in ms). Exits 1 with a message when there is nothing to plot."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .core.errors import NothingToPlot  # noqa: E402
from .core.loggers.metrics_csv import launch_files, read_metrics  # noqa: E402

# Panel file -> (title, y label, the columns it draws: exact names or a prefix ending in "*").
RUN_PANELS = {
    "loss.png": ("Loss", "loss", ["train/loss", "val/loss"]),
    "lr.png": ("Learning rate", "LR", ["train/lr"]),
    "throughput.png": ("Throughput", "tokens/s", ["perf/tokens_per_sec"]),
    "gpu_memory.png": ("GPU memory", "GiB", ["gpu/mem_allocated_gib", "gpu/mem_reserved_gib", "gpu/mem_peak_gib"]),
}


COMPRESS_REPORT = "compress_report.json"  # written by quantize (core/compress/report.py)
RUNTIME_MARKERS = {"pytorch": "o", "onnxruntime": "s"}


def plot_compression(report_path: Path, out_dir: Path) -> list[Path]:
    """``compression.png``: the report's first metric against each variant's size (MB) and p50 latency (ms), a marker per runtime.

    Raises:
        NothingToPlot: the report lists no variant.
    """
    report = json.loads(report_path.read_text())
    variants = report.get("variants") or []
    if not variants:
        raise NothingToPlot(f"{report_path} lists no variant")
    metric = report["metric_names"][0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    latency = report["latency"]
    panels = (
        ("size_mb", "weight files (MB)"),
        ("p50", f"latency p50 (ms per batch of {latency['batch_size']} x {latency['sequence_length']})"),
    )
    for ax, (key, xlabel) in zip(axes, panels):
        for v in variants:
            x = v["size_mb"] if key == "size_mb" else v["latency_ms"]["p50"]
            y = v["metrics"].get(metric)
            if x is None or y is None:
                continue
            marker = RUNTIME_MARKERS.get(v["runtime"].split("-")[0], "^")
            ax.scatter([x], [y], marker=marker, s=50)
            ax.annotate(v["name"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel=f"{metric} ({report['split']} split)")
    fig.suptitle(f"{metric} against size and latency (o: PyTorch, s: onnxruntime)\n{report['source']}", fontsize=10)
    return [save(fig, out_dir / "compression.png")]


def read_curves(csv_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``column -> [(step, value), ...]`` from a run's CSV log (launches merged by ``read_metrics``), blank cells skipped."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in read_metrics(csv_dir):
        step = int(float(row["step"]))
        for name, cell in row.items():
            if name not in ("step", "epoch") and cell != "":
                curves.setdefault(name, []).append((step, float(cell)))
    return curves


def plot_run(run_dir: Path, out_dir: Path) -> list[Path]:
    """Write the run panels (see the module docstring) into ``out_dir``; return the files written.

    Raises:
        NothingToPlot: ``run_dir/csv`` holds no ``version_<n>/metrics.csv``, or none of the panels' metrics.
    """
    metrics_csv = run_dir / "csv"
    if not launch_files(metrics_csv):
        raise NothingToPlot(
            f"{metrics_csv} holds no version_<n>/metrics.csv: plot reads a run's CSV log; fix: train with logger=csv "
            "(on by default) or pass a run folder (logs/<task>/runs/<run>)"
        )
    curves = read_curves(metrics_csv)
    label = f"{run_dir.parent.name}/{run_dir.name}" if run_dir.name.isdigit() else run_dir.name  # a sweep's job: <sweep>/<n>
    written = []
    for filename, (title, ylabel, wanted) in RUN_PANELS.items():
        names = [n for n in curves for w in wanted if n == w or (w.endswith("*") and n.startswith(w[:-1]))]
        if not names:
            print(f"skipped {filename}: the run logged none of {wanted}")
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in names:
            steps, values = zip(*curves[name])
            bad = sum(not math.isfinite(v) for v in values)  # NaN/inf: not drawable, but said
            ax.plot(steps, values, label=f"{name} ({bad} non-finite)" if bad else name, marker="o" if len(steps) < 30 else None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="optimizer step", ylabel=ylabel)
        ax.set_title(f"{title}\n{label}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(save(fig, out_dir / filename))
    if not written:
        raise NothingToPlot(f"{metrics_csv} holds none of the plotted metrics ({[w for p in RUN_PANELS.values() for w in p[2]]})")
    return written


def plot_sweep(sweep_dir: Path, out_dir: Path) -> list[Path]:
    """Write ``objective.png`` (and, for an Optuna study, ``importances.png``) into ``out_dir``.

    Raises:
        NothingToPlot: no ``optuna.db`` with a completed trial, and no job folder with a ``metrics.json``.
    """
    database, journal = sweep_dir / "optuna.db", sweep_dir / "optuna.journal"
    if database.is_file() or journal.is_file():
        return plot_study(f"sqlite:///{database}" if database.is_file() else f"journal:{journal}", out_dir)
    jobs = sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / "metrics.json").is_file()), key=lambda p: int(p.name)
    )
    if not jobs:
        raise NothingToPlot(
            f"{sweep_dir} has no csv/ logs (a run), no optuna.db, optuna.journal or job folders 0, 1, ... with a metrics.json (a sweep) "
            "and no compress_report.json (quantize); fix: pass logs/<task>/runs/<run>, a sweep folder, or quantize's output_dir"
        )
    metric = job_objective_name(jobs[0])
    values = [json.loads((job / "metrics.json").read_text()).get(metric) for job in jobs]
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(jobs)), 4.5))
    ax.bar(job_labels(jobs), [v if v is not None else math.nan for v in values])
    ax.tick_params(axis="x", labelsize=8)
    ax.set(xlabel="job", ylabel=metric)
    ax.set_title(f"{metric} per job\n{sweep_dir.name}", fontsize=10)
    return [save(fig, out_dir / "objective.png")]


def job_labels(jobs: list[Path]) -> list[str]:
    """``<job number>`` and the overrides that tell the jobs apart (``.hydra/overrides.yaml``)."""
    from omegaconf import OmegaConf

    overrides = []
    for job in jobs:
        path = job / ".hydra" / "overrides.yaml"
        overrides.append(list(OmegaConf.load(path)) if path.is_file() else [])
    shared = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    return ["\n".join([job.name, *(o for o in own if o not in shared)]) for job, own in zip(jobs, overrides)]


def job_objective_name(job_dir: Path) -> str:
    """The ``optimized_metric`` a job ran with (its ``.hydra/config.yaml``), else ``val/loss``."""
    from omegaconf import OmegaConf

    config = job_dir / ".hydra" / "config.yaml"
    if config.is_file():
        raw = OmegaConf.load(config)
        metric = OmegaConf.select(raw, "optimized_metric", throw_on_resolution_failure=False)
        if isinstance(metric, str) and not metric.startswith("${"):
            return metric
        monitor = OmegaConf.select(raw, "task.monitor", throw_on_resolution_failure=False)
        if isinstance(monitor, str):
            return monitor
    return "val/loss"


def plot_study(storage: str, out_dir: Path) -> list[Path]:
    """Objective history and parameter importances of every study in ``storage`` (an RDB URL or ``journal:<file>``).

    Raises:
        NothingToPlot: Optuna is not installed, or no study has a completed trial.
    """
    try:
        import optuna
        from optuna.visualization import matplotlib as optuna_plots
    except ImportError as error:
        raise NothingToPlot(f'plotting a study needs Optuna ({error}); fix: pip install -e ".[sweep]"') from error

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    written = []
    if storage.startswith("journal:"):
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage.removeprefix("journal:")))
    summaries = optuna.get_all_study_summaries(storage)
    for summary in summaries:
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        suffix = "" if len(summaries) == 1 else f"_{summary.study_name}"
        completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not completed:
            print(f"skipped study {summary.study_name}: no completed trial")
            continue
        ax = optuna_plots.plot_optimization_history(study)
        failed = len(study.trials) - len(completed)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{summary.study_name}\ncompleted trials: {len(completed)}, failed or unfinished: {failed}", fontsize=10)
        written.append(save(ax.figure, out_dir / f"objective{suffix}.png"))
        importances = param_importances(study)
        if importances:
            ax = optuna_plots.plot_param_importances(study)  # fANOVA (Optuna's default evaluator)
            ax.set_title(
                f"Parameter importance (fANOVA)\n{summary.study_name}", fontsize=10, loc="left"
            )  # replaces Optuna's own (left) title
            written.append(save(ax.figure, out_dir / f"importances{suffix}.png"))
        else:
            print(f"skipped importances{suffix}.png: needs 2 completed trials whose parameters differ")
    if not written:
        raise NothingToPlot(f"no completed trial in {storage}")
    return written


def param_importances(study) -> dict[str, float]:
    """``parameter -> importance`` (they sum to 1), or ``{}`` when there is too little to tell."""
    import optuna

    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(completed) < 2 or not completed[0].params:
        return {}
    try:
        return dict(optuna.importance.get_param_importances(study))  # fANOVA (Hutter et al., ICML 2014)
    except (ValueError, RuntimeError) as error:  # a single distinct value per parameter, ...
        print(f"parameter importances not computed: {error}")
        return {}


def save(fig, path: Path) -> Path:
    """Save ``fig`` as a PNG at ``path`` (folders created) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def plot(path: Path, out_dir: Path | None = None) -> list[Path]:
    """Plot a run folder, a sweep folder or a ``quantize`` report (folder or JSON) into ``out_dir`` (default: ``plots`` beside it).

    Raises:
        NothingToPlot: ``path`` is not a folder or a report, or holds nothing to plot.
    """
    if path.is_file() and path.name == COMPRESS_REPORT:
        return plot_compression(path, out_dir or path.parent / "plots")
    if path.is_dir() and (path / COMPRESS_REPORT).is_file():
        return plot_compression(path / COMPRESS_REPORT, out_dir or path / "plots")
    if path.is_file() and path.name == "compress_report.md":
        path = path.parent  # (the report's table: its JSON sits next to it)
        return plot_compression(path / COMPRESS_REPORT, out_dir or path / "plots")
    if not path.is_dir():
        raise NothingToPlot(
            f"{path} is not a folder; fix: pass a run folder (logs/<task>/runs/<run>), a sweep folder or a quantize output folder"
        )
    out_dir = out_dir or path / "plots"
    is_run = bool(launch_files(path / "csv"))
    return plot_run(path, out_dir) if is_run else plot_sweep(path, out_dir)


def main(argv: list[str] | None = None) -> None:
    """Console script / ``python -m`` entry (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Plot a run, a sweep or a quantize report from its local files into PNG files.")
    parser.add_argument("path", type=Path, help="a run folder (logs/<task>/runs/<run>), a sweep folder, or a quantize output folder")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: <path>/plots)")
    args = parser.parse_args(argv)
    try:
        plot(args.path, args.out)
    except NothingToPlot as error:
        print(f"Error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
