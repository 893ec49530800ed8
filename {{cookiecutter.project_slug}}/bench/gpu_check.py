"""A GPU check in one command: what only a CUDA GPU can show, measured in a few minutes.

    PYTHONPATH=src python bench/gpu_check.py                  # the default cases, <= 5 min
    PYTHONPATH=src python bench/gpu_check.py --cases planner host_syncs --timeout 120
    PYTHONPATH=src python bench/gpu_check.py --cases planner_8b   # the Llama-3.1-8B recipes (longer)

Runs from the source tree (no install needed; ``PYTHONPATH=src``).  Each case imports only what
it needs; a case whose package is missing is reported as ``not run: <package> missing`` and the
others go on.  Each case runs in its own process under ``--timeout`` seconds, and each result is
appended to ``gpu_check.json`` (``--out``) as soon as it is measured; at the end the whole table
is printed and written as Markdown (``gpu_check.md``).  On a machine without a CUDA GPU it
refuses to start, with one line.

Cases (``--cases``; see ``docs/measuring.md``):

- ``planner``: the memory planner's predicted peak (``plan``) against
  ``torch.cuda.max_memory_allocated`` over three real steps of the same model (random weights)
  at the recipe's micro-batch and length, for the 24 GB recipes that fit in the default time;
  ``planner_8b`` does the Llama-3.1-8B ones.
- ``throughput``: tokens/s and MFU of ``train`` (the full path: callbacks, loggers, data module)
  for a SmolLM2-135M-shaped full fine-tune and a GPT-2-124M-shaped pretrain, against a plain
  PyTorch loop on the same batches (same model, bf16 autocast, fused AdamW, clipping).  MFU =
  tokens/s x training FLOPs per token / the GPU's dense bf16 peak (the peak and its source are
  printed: ``core/callbacks/throughput.py``'s table).
- ``host_syncs``: CUDA synchronisations per optimizer step of ``train`` (counted with
  ``torch.cuda.set_sync_debug_mode("warn")`` over ten steps).
- ``sparse_2_4``: a 2:4 semi-structured sparse Linear (``torch.sparse.to_sparse_semi_structured``)
  against the dense one: the speed the ``semi_structured_2_4`` pruning method can buy.
- ``int4_nf4``: latency of a 4096 x 4096 Linear at one token and at 512 tokens: bf16, NF4
  (bitsandbytes, QLoRA's base), int4 weight-only (torchao, ``quantize``'s int4).
- ``flash_varlen``: a packed causal-LM step (rows of several documents, position ids restarting)
  with ``flash_attention_2`` (varlen kernels) against SDPA, tokens/s.
- ``offload``: activation offloading (``activation_checkpointing=offload``) against checkpointing
  alone on a 1B-shaped Llama at 8,192 tokens: ms per step, peak GPU memory, and whether the
  gradients are bit-identical (the copies are exact).
- ``flex_packed``: packed rows under ``flex_attention`` against SDPA with its dense mask: the
  largest relative gradient difference (bf16) and tokens/s.
- ``step_time``: the step-time roofline (``core/memory/steptime.py``) calibrated on this GPU: its peaks
  measured (``measure_peaks("cuda")``, what ``doctor --measure`` prints), then predicted vs
  measured ms per step (the median of 5 after 2 warm-up steps) for the ``planner`` recipes, with
  the measured peaks and with the ``hardware=rtx4090_24gb`` figures.
- ``checkpoint_write``: a full fine-tune's checkpoint (weights + AdamW state) of the last
  ``planner`` recipe, saved by the shipped checkpoint IO: ms of a synchronous save, ms the
  training thread waits for a background one (the stage to pinned host memory), ms per step
  with a background write in flight against without, and the staged bytes against the
  planner's ``host_staging``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from {{ cookiecutter.package_name }}.tasks import task_of

CUDA_ONLY_LINE = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one"
DEFAULT_CASES = [
    "planner",
    "throughput",
    "host_syncs",
    "sparse_2_4",
    "int4_nf4",
    "flash_varlen",
    "offload",
    "flex_packed",
    "step_time",
    "checkpoint_write",
]
ALL_CASES = [*DEFAULT_CASES, "planner_8b"]
PLANNER_RECIPES = {
{%- if cookiecutter.tasks == "classification" %}
    "planner": ["sst2_bert_base"],
    "planner_8b": [],
{%- else %}
    "planner": [{% if cookiecutter.tasks == "both" %}"sst2_bert_base", {% endif %}"lm_smollm2_135m_full", "lm_llama32_1b_full"],
    "planner_8b": ["lm_llama31_8b_lora", "lm_llama31_8b_qlora", "lm_llama31_8b_full"],
{%- endif %}
}
# The cases that train a causal LM through `train` (not in a classification-only project).
LM_CASES = ("throughput", "host_syncs")
GIB = 1024**3


# ------------------------------------------------------------------------ table arithmetic
def error_pct(predicted: float, measured: float) -> float:
    """Signed error of a prediction in % of the measurement: ``100 (predicted - measured) / measured``.

    Raises:
        ValueError: ``measured`` is not positive.
    """
    if measured <= 0:
        raise ValueError(f"measured={measured}: a positive measurement is needed for a relative error")
    return 100.0 * (predicted - measured) / measured


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s (``tokens_per_s x flops_per_token``) over
    the peak (``peak_tflops`` x 1e12 FLOP/s; PaLM, Chowdhery et al. 2022, Appendix B); ``None``
    without a peak."""
    if not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or ``None`` when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return value / reference


