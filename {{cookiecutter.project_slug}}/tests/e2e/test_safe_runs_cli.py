"""Safe runs on the command line, as a user meets them: one launch per run folder (the second is
refused while the first runs, a fresh one after it ends); a secret typed or read from the
environment is found in no file of the run and in no line printed; (causal LM) a 5 MB one-line
document is tokenised under a memory limit that whole-text tokenisation exceeds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

from ..processes import run_module, subprocess_env


def wait_for(condition, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_second_launch_on_a_folder_in_use_is_refused_and_a_fresh_one_after_it_too(cli_base, tmp_path):
    run_dir, go = tmp_path / "run", tmp_path / "go"
    args = [
        *cli_base,
        f"hydra.run.dir={run_dir}",
        "logger=csv",
        "+callbacks.hold._target_=faults.WaitForFile",
        f"+callbacks.hold.path={go}",
    ]
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.train", *args]
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    lock = run_dir / "run.lock"
    try:
        wait_for(lambda: first.poll() is not None or (lock.is_file() and lock.read_text().strip()))
        assert json.loads(lock.read_text())["pid"] == first.pid
        second = run_module("train", [*cli_base, f"hydra.run.dir={run_dir}", "logger=csv", "ckpt_path=auto"], cwd=tmp_path)
        assert second.returncode == 1 and f"is in use by another launch (pid {first.pid} on " in second.stderr, second.stderr[-2000:]
        assert "Traceback" not in second.stderr
    finally:
        go.touch()
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    fresh = run_module("train", [*cli_base, f"hydra.run.dir={run_dir}", "logger=csv"], cwd=tmp_path)
    assert fresh.returncode == 1 and f"hydra.run.dir='{run_dir}' holds a run" in fresh.stderr and "ckpt_path=last" in fresh.stderr


def test_a_secret_typed_or_read_from_the_environment_is_in_no_file_and_no_line(cli_base, tmp_path):
    typed = f"sk-typed-{uuid.uuid4().hex}"
    refused = run_module("train", [*cli_base, f"hydra.run.dir={tmp_path / 'typed'}", f"+logger.wandb.api_key={typed}"], cwd=tmp_path)
    assert refused.returncode == 1 and "logger.wandb.api_key=*** is a credential typed into the config" in refused.stderr
    assert typed not in refused.stdout + refused.stderr
    assert not [p for p in (tmp_path / "typed").rglob("*") if p.is_file() and typed.encode() in p.read_bytes()]
    sweep = tmp_path / "sweep"  # a multirun: Hydra writes multirun.yaml (the overrides) before any job runs
    swept = run_module("train", [*cli_base, "-m", f"hydra.sweep.dir={sweep}", f"+logger.wandb.api_key={typed}", "seed=1,2"], cwd=tmp_path)
    assert swept.returncode == 1 and "logger.wandb.api_key=*** is a credential typed into the config" in swept.stderr
    assert not sweep.exists() and typed not in swept.stdout + swept.stderr

    secret = f"sk-env-{uuid.uuid4().hex}"
    env_dir = tmp_path / "env"
    command = [
        sys.executable,
        "-m",
        "{{ cookiecutter.package_name }}.train",
        *cli_base,
        f"hydra.run.dir={env_dir}",
        "logger=[csv,wandb]",  # W&B offline (the subprocess environment): its run files are greped too
        "+logger.wandb.notes=${oc.env:MY_SERVICE_API_TOKEN}",
        "task_name=${oc.env:MY_SERVICE_API_TOKEN}",  # also the W&B group
    ]
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**subprocess_env(), "MY_SERVICE_API_TOKEN": secret}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = [path for path in env_dir.rglob("*") if path.is_file()]
    assert (env_dir / ".hydra" / "config.yaml").is_file() and list(env_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert [str(path) for path in written if secret.encode() in path.read_bytes()] == []
    assert secret not in result.stdout + result.stderr
    assert "***" in (env_dir / "config_tree.log").read_text()

{%- if cookiecutter.tasks != "classification" %}


def test_a_5_mb_one_line_document_is_tokenised_under_a_memory_limit(lm_tokenizer_dir, tmp_path):
    """The data module's setup runs in a process whose address space may grow by 350 MiB after the
    imports; tokenising the 5 MB line whole took 520 MiB more (measured), in pieces 162."""
    script = """
import resource
from pathlib import Path
from conftest import lm_documents
from {{ cookiecutter.package_name }}.tasks.causal_lm.text import TextDataModule
folder = Path(FOLDER)
document = " ".join(lm_documents(80000, seed=1)).replace("\\n", " ")[:5_000_000]
(folder / "train.txt").write_text(document + "\\n")
(folder / "validation.txt").write_text("the king speaks to a fool.\\n")
size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + 350 * 2**20, size + 350 * 2**20))
splits = dict(train=str(folder / "train.txt"), validation=str(folder / "validation.txt"))
datamodule = TextDataModule(
    splits=splits, hub_name=None, hub_config=None, text_column="text", sample_by="document", tokenizer=TOKENIZER,
    mode="pack", max_length=64, batch_size=8, val_fraction=0.1, val_split_seed=0, num_workers=0, pad_to_multiple_of=None,
    group_by_length=False, cache_dir=str(folder / "cache"), fetch=None,
)
datamodule.setup("fit")
print("tokens", datamodule.token_counts["train"], "characters", len(document))
""".replace("FOLDER", repr(str(tmp_path))).replace("TOKENIZER", repr(str(lm_tokenizer_dir)))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, characters = int(result.stdout.split()[1]), int(result.stdout.split()[3])
    assert characters == 5_000_000 and tokens > 1_000_000
{%- endif %}
