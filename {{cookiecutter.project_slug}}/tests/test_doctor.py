"""The doctor entry point: the real report on this machine, and faked broken machines.

The faked cases replace the probes (``module_found``, ``dist_version``, ``torch_build``,
``cuda_devices``, ``nvml_info``) so a CPU machine can play a GPU box with a CPU-only torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import doctor

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
RTX_4090 = {
    "index": 0,
    "name": "NVIDIA GeForce RTX 4090",
    "capability": "8.9",
    "total_gib": 23.99,
    "free_gib": 23.55,
    "bf16": True,
    "tf32": True,
}
NVML_4090 = {"driver": "550.54.14", "cuda_driver": "12.4", "gpus": ["NVIDIA GeForce RTX 4090"], "error": None}


def pyproject_dependencies() -> dict[str, str]:
    """``{distribution: minimum}`` of ``[project] dependencies`` alone (not the extras)."""
    block = PYPROJECT.read_text().split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;<]*)[",]', block))


def pyproject_minimums() -> dict[str, str]:
    """``{distribution: minimum}`` from the ``"name>=version[,<bound]"`` lines of pyproject.toml."""
    return dict(re.findall(r'^\s*"([A-Za-z0-9_.-]+)>=([0-9][^",;<]*)[",]', PYPROJECT.read_text(), flags=re.MULTILINE))


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Rich reads the width from COLUMNS: wide enough that no table cell wraps mid-phrase."""
    monkeypatch.setenv("COLUMNS", "300")


def run_main(capsys, argv: list[str] | None = None) -> tuple[int, str]:
    """Run ``doctor.main`` in-process; return the exit code and the printed text, unwrapped."""
    code = doctor.main(argv or [])
    return code, " ".join(capsys.readouterr().out.split())


def fake_gpu_box(monkeypatch, torch_cuda: str | None, driver_cuda: str = "12.4") -> None:
    """NVML sees an RTX 4090; torch (built for ``torch_cuda``, None = CPU-only) cannot use it."""
    monkeypatch.setattr(doctor, "nvml_info", lambda: {**NVML_4090, "cuda_driver": driver_cuda})
    monkeypatch.setattr(
        doctor,
        "torch_build",
        lambda: {"version": "2.5.1+cpu" if torch_cuda is None else "2.5.1", "cuda": torch_cuda, "cudnn": None, "cuda_available": False},
    )
    monkeypatch.setattr(doctor, "cuda_devices", lambda: [])


