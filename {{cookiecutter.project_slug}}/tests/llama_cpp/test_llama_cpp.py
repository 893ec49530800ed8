"""llama.cpp itself reads what ``export format=gguf`` writes: llama-cpp-python, built from its source distribution.

The one tier the template's CI leaves out (the build takes minutes): ``pytest -m llama_cpp`` after

    CMAKE_ARGS="-DGGML_NATIVE=off -DLLAVA_BUILD=off" pip install --no-binary llama-cpp-python "llama-cpp-python>=0.3.36,<0.4"
    pytest -m llama_cpp -s   # -s prints each comparison's figures

On the tiny random Llamas of tests/test_gguf_export.py (both pre-tokenizers, Llama 3's RoPE scaling) and on shortened
runs of the two SmolLM2 demos (``demo_lm_lora``: plain text; ``demo_sft_sentiment``: chat; the package index is needed,
as for the real_data tier): llama.cpp's tokenizer gives our ids, its next-token logits agree with ours (top-1 share and
largest difference, per type), and the chat export answers as ``generate`` does and stops at its end of turn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=off -DLLAVA_BUILD=off" pip install --no-binary llama-cpp-python "llama-cpp-python>=0.3.36,<0.4"'

TEXTS = [
    "ROMEO. But soft, what light through yonder window breaks?",
    "Café, naïve façade; Straße — 2024 fools paid 3.14 € each!",
    "Emoji: 🙂🚀 and 中文 text",
    "def f(x):\n    return {'a': x ** 2}  # code\n\n\ttabs",
]
# Top-1 agreement at least, and the largest |logit difference| at most, per type (SmolLM2 demos: logits of order 10-30).
# Measured (2026-12-05, llama-cpp-python 0.3.36 on the CPU): F16 1.000 / 0.09-0.16; Q8_0 0.92-0.94 / 2.5-2.6 (llama.cpp
# also rounds the activations to 8 bits for Q8_0 weights, and many positions of these texts are near ties).
AGREEMENT = {"f16": 0.99, "q8_0": 0.90}
LOGIT_DIFFERENCE = {"f16": 0.5, "q8_0": 3.5}


def load(path: Path, **options):
    """llama.cpp's model of the GGUF file ``path`` (every position's logits kept)."""
    try:
        import llama_cpp
    except ImportError:
        pytest.fail(f"the llama_cpp tier needs llama-cpp-python: {INSTALL}")
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, **options)


def compare(llm, model, ids: list[int]) -> tuple[float, float]:
    """``(top-1 agreement, largest |logit difference|)`` of llama.cpp and ``model`` on ``ids`` (next-token logits)."""
    llm.reset()
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)])  # (T, V)
    with torch.no_grad():
        ours = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()  # (T, V)
    return float((theirs.argmax(-1) == ours.argmax(-1)).mean()), float(np.abs(theirs - ours).max())


@pytest.mark.parametrize("kind", ["smollm", "llama3"])
@pytest.mark.parametrize("type_name", list(AGREEMENT))
def test_tiny_llamas_tokenise_and_score_alike_in_llama_cpp(kind, type_name, tmp_path):
    from {{ cookiecutter.package_name }}.tasks.causal_lm.gguf_file import write_gguf

    from ..test_gguf_export import tiny_model

    model, tokenizer = tiny_model(kind)
    llm = load(write_gguf(model, tokenizer, tmp_path / "m.gguf", type_name, "tiny"))
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tokenizer(text, add_special_tokens=False)["input_ids"], text
    top1, difference = compare(llm, model, tokenizer(" ".join(TEXTS), add_special_tokens=False)["input_ids"][:120])
    print(f"tiny {kind} {type_name}: top-1 {top1:.3f}, max |logit difference| {difference:.4f}")
    assert top1 >= AGREEMENT[type_name] and difference <= LOGIT_DIFFERENCE[type_name] / 20  # (tiny logits are about 1)


def run(*command: str, timeout: int = 1500) -> None:
    result = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def demo_exports(tmp_path_factory) -> dict[str, dict]:
    """Shortened runs of both SmolLM2 demos, each exported as F16 and Q8_0: ``{demo: {"ckpt", type: gguf path}}``."""
    cache, exports = tmp_path_factory.getbasetemp() / "shared_cache", {}  # (the real_data tier's, when both run)
    for demo in ("demo_lm_lora", "demo_sft_sentiment"):
        run_dir = tmp_path_factory.mktemp(demo) / "run"
        short = ["trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "test_after_fit=false"]
        short += ["data.answer_rows=4"] if demo == "demo_sft_sentiment" else []  # (greedy answers before and after: a few)
        run("{{ cookiecutter.package_name }}.train", f"experiment={demo}", *short, f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}")
        exports[demo] = {"ckpt": run_dir / "checkpoints" / "last.ckpt", "cache": cache}
        for type_name in AGREEMENT:
            out = run_dir.parent / f"gguf_{type_name}"
            run(
                "{{ cookiecutter.package_name }}.export",
                f"experiment={demo}",
                f"ckpt_path={exports[demo]['ckpt']}",
                f"output_dir={out}",
                "format=gguf",
                f"outtype={type_name}",
                "measure=false",
                f"hydra.run.dir={run_dir.parent / f'export_{type_name}'}",
                f"paths.cache_dir={cache}",
            )
            exports[demo][type_name] = next(out.glob("*.gguf"))
    return exports


def trained(demo_exports: dict, demo: str):
    """The demo run's checkpoint as ``generate`` loads it (a CausalLMModule, fp32)."""
    from {{ cookiecutter.package_name }}.generate import load_generator

    from ..conftest import compose_config

    cache = demo_exports[demo]["cache"]
    return load_generator(
        compose_config("generate", [f"experiment={demo}", f"ckpt_path={demo_exports[demo]['ckpt']}", f"paths.cache_dir={cache}"])
    )


