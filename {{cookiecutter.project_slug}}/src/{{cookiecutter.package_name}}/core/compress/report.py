"""The compression report: each variant's size, task metric and latency against the fp32 baseline.

Latency is compared with the fp32 of the *same* runtime (``onnx_fp32`` for onnxruntime), so a runtime's own speed is not
credited to the quantization; :func:`write_report` writes ``compress_report.json`` and ``compress_report.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPORT_JSON, REPORT_MD = "compress_report.json", "compress_report.md"
BYTES_PER_MB = 1_000_000  # MB as in file sizes (10^6 bytes), not MiB
# Weight-file suffixes: what a variant's size counts.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".onnx", ".onnx.data", ".data", ".pt")


@dataclass
class Measurement:
    """What was measured of one variant (the inputs of :func:`build_report`).

    Attributes:
        runtime: where it was timed (``pytorch-eager-cpu``, ``onnxruntime-cpu``...).
        latency_baseline: the fp32 variant of the same runtime.
        size_bytes: bytes of its weight files (:func:`weight_bytes`).
        latency_ms: one forward of the timed batch per sample, in ms after warm-up; empty when not timed.
        load: the Python line that loads the saved folder.
    """

    name: str
    runtime: str
    latency_baseline: str
    size_bytes: int
    metrics: dict[str, float]
    latency_ms: list[float]
    load: str
    storage: str
    path: str = ""
    note: str = ""  # why a metric is missing, if one is


def weight_bytes(folder: Path) -> int:
    """Bytes of the weight files under ``folder`` (:data:`WEIGHT_SUFFIXES`; embeddings included, config and tokenizer not)."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES))