def test_runs_on_this_machine(tmp_path):
    report_path = tmp_path / "doctor.json"
    result = subprocess.run(
        [sys.executable, "-m", "{{ cookiecutter.package_name }}.doctor", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},  # wide enough that rich does not wrap a line
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["problems"] == []
    assert report["torch"]["version"] == torch.__version__
    if torch.cuda.is_available():
        assert len(report["gpus"]) == torch.cuda.device_count()
        assert 0 < report["gpus"][0]["free_gib"] <= report["gpus"][0]["total_gib"]
    else:
        assert report["gpus"] == []
        assert "no CUDA GPU found: training runs on the CPU" in result.stdout
        assert "python -m {{ cookiecutter.package_name }}.plan" in result.stdout


def test_measure_prints_the_peaks_as_overrides_the_step_time_model_takes(capsys, tmp_path):
    from {{ cookiecutter.package_name }}.core.memory.steptime import Peaks

    from .test_planner import plan_cfg

    code, out = run_main(capsys, ["--measure", "--json", str(tmp_path / "doctor.json")])
    assert code == 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = re.search(rf"Measured peaks \({device}; [^)]*\): (.*)$", out).group(1).split()
    keys = ["hardware.peak_tflops_fp32", "hardware.peak_tflops", "hardware.memory_gbps", "hardware.op_overhead_us"]
    assert [o.split("=")[0] for o in overrides] == keys + (["hardware.kernels_overlap"] if device == "cpu" else [])
    peaks = Peaks.of(plan_cfg("hardware=cpu", *overrides).hardware)
    assert peaks.tflops > 0 and peaks.memory_gbps > 0 and peaks.op_overhead_us > 0
    assert json.loads((tmp_path / "doctor.json").read_text())["measured_peaks"]["device"] == device


def test_missing_required_package_fails_with_the_fix(monkeypatch, capsys):
    found = doctor.module_found
    monkeypatch.setattr(doctor, "module_found", lambda module: module != "transformers" and found(module))
    code, out = run_main(capsys)
    assert code == 1
    assert "problem: transformers is not installed (import transformers fails); fix: pip install -e ." in out


def test_too_old_torch_fails_with_the_fix(monkeypatch, capsys):
    version = doctor.dist_version
    monkeypatch.setattr(doctor, "dist_version", lambda dist: "2.3.1+cu121" if dist == "torch" else version(dist))
    code, out = run_main(capsys)
    assert code == 1
    assert 'torch==2.3.1+cu121 is older than the minimum 2.6 in pyproject.toml; fix: pip install -U "torch>=2.6"' in out


@pytest.mark.parametrize(
    ("version", "minimum", "is_older"),
    [
        ("2.13.0+cpu", "2.4", False),  # compared as numbers, not strings ("2.13" < "2.4" as text)
        ("2.4.0", "2.4", False),
        ("2.3.1+cu121", "2.4", True),
        ("4.57.1", "5.0", True),
        ("5.0.0rc1", "5.0", True),  # a release candidate precedes the release
    ],
)
def test_older(version, minimum, is_older):
    assert doctor.older(version, minimum) is is_older


def test_gpu_with_cpu_only_torch_fails_with_the_cuda_install(monkeypatch, capsys):
    fake_gpu_box(monkeypatch, torch_cuda=None)
    code, out = run_main(capsys)
    assert code == 1
    assert "NVML sees 1 NVIDIA GPU(s) (NVIDIA GeForce RTX 4090) but torch 2.5.1+cpu is a CPU-only build" in out
    assert "fix: pip install torch --index-url https://download.pytorch.org/whl/cu" in out
    assert "no CUDA GPU found" in out  # torch still sees none, and the report says so


def test_gpu_with_a_driver_older_than_torchs_cuda_fails_with_the_fix(monkeypatch, capsys):
    fake_gpu_box(monkeypatch, torch_cuda="12.4", driver_cuda="11.8")
    code, out = run_main(capsys)
    assert code == 1
    assert "built for CUDA 12.4 and the driver 550.54.14 supports CUDA up to 11.8; fix: update the NVIDIA driver" in out


def test_gpu_with_a_cuda_torch_that_sees_none_points_at_cuda_visible_devices(monkeypatch, capsys):
    fake_gpu_box(monkeypatch, torch_cuda="12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code, out = run_main(capsys)
    assert code == 1
    assert "finds none; fix: check CUDA_VISIBLE_DEVICES (now '')" in out


def test_a_working_gpu_is_reported_and_passes(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "nvml_info", lambda: NVML_4090)
    monkeypatch.setattr(doctor, "torch_build", lambda: {"version": "2.5.1+cu124", "cuda": "12.4", "cudnn": 90100, "cuda_available": True})
    monkeypatch.setattr(doctor, "cuda_devices", lambda: [RTX_4090])
    code, out = run_main(capsys)
    assert code == 0, out
    assert "NVIDIA GeForce RTX 4090, compute 8.9, 23.55 GiB free of 23.99 GiB, bf16 yes, TF32 yes" in out
    assert "550.54.14 (CUDA up to 12.4)" in out
    assert "no CUDA GPU" not in out
    assert "note: GPU" not in out  # (a note on installed versions may be there: tests pass inside pyproject's ranges)


def test_a_pre_ampere_gpu_and_a_busy_gpu_get_notes_not_failures(monkeypatch, capsys):
    turing = {**RTX_4090, "name": "Tesla T4", "capability": "7.5", "total_gib": 14.58, "free_gib": 9.0, "bf16": False, "tf32": False}
    monkeypatch.setattr(doctor, "nvml_info", lambda: {**NVML_4090, "gpus": ["Tesla T4"]})
    monkeypatch.setattr(doctor, "torch_build", lambda: {"version": "2.5.1+cu124", "cuda": "12.4", "cudnn": 90100, "cuda_available": True})
    monkeypatch.setattr(doctor, "cuda_devices", lambda: [turing])
    code, out = run_main(capsys)
    assert code == 0, out
    assert "note: GPU 0 (Tesla T4, compute 7.5) has no native bf16: use precision=16-mixed" in out
    assert "note: GPU 0: only 9.00 of 14.58 GiB free" in out


def test_missing_extras_never_fail(monkeypatch, capsys):
    found = doctor.module_found
    monkeypatch.setattr(doctor, "module_found", lambda module: module not in doctor.EXTRAS and found(module))
    code, out = run_main(capsys)
    assert code == 0, out
    assert "missing: pip install liger-kernel" in out


def test_module_found_without_its_parent_package():
    assert doctor.module_found("json")
    assert not doctor.module_found("no_such_parent_package.child")


def test_nvml_absent_is_reported_not_fatal(monkeypatch):
    found = doctor.module_found
    monkeypatch.setattr(doctor, "module_found", lambda module: module != "pynvml" and found(module))
    info = doctor.nvml_info()
    assert info == {**info, "driver": None, "gpus": [], "error": "nvidia-ml-py is not installed (pip install nvidia-ml-py)"}


def test_minimums_match_pyproject():
    minimums = pyproject_minimums()
    for dist, minimum in doctor.REQUIRED.values():
        assert minimums.get(dist) == minimum, f"doctor.REQUIRED says {dist}>={minimum}, pyproject.toml says {minimums.get(dist)}"


def test_every_dependency_is_required_and_no_extra_is_a_dependency():
    """pyproject's dependencies are the doctor's required packages, each with its floor; an
    optional extra is never one of them (a missing one is never a failure)."""
    dependencies = set(pyproject_dependencies())
    required = {dist for dist, _ in doctor.REQUIRED.values()}
    assert dependencies == required, f"in pyproject only: {dependencies - required}; in doctor only: {required - dependencies}"
    for extra in doctor.collect()["extras"].values():
        assert extra["distribution"] not in dependencies, extra
        assert not extra["install"].endswith("pip install -e ."), extra


def test_the_tested_versions_writer_keeps_the_direct_dependencies():
    """nvidia-ml-py (NVML) is a direct dependency, pinned like the others; torch and its CUDA runtime are not."""
    from {{ cookiecutter.package_name }}.core.run import versions

    for name in ("nvidia-ml-py", "wandb", "bitsandbytes"):
        assert not versions.NOT_PINNED.match(name), name
    for name in ("torch", "triton", "nvidia-cublas-cu12", "nvidia-nccl-cu12"):
        assert versions.NOT_PINNED.match(name), name
    tested = versions.read_tested_versions()
    assert {dist for dist, _ in doctor.REQUIRED.values()} - {"torch"} <= set(tested)


def test_no_test_compares_installed_versions_with_the_pins():
    """The tests pass inside pyproject's ranges, not only with the pinned set: a user who installs
    without ``-c tested_versions.txt`` runs them too.  No test may call the comparison of installed
    versions with tested_versions.txt, or require doctor to print no note at all."""
    forbidden = re.compile(r"tested_version_differences\(\)|[\"']note:[\"'] not in|version_differences\(versions\.read_tested_versions\(\)")
    this = Path(__file__).resolve()
    offenders = [
        f"{path.relative_to(this.parents[1])}:{number}: {line.strip()}"
        for path in sorted(this.parent.rglob("*.py"))
        if path != this
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if forbidden.search(line)
    ]
    assert offenders == []


def test_cuda_devices_reads_capability_and_memory(monkeypatch):
    """Two faked GPUs through torch.cuda: a 4090 (Ada, 8.9) and a T4 (Turing, 7.5)."""
    gib = 2**30
    fake = {  # index -> (name, capability, (free, total) bytes as cudaMemGetInfo gives them)
        0: ("NVIDIA GeForce RTX 4090", (8, 9), (int(23.5 * gib), 25_757_220_864)),
        1: ("Tesla T4", (7, 5), (int(14.0 * gib), 15_655_829_504)),
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: fake[index][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: fake[index][1])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: fake[index][2])
    ada, turing = doctor.cuda_devices()
    assert ada == {**RTX_4090, "free_gib": 23.5}
    assert (turing["capability"], turing["total_gib"], turing["bf16"], turing["tf32"]) == ("7.5", 14.58, False, False)


def test_nvml_info_decodes_driver_and_cuda_versions(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: b"550.54.14")  # bytes in old releases
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: 12040)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda handle: "NVIDIA GeForce RTX 4090")
    assert doctor.nvml_info() == NVML_4090
    assert calls == ["init", "shutdown"]


