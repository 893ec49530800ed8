"""How close is the step-time model to a real step?  Predicted vs measured ms per step on this CPU.

    python bench/step_time.py [--cases NAME ...] [--steps N] [--overrides KEY=VALUE ...]

For each case (a random-weight Llama in fp32, full fine-tune with AdamW, built from its config), it

- counts the step's kernels on fake tensors (``core.memory.planner.step_cost``), then ``--steps`` times:
  measures this machine's peaks (``core.memory.steptime.measure_peaks``, what ``doctor --measure``
  prints: fp32 matmul TFLOP/s, STREAM-triad bandwidth, µs per kernel of a tiny training step) and
  the case's per-step overhead (its own code on near-empty tensors, less their kernels' share:
  :func:`step_overhead_ms`), predicts the step with
  them (the roofline of ``core.memory.steptime.predict``; a CPU runs kernels one after another:
  ``kernels_overlap=false``), and times one real step of the same model, optimizer and loss
  (``core.memory.planner.training_step`` with real tensors, after one warm-up step).  Peaks and step
  are measured side by side because a shared 2-core machine's speed drifts by up to 2x within
  minutes; the error reported is the median of the rounds' errors.

Prints one line per case and ends with ``max_abs_error_pct=<x>`` (goal: <= 35).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hydra import compose, initialize_config_module
from omegaconf import open_dict

import my_4090_project  # noqa: F401  (registers the config resolvers)
from my_4090_project.core.memory.planner import architecture, step_cost, training_step
from my_4090_project.core.memory.steptime import Peaks, measure_peaks, predict
from my_4090_project.tasks import task_of

# optimizer.fused=false: torch's CPU fused AdamW does its per-value arithmetic in scalar code (about
# 2 GB/s here, a tenth of the bandwidth), where the for-each AdamW's kernels are the memory-bound
# ones a GPU runs; the roofline models the latter.
COMMON = [
    "hardware=cpu",
    "logger=none",
    "trainer=cpu",
    "experiment=demo_lm_scratch",
    "precision=32-true",
    "peft=none",
    "optimizer.fused=false",
]


def empty(overrides: list[str]) -> list[str]:
    """The case's code on near-empty tensors: the same layers, hidden and MLP width 8, one head,
    1 x 8 tokens, a 300-token vocabulary; its step is what the code costs besides its kernels' work."""
    keep = [o for o in overrides if o.startswith("model.config.num_hidden_layers=")]
    return [
        *llama(8, 8, 1, 1, 1, 8, 1)[:-1],
        *keep,
        "model.tokenizer=null",
        "model.architecture.vocab_size=300",
        "batch.global_batch_size=1",
    ]


def llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tokens: int, micro_batch: int) -> list[str]:
    return [
        f"model.config.hidden_size={hidden}",
        f"model.config.intermediate_size={intermediate}",
        f"model.config.num_hidden_layers={layers}",
        f"model.config.num_attention_heads={heads}",
        f"model.config.num_key_value_heads={kv_heads}",
        f"data.max_length={tokens}",
        f"batch.micro_batch_size={micro_batch}",
        f"batch.global_batch_size={micro_batch}",
    ]


CASES = {
    # the tests' 2-layer tiny Llama (tests/conftest.py, its 300-token vocabulary)
    "tiny_llama_2l": [*llama(64, 128, 2, 4, 2, 128, 8), "model.tokenizer=null", "model.architecture.vocab_size=300"],
    # SmolLM2-135M's shape (its config.json), random weights
    "smollm2_135m_shape": llama(576, 1536, 30, 9, 3, 256, 2),
    # SmolLM2-360M's shape, random weights
    "llama_360m": llama(960, 2560, 32, 15, 5, 256, 1),
}


def compose_case(overrides: list[str]):
    with initialize_config_module(version_base="1.3", config_module="my_4090_project.configs"):
        cfg = compose(config_name="train", overrides=COMMON + overrides)
    with open_dict(cfg):
        cfg.hardware.kernels_overlap = False
    return cfg


def step_overhead_ms(overrides: list[str], peaks: dict) -> float:
    """``hardware.step_overhead_ms`` of a case: the median time of 20 steps of its code on
    near-empty tensors (:func:`empty`) less what the roofline predicts for them (their kernels'
    launches): the Python of the model's forward, autograd's bookkeeping, the loss and optimizer
    calls, which do not scale with the tensors."""
    cfg = compose_case(empty(overrides))
    with open_dict(cfg):
        cfg.hardware.update(peaks)
    cost, _ = step_cost(cfg, task_of(cfg), architecture(cfg), 1)
    setup = training_step(cfg, task_of(cfg), architecture(cfg), 1)
    setup.step()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        setup.step()
        times.append(1e3 * (time.perf_counter() - start))
    return max(0.0, statistics.median(times) - predict(cost, Peaks.of(cfg.hardware), 1, 8).total_ms)


def rounds(cfg, cost, steps: int, overrides: list[str]) -> list[tuple[dict, float, float]]:
    """``steps`` rounds of (peaks, predicted ms, measured ms), each round's peaks and per-step
    overhead measured just before its step."""
    setup = training_step(cfg, task_of(cfg), architecture(cfg), cfg.batch.micro_batch_size)
    setup.step()  # warm-up
    out = []
    for _ in range(steps):
        peaks = measure_peaks("cpu", seconds=0.3)
        peaks["step_overhead_ms"] = round(step_overhead_ms(overrides, peaks), 2)
        with open_dict(cfg):
            cfg.hardware.update(peaks)
        predicted = predict(cost, Peaks.of(cfg.hardware), 1, cfg.batch.micro_batch_size * cfg.data.max_length)
        start = time.perf_counter()
        setup.step()
        out.append((peaks, predicted, 1e3 * (time.perf_counter() - start)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--steps", type=int, default=5, help="rounds per case (peaks, prediction, one measured step); the median error is reported"
    )
    parser.add_argument("--overrides", nargs="*", default=[], help="more train overrides for every case")
    args = parser.parse_args()
    errors = []
    for name in args.cases:
        cfg = compose_case(CASES[name] + args.overrides)
        cost, _ = step_cost(cfg, task_of(cfg), architecture(cfg), cfg.batch.micro_batch_size)
        measured = rounds(cfg, cost, args.steps, CASES[name] + args.overrides)
        round_errors = [100 * (p.total_ms - ms) / ms for _, p, ms in measured]
        error = statistics.median(round_errors)
        errors.append(abs(error))
        peaks, predicted, ms = min(measured, key=lambda r: abs(100 * (r[1].total_ms - r[2]) / r[2] - error))  # the median round
        print(
            f"peaks of this CPU ({torch.get_num_threads()} threads): " + ", ".join(f"hardware.{k}={v}" for k, v in peaks.items()),
            flush=True,
        )
        print(
            f"{name:<20} predicted {predicted.total_ms:9.1f} ms  measured {ms:9.1f} ms  error {error:+6.1f}%  "
            f"(compute {predicted.compute_ms:.0f}, memory {predicted.memory_ms:.0f}, overhead {predicted.overhead_ms:.0f} ms; "
            f"{len(cost.micro) + len(cost.optimizer)} kernels, {predicted.flops / 1e9:.1f} GFLOP; "
            f"rounds {min(round_errors):+.0f}% to {max(round_errors):+.0f}%)",
            flush=True,
        )
    print(f"max_abs_error_pct={max(errors):.1f}")


if __name__ == "__main__":
    main()