def row(case: str, item: str, value: float | None = None, unit: str = "", reference: float | None = None, **extra) -> dict:
    """One line of the table: ``case``, ``item``, the measured ``value`` (in ``unit``), what it is
    compared with (``reference``, same unit), their ``ratio``; ``status`` ok unless given."""
    return {
        "case": case,
        "item": item,
        "value": value,
        "unit": unit,
        "reference": reference,
        "ratio": ratio(value, reference),
        "status": "ok",
        **extra,
    }


def not_run(case: str, reason: str) -> dict:
    """The row of a case that could not run (``reason``: ``<package> missing``, ``timed out``...)."""
    return {"case": case, "item": "-", "value": None, "unit": "", "reference": None, "ratio": None, "status": f"not run: {reason}"}


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table: case, item, value, unit, reference, ratio, status, note."""
    header = "| case | item | value | unit | reference | ratio | status | note |\n|---|---|---|---|---|---|---|---|\n"
    lines = [
        "| " + " | ".join(_cell(r.get(k)) for k in ("case", "item", "value", "unit", "reference", "ratio", "status", "note")) + " |"
        for r in rows
    ]
    return header + "\n".join(lines) + "\n"


def append_results(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the JSON list in ``path`` (created if missing), written whole through a
    temporary file renamed into place, so a kill leaves the previous list."""
    existing = json.loads(path.read_text()) if path.is_file() else []
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(existing + rows, indent=1) + "\n")
    os.replace(partial, path)