@pytest.mark.parametrize("demo", ["demo_lm_lora", "demo_sft_sentiment"])
@pytest.mark.parametrize("type_name", list(AGREEMENT))
def test_the_demo_exports_tokenise_and_score_as_the_checkpoint_in_llama_cpp(demo_exports, demo, type_name):
    module = trained(demo_exports, demo)
    model, tokenizer = module.merged_model().eval(), module.tokenizer
    llm = load(demo_exports[demo][type_name])
    texts = TEXTS + (["<|im_start|>user\nIs this good?<|im_end|>\n<|im_start|>assistant\n"] if demo == "demo_sft_sentiment" else [])
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tokenizer(text, add_special_tokens=False)["input_ids"], text
    sequences = [tokenizer(" ".join(TEXTS), add_special_tokens=False)["input_ids"]]
    if demo == "demo_sft_sentiment":
        sequences.append(module.messages_ids([{"role": "user", "content": "A warm, funny and moving film."}]))
    scores = [compare(llm, model, ids) for ids in sequences]
    top1 = sum(s[0] * len(ids) for s, ids in zip(scores, sequences)) / sum(map(len, sequences))
    difference = max(s[1] for s in scores)
    line = f"{demo} {type_name}: top-1 {top1:.3f} of {sum(map(len, sequences))} positions, max |logit difference| {difference:.3f}"
    print(line)
    Path(demo_exports[demo]["ckpt"]).parent.parent.joinpath(f"llama_cpp_{type_name}.json").write_text(json.dumps(line))
    assert top1 >= AGREEMENT[type_name] and difference <= LOGIT_DIFFERENCE[type_name]


def test_the_chat_export_answers_as_generate_does_and_stops_at_its_end_of_turn(demo_exports):
    module = trained(demo_exports, "demo_sft_sentiment")
    review = "A warm, funny and moving film with a wonderful cast."
    expected = module.generate_text([review], max_new_tokens=40)[0]
    llm = load(demo_exports["demo_sft_sentiment"]["f16"])
    messages = [{"role": "system", "content": module.inputs.system_prompt}, {"role": "user", "content": review}]
    answer = llm.create_chat_completion(messages=messages, max_tokens=40, temperature=0.0)["choices"][0]
    print(f"llama.cpp chat: {answer['message']['content']!r} ({answer['finish_reason']}); generate: {expected!r}")
    assert answer["finish_reason"] == "stop" and answer["message"]["content"].strip() == expected.strip()