def test_a_gpu_that_fails_to_initialise_fails_with_the_error(monkeypatch, capsys):
    def busy():
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")

    monkeypatch.setattr(doctor, "nvml_info", lambda: NVML_4090)
    monkeypatch.setattr(doctor, "torch_build", lambda: {"version": "2.5.1+cu124", "cuda": "12.4", "cudnn": 90100, "cuda_available": True})
    monkeypatch.setattr(doctor, "cuda_devices", busy)
    code, out = run_main(capsys)
    assert code == 1
    assert "problem: torch finds a GPU but cannot use it: CUDA error: all CUDA-capable devices are busy or unavailable" in out
    assert "no CUDA GPU found" not in out


def test_without_rich_the_report_prints_plainly_and_fails(monkeypatch, capsys):
    found = doctor.module_found
    monkeypatch.setattr(doctor, "module_found", lambda module: module != "rich" and found(module))
    monkeypatch.setitem(sys.modules, "rich.console", None)  # `from rich.console import ...` raises ImportError
    code, out = run_main(capsys)
    assert code == 1
    assert "problem: rich is not installed (import rich fails); fix: pip install -e ." in out
    assert "required packages torch " in out  # the plain-text fallback, not a table


def test_version_differences_name_each_changed_and_each_untested_package():
    from {{ cookiecutter.package_name }}.core.run.versions import version_differences

    tested = {"lightning": "2.6.6", "datasets": "5.2.0", "wandb": "0.31.0"}
    installed = {"lightning": "2.7.0", "datasets": "5.2.0", "newdep": "1.0"}  # wandb not installed: not a difference
    assert version_differences(tested, installed) == [
        "lightning==2.7.0 is installed; tested with lightning==2.6.6",
        "newdep==1.0 is installed and needed, but not in the tested set",
    ]