def latency_summary(samples_ms: list[float]) -> dict[str, float]:
    """``p50``, ``p90``, ``mean`` (ms) and count ``n`` of ``samples_ms``; percentiles are ``numpy.percentile``'s default
    (linear, "type 7" of Hyndman & Fan 1996).

    Raises:
        ValueError: no samples.
    """
    if not samples_ms:
        raise ValueError("no latency samples to summarise")
    samples = np.asarray(samples_ms, dtype=np.float64)
    return {
        "p50": float(np.percentile(samples, 50)),
        "p90": float(np.percentile(samples, 90)),
        "mean": float(samples.mean()),
        "n": len(samples),
    }


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline``, or ``None`` when either is missing, not finite, or the baseline is 0."""
    if value is None or baseline is None or not math.isfinite(value) or not math.isfinite(baseline) or baseline == 0:
        return None
    return value / baseline


def build_report(measurements: list[Measurement], refusals: list[dict], context: dict, baseline: str = "fp32") -> dict:
    """The report as a JSON-able dict: ``context``, one entry per variant, and the ``refusals`` (``variant``, ``reason``, ``fix``).

    Per variant: size in MB and as a ratio of ``baseline``'s; each metric with its ``delta`` (variant minus baseline);
    ``latency_ms`` (p50, p90, mean, n; ``None`` if untimed) and its ratio to ``latency_baseline``'s.

    Raises:
        ValueError: ``baseline`` is not among the measurements.
    """
    by_name = {m.name: m for m in measurements}
    if baseline not in by_name:
        raise ValueError(f"the baseline {baseline!r} was not measured (measured: {sorted(by_name)})")
    base = by_name[baseline]
    summaries = {m.name: latency_summary(m.latency_ms) if m.latency_ms else None for m in measurements}
    variants = []
    for m in measurements:
        latency = summaries[m.name]
        reference = summaries.get(m.latency_baseline)
        variants.append(
            {
                "name": m.name,
                "runtime": m.runtime,
                "path": m.path,
                "load": m.load,
                "storage": m.storage,
                "size_bytes": m.size_bytes,
                "size_mb": m.size_bytes / BYTES_PER_MB,
                "size_ratio": ratio(m.size_bytes, base.size_bytes),
                "metrics": dict(m.metrics),
                "delta": {key: (value - base.metrics[key]) if key in base.metrics else None for key, value in m.metrics.items()},
                "metric_ratio": {key: ratio(value, base.metrics.get(key)) for key, value in m.metrics.items()},
                "note": m.note,
                "latency_ms": latency,
                "latency_baseline": m.latency_baseline,
                "latency_ratio": {q: ratio(latency[q] if latency else None, reference[q] if reference else None) for q in ("p50", "p90")},
            }
        )
    return {**context, "baseline": baseline, "variants": variants, "refusals": list(refusals)}


def _number(value: float | None, digits: int = 2, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown_table(report: dict) -> str:
    """The variants as one Markdown table: size, metrics with delta, latency with ratio (when some variant was timed),
    notes (when some variant has one)."""
    metric_names = report.get("metric_names") or list(report["variants"][0]["metrics"])
    timed = any(v["latency_ms"] for v in report["variants"])
    noted = any(v["note"] for v in report["variants"])
    header = ["variant", "runtime", "size MB", f"× {report['baseline']}"]
    for name in metric_names:
        header += [name, "Δ", f"× {report['baseline']}"]
    header += ["p50 ms", "p90 ms", "p50 × fp32 (same runtime)"] if timed else []
    header += ["note"] if noted else []
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for v in report["variants"]:
        row = [f"`{v['name']}`", v["runtime"], _number(v["size_mb"]), _number(v["size_ratio"], 3)]
        for name in metric_names:
            row += [
                _number(v["metrics"].get(name), 4),
                _number(v["delta"].get(name), 4, signed=True),
                _number(v["metric_ratio"].get(name), 4),
            ]
        if timed:
            latency = v["latency_ms"] or {"p50": None, "p90": None}
            baseline = "" if v["latency_baseline"] == v["name"] else f" (vs `{v['latency_baseline']}`)"
            row += [_number(latency["p50"], 1), _number(latency["p90"], 1), _number(v["latency_ratio"]["p50"]) + baseline]
        row += [v["note"]] if noted else []
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_report(report: dict) -> str:
    """The whole ``compress_report.md`` (or ``export_report.md``: ``report["title"]``, no latency): the setup, the table,
    how each variant is stored and loads, the refusals."""
    latency = report.get("latency")
    measured = (
        f"- metric: {', '.join(report['metric_names'])} on the **{report['split']}** split ({report['rows']} rows"
        f"{', `' + report['data'] + '`' if report.get('data') else ''}); "
        f"Δ = variant − `{report['baseline']}`"
        if report.get("split")
        else f"- metric: not measured ({report.get('unmeasured', 'no evaluation split')})"
    )
    lines = [
        f"# {report.get('title', 'Compression report')}",
        "",
        f"- source: `{report['source']}` (task {report['task']})",
        measured,
        *(
            [
                f"- latency: one forward of a batch of {latency['batch_size']} × {latency['sequence_length']} tokens, "
                f"{latency['warmup']} warm-up runs, then p50/p90 of {latency['repeats']} on {latency['device']} "
                f"({latency['threads']} CPU threads, load average {latency['load_average']:.1f} when it started: above the thread "
                "count, other processes shared the cores and every timing is inflated); the ratio is against the fp32 variant of "
                "the same runtime"
            ]
            if latency
            else []
        ),
        *([f"- {report['shrunk']} (fp32 included)"] if report.get("shrunk") else []),
        f"- size: {report.get('size_meaning', 'bytes of the weight files (safetensors/onnx, embeddings included)')}, "
        f"MB = 10^6 bytes; × {report['baseline']} against `{report['baseline']}`",
        "",
        markdown_table(report),
        "",
        "## How each variant is stored and loaded",
        "",
    ]
    for v in report["variants"]:
        lines.append(f"- `{v['name']}`: {v['storage']}  \n  `{v['load']}`")
    lines += ["", "## Refusals", ""]
    if report["refusals"]:
        lines += [f"- `{r['variant']}`: {r['reason']}; fix: {r['fix']}" for r in report["refusals"]]
    else:
        lines.append("None: every requested variant was made.")
    return "\n".join(lines) + "\n"


def write_report(folder: Path, report: dict, names: tuple[str, str] = (REPORT_JSON, REPORT_MD)) -> tuple[Path, Path]:
    """Write the report as JSON (NaN/inf as null) and Markdown into ``folder``, named ``names``."""
    json_path, md_path = folder / names[0], folder / names[1]
    json_path.write_text(json.dumps(_finite(report), indent=2) + "\n", encoding="utf-8")
    md_path.write_text(markdown_report(report), encoding="utf-8")
    return json_path, md_path


def _finite(value: object) -> object:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
