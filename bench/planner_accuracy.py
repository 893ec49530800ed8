"""How close is the memory planner to a real step?  Predicted vs measured peak on the CPU.

    python bench/planner_accuracy.py [--cases NAME ...] [--overrides KEY=VALUE ...]

For each case (train overrides on small random-weight models, sized so activations are at least
half of the peak; DPO and GRPO with LoRA among them: weight-dominated cases are plain arithmetic and prove little), it

- predicts the peak allocated bytes with the planner (fake tensors, no real memory), and
- measures a real step in a fresh subprocess: the same model, optimizer and loss built by
  ``core.memory.planner.training_step`` with real tensors, two steps (the first allocates the optimizer
  state), and the process's peak resident memory (``ru_maxrss``) above its resident memory just
  before the model is built.  This is independent of the memory tracker the planner uses.

The cases use fp32 or (for Llama-family models, whose norms and softmax cast explicitly) bf16
autocast, where CPU and CUDA autocast keep the same dtypes, so the planner's CUDA-rule emulation
does not separate prediction from measurement.  Prints one line per case and ends with
``max_abs_error_pct=<x>`` (goal: <= 10).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

from hydra import compose, initialize_config_module

import my_4090_project  # noqa: F401  (registers the config resolvers)
from my_4090_project.core.memory.planner import GIB, architecture, plan_memory, training_step
from my_4090_project.tasks import task_of

COMMON = ["hardware=cpu", "logger=none", "trainer=cpu"]
# One case a line, as written (the lists differ by task, so the formatter's layout would too).
# fmt: off
# A 4-layer Llama (hidden 256) with the SmolLM2 vocabulary (49,152): at 8 x 512 tokens the logits
# and activations dominate the 0.1 GB of weights.
LLAMA = ["experiment=demo_lm_scratch", "model.config.hidden_size=256", "model.config.intermediate_size=768",
         "model.config.num_hidden_layers=4", "data.max_length=512", "batch.micro_batch_size=8", "batch.global_batch_size=8"]
CASES = {
    "llama_fp32": LLAMA + ["precision=32-true"],
    # bf16 matmuls are emulated (slow) on CPUs without AVX512-BF16/AMX: a quarter of the tokens.
    "llama_bf16_mixed": LLAMA + ["precision=bf16-mixed", "data.max_length=256", "batch.micro_batch_size=4", "batch.global_batch_size=4"],
    "llama_fp32_checkpointing": LLAMA + ["precision=32-true", "activation_checkpointing=full", "batch.micro_batch_size=16", "batch.global_batch_size=16"],
    "llama_fp32_chunked_loss": LLAMA + ["precision=32-true", "loss=chunked", "loss.chunk_size=128"],
    "llama_fp32_step_in_backward": LLAMA + ["precision=32-true", "optimizer.step_in_backward=true", "trainer.gradient_clip_val=null"],
    "smollm2_lora_fp32": ["experiment=demo_lm_lora", "precision=32-true", "data.max_length=512",
                          "batch.micro_batch_size=4", "batch.global_batch_size=4"],
    "minilm_classifier_fp32": ["experiment=demo_classification", "precision=32-true", "data.max_length=512",
                               "batch.micro_batch_size=32", "batch.global_batch_size=32"],
    # DPO with LoRA: 4 pairs = 8 sequences, the adapters-off reference forward, the lm_head on the answer half only.
    "smollm2_dpo_lora_fp32": ["experiment=demo_dpo_sentiment", "precision=32-true", "data.max_length=512",
                              "batch.micro_batch_size=4", "batch.global_batch_size=4"],
    # GRPO with LoRA and the KL term: 2 prompts x G=8 sampled to 384 tokens (the measured step samples them for real,
    # after a first step, so the optimizer state is there; the plan is the larger of sampling and forward/backward).
    "smollm2_grpo_lora_fp32": ["experiment=demo_grpo_sentiment", "precision=32-true", "data.max_length=512",
                               "data.max_completion_length=384", "batch.micro_batch_size=2", "batch.global_batch_size=2"],
}
# fmt: on


# glibc serves allocations above its mmap threshold with mmap and returns them to the OS on free,
# so resident memory follows live tensors.  The threshold is dynamic by default (it grows up to
# 32 MiB after frees), and a tensor below it lands on the heap, whose freed holes stay resident:
# fix it at 128 KiB so the measurement is of tensors, not of heap fragmentation (glibc mallopt(3)).
MEASURE_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}


def compose_case(overrides: list[str]):
    with initialize_config_module(version_base="1.3", config_module="my_4090_project.configs"):
        return compose(config_name="train", overrides=COMMON + overrides)


def measure(overrides: list[str]) -> int:
    """Peak resident bytes of two real training steps above the resident bytes before the build."""
    cfg = compose_case(overrides)
    config = architecture(cfg)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    setup = training_step(cfg, task_of(cfg), config, cfg.batch.micro_batch_size)
    setup.step()
    if "grpo" in cfg:  # the sampling phase, for real: every completion runs to its full length
        sample(setup.loss.model, cfg, config.vocab_size)
    setup.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline


def sample(model, cfg, vocab_size: int) -> None:
    """GRPO's generation of one micro-batch: ``micro_batch x G`` completions of ``data.max_completion_length`` tokens."""
    import torch

    rows, completion = cfg.batch.micro_batch_size * cfg.grpo.num_generations, cfg.data.max_completion_length
    prompts = torch.randint(0, vocab_size, (rows, cfg.data.max_length - completion))
    model.eval()
    with torch.no_grad():
        model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=completion,
                       min_new_tokens=completion, pad_token_id=0, use_cache=True)  # fmt: skip
    model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--overrides", nargs="*", default=[], help="more train overrides for every case (a smaller shape, say)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the subprocess side
    args = parser.parse_args()
    if args.measure:
        print(json.dumps({"measured": measure(CASES[args.measure] + args.overrides)}))
        return
    errors = []
    for name in args.cases:
        cfg = compose_case(CASES[name] + args.overrides)
        plan = plan_memory(cfg, task_of(cfg), search=False)
        command = [sys.executable, __file__, "--measure", name, "--overrides", *args.overrides]
        child = subprocess.run(command, capture_output=True, text=True, env=MEASURE_ENV)
        if child.returncode:
            raise SystemExit(f"{name}: the measuring subprocess failed:\n{child.stderr[-3000:]}")
        measured = json.loads(child.stdout.strip().splitlines()[-1])["measured"]
        predicted = plan.peak_allocated
        error = 100 * (predicted - measured) / measured
        errors.append(abs(error))
        share = plan.activations + plan.temporaries
        print(
            f"{name:<30} predicted {predicted / GIB:6.3f} GiB  measured {measured / GIB:6.3f} GiB  "
            f"error {error:+6.1f}%  (activations+temporaries {100 * share / predicted:.0f}% of the peak)",
            flush=True,
        )
    print(f"max_abs_error_pct={max(errors):.1f}")


if __name__ == "__main__":
    main()