def test_a_tested_versions_line_that_is_not_a_pin_names_its_line(tmp_path):
    from {{ cookiecutter.package_name }}.core.run.versions import read_tested_versions

    path = tmp_path / "tested_versions.txt"
    path.write_text("# header\nHydra_Core==1.3.8\n\nlightning>=2.5\n")
    with pytest.raises(ValueError, match=r"tested_versions.txt:4: 'lightning>=2.5' is not name==version"):
        read_tested_versions(path)
    path.write_text("# header\nHydra_Core==1.3.8  # a comment\n")
    assert read_tested_versions(path) == {"hydra-core": "1.3.8"}  # names normalised (PEP 503)


def test_the_shipped_tested_set_pins_the_dependencies_and_not_torch():
    """tested_versions.txt names every direct dependency and leaves the torch build to the user.
    (That it is exactly the set CI installed is checked by the template's own CI, which installs
    with it: here the tests pass inside pyproject's ranges too.)"""
    from {{ cookiecutter.package_name }}.core.run import versions

    tested = versions.read_tested_versions()
    assert {"lightning", "transformers", "hydra-core", "pytest", "ruff", "nvidia-ml-py"} <= set(tested)
    assert not [name for name in tested if versions.NOT_PINNED.match(name)]


def test_doctor_notes_versions_that_differ_from_the_tested_set(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "tested_version_differences", lambda: ["lightning==2.7.0 is installed; tested with lightning==2.6.6"])
    code, text = run_main(capsys)
    assert "differ from the set the tests passed with" in text and "lightning==2.7.0" in text
    assert "pip install -c src/" in text and "tested_versions.txt" in text


def test_a_machine_with_less_ram_than_the_host_budget_gets_the_budget_to_set(monkeypatch, capsys):
    from importlib import resources

    from omegaconf import OmegaConf

    card = OmegaConf.load(resources.files("{{ cookiecutter.package_name }}") / "configs" / "hardware" / "rtx4090_24gb.yaml")
    assert card.host_budget_gib == doctor.RTX4090_HOST_BUDGET_GIB  # the note quotes the shipped figure
    monkeypatch.setattr(doctor, "host_memory_gib", lambda: {"total": 15.5, "available": 12.0})
    code, out = run_main(capsys)
    assert code == 0, out
    assert "note: host memory 15.50 GiB: activation_checkpointing=offload is planned against hardware.host_budget_gib=24.0" in out
    assert "set hardware.host_budget_gib=8 " in out
    monkeypatch.setattr(doctor, "host_memory_gib", lambda: {"total": 64.0, "available": 60.0})
    assert "host_budget_gib" not in run_main(capsys)[1]