# ----------------------------------------------------------------------------- helpers
def cuda_time(fn: Callable[[], object], warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` on the GPU (CUDA events, after ``warmup`` calls)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import {{ cookiecutter.package_name }}  # noqa: F401  (registers the config resolvers)

    configs = Path({{ cookiecutter.package_name }}.__file__).parent / "configs"
    with initialize_config_dir(version_base="1.3", config_dir=str(configs)):
        return hydra_compose(config_name="train", overrides=overrides)


def write_lm_data(folder: Path, vocab_size: int, tokens: int) -> dict[str, Path]:
    """A word-level tokenizer of ``vocab_size`` made-up words (EOS ``</s>``; no download), and
    text files of random words (one token each): ``tokens`` for train, a few thousand for validation."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["</s>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>").save_pretrained(folder / "tokenizer")
    rng = random.Random(0)
    (folder / "train").mkdir(parents=True, exist_ok=True)
    per_file = 50_000
    for index in range(math.ceil(tokens / per_file)):
        (folder / "train" / f"doc{index:04d}.txt").write_text(" ".join(rng.choices(words[2:], k=per_file)) + "\n")
    (folder / "validation.txt").write_text(" ".join(rng.choices(words[2:], k=8192)) + "\n")
    return {"tokenizer": folder / "tokenizer", "train": folder / "train", "validation": folder / "validation.txt"}


# ------------------------------------------------------------------------------- cases
def case_planner(name: str) -> list[dict]:
    """Predicted (``plan``) vs measured peak allocated memory, per recipe."""
    import torch

    from {{ cookiecutter.package_name }}.core.memory.planner import architecture, plan_memory, training_step

    rows = []
    for recipe in PLANNER_RECIPES[name]:
        cfg = compose([f"experiment={recipe}", "logger=none"])
        config = architecture(cfg)
        micro_batch = cfg.batch.micro_batch_size
        plan = plan_memory(cfg, task_of(cfg), micro_batch=micro_batch, search=False)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        setup = training_step(cfg, task_of(cfg), config, micro_batch, device="cuda")
        for _ in range(3):
            setup.step()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        note = f"micro-batch {micro_batch} x {cfg.data.max_length}, error {error_pct(plan.peak_allocated, measured):+.1f} %"
        rows.append(row(name, recipe, plan.peak_allocated / GIB, "GiB predicted", measured / GIB, note=note))
        del setup
    return rows


def case_step_time(name: str) -> list[dict]:
    """Predicted (roofline, with this GPU's measured peaks and with the 4090's) vs measured ms per optimizer step."""
    import torch
    from omegaconf import open_dict

    from {{ cookiecutter.package_name }}.core.memory.planner import architecture, step_cost, training_step
    from {{ cookiecutter.package_name }}.core.memory.steptime import Peaks, measure_peaks, predict

    measured_peaks = measure_peaks("cuda")
    rows = [row(name, f"peaks: {key}", value) for key, value in measured_peaks.items()]
    for recipe in PLANNER_RECIPES["planner"]:
        cfg = compose([f"experiment={recipe}", "logger=none", "batch.global_batch_size=${batch.micro_batch_size}"])
        config = architecture(cfg)
        micro_batch = cfg.batch.micro_batch_size
        cost, _ = step_cost(cfg, task_of(cfg), config, micro_batch)
        card = predict(cost, Peaks.of(cfg.hardware), 1, micro_batch * cfg.data.max_length).total_ms
        with open_dict(cfg):
            cfg.hardware.update(measured_peaks)
        here = predict(cost, Peaks.of(cfg.hardware), 1, micro_batch * cfg.data.max_length).total_ms
        setup = training_step(cfg, task_of(cfg), config, micro_batch, device="cuda")
        measured = cuda_time(setup.step, warmup=2, repeats=5)
        note = (
            f"4090 figures: {card:.1f} ms ({error_pct(card, measured):+.1f} %); this GPU's peaks: error {error_pct(here, measured):+.1f} %"
        )
        rows.append(row(name, recipe, here, "ms predicted", measured, note=note))
        del setup
        torch.cuda.empty_cache()
    return rows


def case_checkpoint_write(name: str) -> list[dict]:
    """A background checkpoint write's cost per training step on this GPU, against a synchronous save."""
    import tempfile
    import time

    import torch

    from {{ cookiecutter.package_name }}.core.checkpoints.io import AtomicCheckpointIO
    from {{ cookiecutter.package_name }}.core.memory.planner import architecture, plan_memory, training_step
    from {{ cookiecutter.package_name }}.core.models.levers import pinned_block

    recipe = PLANNER_RECIPES["planner"][-1]
    cfg = compose([f"experiment={recipe}", "logger=none", "batch.global_batch_size=${batch.micro_batch_size}"])
    setup = training_step(cfg, task_of(cfg), architecture(cfg), cfg.batch.micro_batch_size, device="cuda")
    model = setup.loss
    for _ in range(2):
        setup.step()
    torch.cuda.synchronize()

    def checkpoint() -> dict:
        return {"global_step": 1, "state_dict": model.state_dict(), "optimizer_states": [setup.optimizer.state_dict()]}

    def steps(count: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            setup.step()
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - start) / count

    plain_ms = steps(5)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "last.ckpt"
        sync = AtomicCheckpointIO(background=False)
        start = time.perf_counter()
        sync.save_checkpoint(checkpoint(), path)
        sync_ms = 1000 * (time.perf_counter() - start)
        io = AtomicCheckpointIO(background=True)
        io.save_checkpoint(checkpoint(), path)  # the first stage allocates the pinned buffers
        io.flush()
        start = time.perf_counter()
        io.save_checkpoint(checkpoint(), path)
        stage_ms = 1000 * (time.perf_counter() - start)
        start, count = time.perf_counter(), 0
        while count < 50 and (count < 5 or io.writer.pending):  # steps while the write runs
            setup.step()
            count += 1
        torch.cuda.synchronize()
        during_ms = 1000 * (time.perf_counter() - start) / count
        io.flush()
        staged = sum(pinned_block(size) for size in io.stager.held_sizes())
    recipe_cfg = compose([f"experiment={recipe}", "hardware=rtx4090_24gb"])
    planned = plan_memory(recipe_cfg, task_of(recipe_cfg), search=False).host_staging
    mb = 2**20
    return [
        row(name, f"{recipe}: synchronous save", sync_ms, "ms"),
        row(name, f"{recipe}: background save, training thread waits", stage_ms, "ms", sync_ms),
        row(name, f"{recipe}: step during a background write", during_ms, "ms", plain_ms, note=f"{count} steps overlapped the write"),
        row(name, f"{recipe}: staged pinned host memory", staged / mb, "MiB", planned / mb, note="reference: plan.json host_staging"),
    ]


def _train_tokens_per_s(cfg, steps: int) -> float:
    """tokens/s of ``train(cfg)`` over optimizer steps 1..N (a timing callback added last)."""
    import contextlib
    import io

    from omegaconf import open_dict

    from {{ cookiecutter.package_name }}.train import train

    install_callbacks()
    with open_dict(cfg):
        cfg.callbacks.gpu_check_timer = {"_target_": "__main__.StepTimer"}
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg)
    tokens = (steps - 1) * cfg.batch.global_batch_size * cfg.data.max_length
    return tokens / globals()["StepTimer"].seconds


def _loop_tokens_per_s(cfg, model, steps: int) -> float:
    """tokens/s of a plain loop: forward under bf16 autocast, backward, clip, fused AdamW step."""
    import torch

    model = model.cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    shape = (cfg.batch.micro_batch_size, cfg.data.max_length)
    batches = [torch.randint(0, model.config.vocab_size, shape, device="cuda") for _ in range(4)]
    accumulate = cfg.batch.accumulate_grad_batches
    start = None
    for step in range(steps):
        if step == 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
        for micro in range(accumulate):
            ids = batches[(step * accumulate + micro) % len(batches)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / accumulate
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (steps - 1) * accumulate * shape[0] * shape[1] / (time.perf_counter() - start)


THROUGHPUT_SHAPES = {
    # (experiment or model overrides, the architecture); recipes' micro-batch x length
    "smollm2_135m_full_ft": ["experiment=lm_smollm2_135m_full"],
    "gpt2_124m_pretrain": [
        "experiment=demo_lm_scratch",
        "model=tiny_gpt2",
        "model.config.n_embd=768",
        "model.config.n_layer=12",
        "model.config.n_head=12",
        "model.config.n_positions=1024",
        "data.max_length=1024",
        "batch.micro_batch_size=16",
        "batch.global_batch_size=32",
        "precision=bf16-mixed",
    ],
}


def case_throughput(name: str, steps: int = 30) -> list[dict]:
    """tokens/s and MFU of ``train`` vs a plain loop, per shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from {{ cookiecutter.package_name }}.core.callbacks.throughput import PEAK_BF16_TFLOPS, architecture, flops_per_token, peak_tflops_for

    device_name = torch.cuda.get_device_name()
    peak = peak_tflops_for(device_name)
    source = next(
        (s for pattern, _, s in PEAK_BF16_TFLOPS if peak is not None and __import__("re").search(pattern, device_name.lower())), ""
    )
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for shape, overrides in THROUGHPUT_SHAPES.items():
            base = compose(overrides)
            # The shape: the model file's config (from scratch), else its published numbers.
            fields = dict(base.model.config or base.model.architecture)
            fields.pop("of", None)
            vocab = int(fields.pop("vocab_size", 50257))
            model_type = fields.pop("model_type")
            data = write_lm_data(Path(folder) / shape, vocab, (steps + 4) * base.batch.global_batch_size * base.data.max_length)
            spec = ",".join([f"model_type:{model_type}", *(f"{k}:{v}" for k, v in fields.items())])
            run_overrides = [
                *overrides,
                "model.name_or_path=null",
                "model.config={" + spec + "}",
                f"model.tokenizer={data['tokenizer']}",
                "model.fetch=null",
                "data=text_files",
                f"data.splits.train={data['train']}",
                f"data.splits.validation={data['validation']}",
                f"data.max_length={base.data.max_length}",
                f"trainer.max_steps={steps}",
                f"paths.output_dir={Path(folder) / shape / 'run'}",
                "test_after_fit=false",
                "callbacks.sample_generation=null",
            ]
            cfg = compose(run_overrides)
            config = AutoConfig.for_model(model_type, vocab_size=vocab, **fields)
            n_layers, n_heads, head_dim = architecture(config)
            model = AutoModelForCausalLM.from_config(config)
            per_token = flops_per_token(sum(p.numel() for p in model.parameters()), 0, n_layers, n_heads, head_dim, cfg.data.max_length)
            loop = _loop_tokens_per_s(cfg, model, steps)
            del model
            torch.cuda.empty_cache()
            project = _train_tokens_per_s(cfg, steps)
            utilisation = mfu(project, per_token, peak)
            note = f"MFU {utilisation:.3f} (peak {peak} TFLOP/s: {source})" if utilisation is not None else f"no peak for {device_name!r}"
            rows.append(row("throughput", shape, project, "tokens/s train", loop, note=note))
            if shape == "smollm2_135m_full_ft":  # the data loader default (num_workers: 0), measured here
                # (a run folder of its own: train refuses one that holds a run)
                workers_run = f"paths.output_dir={Path(folder) / shape / 'run_workers'}"
                workers = _train_tokens_per_s(compose([*run_overrides, "data.num_workers=2", workers_run]), steps)
                rows.append(row("throughput", f"{shape}, data.num_workers=2", workers, "tokens/s train", project, note="vs 0 workers"))
    return rows


def case_host_syncs(name: str) -> list[dict]:
    """CUDA synchronisations per optimizer step of ``train`` (steps 5-14 of a small causal LM)."""
    import warnings

    import torch

    with tempfile.TemporaryDirectory() as folder:
        data = write_lm_data(Path(folder), 32000, 40 * 8 * 512)
        cfg = compose(
            [
                "experiment=demo_lm_scratch",
                f"model.tokenizer={data['tokenizer']}",
                "data=text_files",
                f"data.splits.train={data['train']}",
                f"data.splits.validation={data['validation']}",
                "data.max_length=512",
                "batch.micro_batch_size=8",
                "batch.global_batch_size=8",
                "trainer.max_steps=16",
                "precision=bf16-mixed",
                f"paths.output_dir={Path(folder) / 'run'}",
                "test_after_fit=false",
                "callbacks.sample_generation=null",
            ]
        )
        from omegaconf import open_dict

        from {{ cookiecutter.package_name }}.train import train

        install_callbacks()
        with open_dict(cfg):
            cfg.callbacks.gpu_check_syncs = {"_target_": "__main__.SyncCounter"}
        with warnings.catch_warnings():
            train(cfg)
        torch.cuda.set_sync_debug_mode(0)
    counts = globals()["SyncCounter"].counts
    per_step = statistics.median(counts) if counts else None
    return [row("host_syncs", "train, demo_lm_scratch shape, 8 x 512", per_step, "syncs/step", note=f"steps 6-15: {counts}")]


def case_sparse_2_4(name: str) -> list[dict]:
    """Dense vs 2:4 semi-structured sparse Linear (fp16, 4096 x 4096, 2,048 tokens)."""
    import torch
    from torch.sparse import to_sparse_semi_structured

    weight = torch.randn(4096, 4096, dtype=torch.float16, device="cuda")
    mask = torch.tensor([1, 1, 0, 0], dtype=torch.bool, device="cuda").tile(4096, 1024)
    pruned = weight * mask
    sparse = to_sparse_semi_structured(pruned)
    x = torch.randn(2048, 4096, dtype=torch.float16, device="cuda")
    dense_ms = cuda_time(lambda: torch.nn.functional.linear(x, pruned))
    sparse_ms = cuda_time(lambda: torch.nn.functional.linear(x, sparse))
    return [row("sparse_2_4", "Linear 4096x4096 fp16, 2048 tokens", sparse_ms, "ms 2:4", dense_ms, note="ratio < 1: 2:4 is faster")]


def case_int4_nf4(name: str) -> list[dict]:
    """bf16 vs NF4 (bitsandbytes) vs int4 weight-only (torchao) Linear latency."""
    import torch

    rows = []
    linear = torch.nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16, device="cuda")
    for tokens in (1, 512):
        x = torch.randn(tokens, 4096, dtype=torch.bfloat16, device="cuda")
        base = cuda_time(lambda: linear(x))
        try:
            import bitsandbytes as bnb

            nf4 = bnb.nn.Linear4bit(4096, 4096, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            nf4.load_state_dict(linear.state_dict())
            nf4 = nf4.cuda()
            rows.append(
                row("int4_nf4", f"NF4 (bitsandbytes), {tokens} token(s)", cuda_time(lambda: nf4(x)), "ms", base, note="reference: bf16")
            )
        except ImportError as error:
            rows.append(not_run("int4_nf4", f"{error.name} missing (NF4)"))
        try:
            import copy

            from torchao.quantization import Int4WeightOnlyConfig, quantize_

            int4 = copy.deepcopy(linear)
            quantize_(int4, Int4WeightOnlyConfig(group_size=128))
            rows.append(row("int4_nf4", f"int4 weight-only (torchao), {tokens} token(s)", cuda_time(lambda: int4(x)), "ms", base))
        except ImportError as error:
            rows.append(not_run("int4_nf4", f"{error.name} missing (int4)"))
    return rows


def case_flash_varlen(name: str) -> list[dict]:
    """A packed causal-LM step (8 documents a row, position ids restarting) with
    ``flash_attention_2`` vs SDPA: tokens/s of forward + backward."""
    import flash_attn  # noqa: F401  (the varlen kernels; not run without it)
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    )
    batch, length, documents = 8, 2048, 8
    ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
    positions = (torch.arange(length, device="cuda") % (length // documents)).expand(batch, -1)
    timings = {}
    for implementation in ("flash_attention_2", "sdpa"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.bfloat16).cuda()

        def step(model: torch.nn.Module = model) -> None:
            model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()

        timings[implementation] = cuda_time(step, warmup=2, repeats=5)
        del model, step
        torch.cuda.empty_cache()
    per_s = {k: batch * length / (ms / 1000) for k, ms in timings.items()}
    return [
        row("flash_varlen", "SmolLM2-135M shape, 8 x 2048, 8 documents a row", per_s["flash_attention_2"], "tokens/s flash", per_s["sdpa"])
    ]


def _llama_1b_shape(layers: int = 16):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8
    )


def _grads_and_time(model, step, repeats: int = 3) -> tuple[dict, float, float]:
    """Gradients of one ``step()``, then its median ms over ``repeats`` and the peak GiB."""
    import torch

    model.zero_grad(set_to_none=True)
    step()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.cuda.reset_peak_memory_stats()

    def again() -> None:
        model.zero_grad(set_to_none=True)
        step()

    ms = cuda_time(again, warmup=1, repeats=repeats)
    return grads, ms, torch.cuda.max_memory_allocated() / 2**30


def case_offload(name: str) -> list[dict]:
    """Checkpointing with and without offloading, same weights and batch: ms/step and peak memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from {{ cookiecutter.package_name }}.core.models.levers import apply_memory_levers

    length = 8192
    ids = torch.randint(0, 32000, (1, length), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_llama_1b_shape(), attn_implementation="sdpa", dtype=torch.bfloat16).cuda().train()
        levers = apply_memory_levers(model, {"mode": "full", "offload": offload, "offload_min_bytes": 2**20, "mlp_tiles": 1})

        def step(model=model) -> None:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

        results[offload] = (*_grads_and_time(model, step), levers.tensors if levers else 0)
        del model
        torch.cuda.empty_cache()
    (plain, ms, peak, _), (grads, off_ms, off_peak, moved) = results[False], results[True]
    same = all(torch.equal(grads[k], v) for k, v in plain.items())
    shape = f"1B-shape Llama (16 layers), bf16, 1 x {length}"
    return [
        row("offload", shape, off_ms, "ms/step offloaded", ms, note=f"gradients bit-identical: {same}; {moved} tensors moved"),
        row("offload", shape, off_peak, "GiB peak offloaded", peak),
    ]


def case_flex_packed(name: str) -> list[dict]:
    """Packed rows (8 documents a row): flex_attention vs SDPA's dense mask, gradients and speed."""
    import torch
    from transformers import AutoModelForCausalLM

    batch, length, documents = 2, 4096, 8
    ids = torch.randint(0, 32000, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    positions = (torch.arange(length, device="cuda") % (length // documents)).expand(batch, -1)
    results = {}
    for implementation in ("sdpa", "flex_attention"):
        torch.manual_seed(0)
        config = _llama_1b_shape(layers=4)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.bfloat16).cuda().train()

        def step(model=model) -> None:
            model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()

        results[implementation] = _grads_and_time(model, step)
        del model
        torch.cuda.empty_cache()
    (dense, ms, peak), (flex, flex_ms, flex_peak) = results["sdpa"], results["flex_attention"]
    worst = max(((flex[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12)).item() for k, v in dense.items())
    shape = f"1B-shape Llama (4 layers), bf16, {batch} x {length}, {documents} documents a row"
    per_s = lambda t: batch * length / (t / 1000)  # noqa: E731
    return [
        row("flex_packed", shape, per_s(flex_ms), "tokens/s flex", per_s(ms), note=f"largest relative gradient difference {worst:.2e}"),
        row("flex_packed", shape, flex_peak, "GiB peak flex", peak),
    ]


CASE_FUNCTIONS: dict[str, Callable[[str], list[dict]]] = {
    "planner": case_planner,
    "planner_8b": case_planner,
    "throughput": case_throughput,
    "host_syncs": case_host_syncs,
    "sparse_2_4": case_sparse_2_4,
    "int4_nf4": case_int4_nf4,
    "flash_varlen": case_flash_varlen,
    "offload": case_offload,
    "step_time": case_step_time,
    "checkpoint_write": case_checkpoint_write,
    "flex_packed": case_flex_packed,
}


# ---------------------------------------------------------- callbacks the cases add to train
def install_callbacks() -> None:
    """Define :class:`StepTimer` and :class:`SyncCounter` (Lightning callbacks the cases add to
    ``train``'s config as ``__main__.<name>``) once Lightning is known to be there."""
    import lightning as L
    import torch

    class StepTimer(L.Callback):
        """Seconds from the start of optimizer step 1 to the end of training (class-level result)."""

        seconds = math.nan

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1 and not hasattr(self, "start"):
                torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            torch.cuda.synchronize()
            StepTimer.seconds = time.perf_counter() - self.start

    class SyncCounter(L.Callback):
        """CUDA synchronisations per optimizer step over steps 5-14 (sync debug mode "warn":
        one warning per synchronising call)."""

        counts: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            import warnings

            step = trainer.global_step
            if step == 5 and not hasattr(self, "caught"):
                torch.cuda.set_sync_debug_mode("warn")
                self.catcher = warnings.catch_warnings(record=True)
                self.caught = self.catcher.__enter__()
                warnings.simplefilter("always")
                self.mark, self.step = 0, step
            elif hasattr(self, "caught") and step != self.step and step <= 15:
                syncs = sum("synchroniz" in str(w.message).lower() for w in self.caught)
                SyncCounter.counts.append(syncs - self.mark)
                self.mark, self.step = syncs, step
                if step == 15:
                    torch.cuda.set_sync_debug_mode(0)
                    self.catcher.__exit__(None, None, None)

    globals().update(StepTimer=StepTimer, SyncCounter=SyncCounter)


# ---------------------------------------------------------------------------------- main
def run_case_here(name: str, out: Path) -> None:
    """The child process side: run one case, write its rows (or why it did not run) to ``out``."""
    import importlib.util

    try:
        if name in LM_CASES and importlib.util.find_spec("{{ cookiecutter.package_name }}.tasks.causal_lm.module") is None:
            rows = [not_run(name, "this project has no causal_lm task")]
        else:
            rows = CASE_FUNCTIONS[name](name)
    except ImportError as error:
        rows = [not_run(name, f"{error.name or error} missing")]
    except Exception as error:  # one failing case must not hide the others' results
        first_line = (str(error).splitlines() or [""])[0][:200]
        rows = [{**not_run(name, ""), "status": f"failed: {type(error).__name__}: {first_line}"}]
    out.write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=ALL_CASES)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per case (default 120)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="results, appended as each case ends")
    parser.add_argument("--run-case", help=argparse.SUPPRESS)  # internal: the child process
    parser.add_argument("--case-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_case:
        run_case_here(args.run_case, args.case_out)
        return 0
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; fix: pip install torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(CUDA_ONLY_LINE, file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    print(f"gpu_check on {device}, torch {torch.__version__}; results appended to {args.out}", flush=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    table = []
    for name in args.cases:
        with tempfile.TemporaryDirectory() as folder:
            case_out = Path(folder) / "rows.json"
            command = [sys.executable, __file__, "--run-case", name, "--case-out", str(case_out)]
            start = time.perf_counter()
            try:
                subprocess.run(command, timeout=args.timeout, check=False, capture_output=True, text=True)
                rows = json.loads(case_out.read_text()) if case_out.is_file() else [not_run(name, "the case process died (see its stderr)")]
            except subprocess.TimeoutExpired:
                rows = [not_run(name, f"timed out after {args.timeout} s")]
        seconds = time.perf_counter() - start
        rows = [{**r, "device": device, "torch": torch.__version__, "date": stamp, "seconds": round(seconds, 1)} for r in rows]
        append_results(args.out, rows)
        table += rows
        print(markdown_table(rows).splitlines()[-1] if len(rows) == 1 else markdown_table(rows).split("\n", 2)[2].rstrip(), flush=True)
    text = markdown_table(table)
    args.out.with_suffix(".md").write_text(f"GPU check, {device}, torch {torch.__version__}, {stamp}\n\n{text}")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
