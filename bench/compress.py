"""What compression buys and costs on the demos: size, quality and latency, each re-measured.

    python bench/compress.py                        # trains the demos first (minutes on 2 CPU cores)
    python bench/compress.py --classifier-ckpt RUN/checkpoints/best-epoch00-step000265.ckpt --lm-dir models/lora_demo

Classifier: the classification demo (all-MiniLM-L6-v2 on VADER movie reviews, ``experiment=demo_classification``);
its best checkpoint, or ``--classifier-ckpt``.
Causal LM: the LoRA demo (SmolLM2-135M on Shakespeare, ``experiment=demo_lm_lora``) merged by ``export``; or
``--lm-dir``, a folder ``export`` wrote (validation perplexity: the demo data has no test split).

Each model goes through ``python -m my_4090_project.quantize`` (every variant this machine can make, as
``train`` composes it) and its ``compress_report.md`` table is printed.  The last line is
``int8_acc_delta=<x> int8_size_ratio=<x> int8_latency_ratio=<x>`` for the best int8 variant of the classifier:
(or, with ``--skip-classifier``, ``int8_ppl_ratio=<x> ...`` for the causal LM's)
the fastest (p50, against the fp32 of its own runtime) among those within the quality tolerance
(accuracy at most 0.01 below fp32, perplexity at most 1.03 x fp32), or the fastest of all if none is.
``--overrides`` adds Hydra overrides to every command (the smoke test points them at tiny models).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "my_4090_project"
INT8 = ("int8_weight_only", "int8_dynamic", "onnx_int8")  # 8-bit weights (ptq_int8a_int4w has 4-bit ones)


def run(entry: str, overrides: list[str]) -> None:
    """``python -m <package>.<entry> <overrides>``; exits with its stderr when it fails."""
    command = [sys.executable, "-m", f"{PACKAGE}.{entry}", *overrides]
    print("$", shlex.join(command[1:]), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{entry} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")


def best_checkpoint(run_dir: Path) -> str:
    """The best checkpoint ``train`` named in ``run_dir/metrics.json``."""
    return json.loads((run_dir / "metrics.json").read_text())["best_checkpoint"]


def best_int8(report: dict, metric: str) -> dict:
    """The int8 variant to quote: the fastest within tolerance (see the module docstring)."""
    base = next(v for v in report["variants"] if v["name"] == report["baseline"])
    int8 = [v for v in report["variants"] if v["name"] in INT8 and v["latency_ratio"]["p50"] is not None]
    if not int8:
        sys.exit(f"no int8 variant was made; refusals: {report['refusals']}")

    def within(variant: dict) -> bool:
        if metric == "perplexity":
            return variant["metrics"][metric] <= 1.03 * base["metrics"][metric]
        return variant["metrics"][metric] >= base["metrics"][metric] - 0.01

    return min([v for v in int8 if within(v)] or int8, key=lambda v: v["latency_ratio"]["p50"])


def quantize(name: str, source: list[str], out: Path, overrides: list[str]) -> dict:
    """Quantize one model into ``out/<name>`` and print its table; returns the report."""
    output_dir = out / f"{name}_compressed"
    run("quantize", [*source, f"output_dir={output_dir}", f"hydra.run.dir={out / f'{name}_quantize'}", *overrides])
    print((output_dir / "compress_report.md").read_text(), flush=True)
    return json.loads((output_dir / "compress_report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classifier-ckpt", help="a classification checkpoint (default: train the classification demo)")
    parser.add_argument("--lm-dir", help="a causal LM folder written by export (default: train and export the LoRA demo)")
    parser.add_argument("--skip-classifier", action="store_true")
    parser.add_argument("--skip-lm", action="store_true")
    parser.add_argument("--out", help="where runs and reports go (default: a temporary folder)")
    parser.add_argument("--overrides", default="", help="Hydra overrides added to every command, space-separated")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_compress_"))
    extra = shlex.split(args.overrides)
    last = None
    if not args.skip_classifier:
        demo = ["experiment=demo_classification", *extra]
        ckpt = args.classifier_ckpt
        if ckpt is None:
            run("train", [*demo, f"hydra.run.dir={out / 'classifier_train'}"])
            ckpt = best_checkpoint(out / "classifier_train")
        report = quantize("classifier", [f"ckpt_path={ckpt}"], out, demo)
        best = best_int8(report, "accuracy")
        last = (
            f"int8_acc_delta={best['delta']['accuracy']:+.4f} int8_size_ratio={best['size_ratio']:.3f} "
            f"int8_latency_ratio={best['latency_ratio']['p50']:.3f}"
        )
        print(f"best int8 variant of the classifier: {best['name']} ({best['runtime']})")
    if not args.skip_lm:
        demo = ["experiment=demo_lm_lora", *extra]
        model_dir = args.lm_dir
        if model_dir is None:
            run("train", [*demo, f"hydra.run.dir={out / 'lm_train'}"])
            model_dir = str(out / "lm_export")
            ckpt = best_checkpoint(out / "lm_train")
            run("export", [*demo, f"ckpt_path={ckpt}", f"output_dir={model_dir}", f"hydra.run.dir={out / 'lm_export_run'}"])
        report = quantize("causal_lm", [f"model_dir={model_dir}"], out, demo)
        best = best_int8(report, "perplexity")
        print(f"best int8 variant of the causal LM: {best['name']} ({best['runtime']})")
        base = next(v for v in report["variants"] if v["name"] == report["baseline"])
        lm_line = (
            f"int8_ppl_ratio={best['metrics']['perplexity'] / base['metrics']['perplexity']:.4f} "
            f"int8_size_ratio={best['size_ratio']:.3f} int8_latency_ratio={best['latency_ratio']['p50']:.3f}"
        )
        last = last or lm_line  # the classifier's line when both were measured
    if last is None:
        sys.exit("nothing measured: drop --skip-classifier/--skip-lm")
    print(last)


if __name__ == "__main__":
    main()
