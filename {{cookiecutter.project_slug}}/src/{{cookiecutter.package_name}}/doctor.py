"""Check that this machine can train: packages, torch build, driver and GPUs.

    python -m <package>.doctor [--json doctor.json]   # --json: also write the report as JSON
    python -m <package>.doctor --write-tested-versions src/<package>/tested_versions.txt   # after a passing test run
    python -m <package>.doctor --measure   # also measure this machine's peaks for the step-time model (~10 s)

Prints the Python, torch, CUDA, cuDNN and driver versions, each GPU, the CPUs, host memory, the optional
extras and the versions that differ from ``tested_versions.txt`` (a note). Exits 1, with each fix, when a
required package is missing or too old or torch cannot use a GPU that NVML sees; else 0 (also without a GPU).
Packages are found without importing them (``find_spec``, ``importlib.metadata``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

GIB = 2**30
# Import name -> (distribution name, minimum version); tests/test_doctor.py checks it against pyproject.toml.
REQUIRED = {
    "torch": ("torch", "2.6"),  # floors with an advisory below them: see pyproject.toml
    "lightning": ("lightning", "2.6.6"),
    "transformers": ("transformers", "5.0"),
    "datasets": ("datasets", "3.0"),
    "hydra": ("hydra-core", "1.3.8"),
    "omegaconf": ("omegaconf", "2.3"),
    "torchmetrics": ("torchmetrics", "1.4"),
    "rich": ("rich", "13.0"),
    "filelock": ("filelock", "3.12"),  # one fetch of a demo's model or data when runs share paths.cache_dir
    "peft": ("peft", "0.15"),  # LoRA/QLoRA (peft group, both tasks)
    "bitsandbytes": ("bitsandbytes", "0.45"),  # 8-bit optimizers, 4-bit NF4 weights (peft=qlora)
    "wandb": ("wandb", "0.19"),  # logger=wandb (the default)
    "pynvml": ("nvidia-ml-py", "12.0"),  # the driver and GPU checks here; GPU utilisation logging
    "pandas": ("pandas", "2.0"),
    "matplotlib": ("matplotlib", "3.7"),  # `plot`
}
# Each task config lists its own packages under `task.requires` (a project without the task lacks them).
TASK_CONFIGS = Path(__file__).parent / "configs" / "task"
# Import name -> (distribution, what it enables, install command): packages outside the dependencies; never a failure.
EXTRAS = {
    "flash_attn": (
        "flash-attn",
        "attention=flash_attention_2 (CUDA, Ampere or newer, bf16/fp16)",
        "pip install flash-attn --no-build-isolation",
    ),
    "liger_kernel": ("liger-kernel", "fused Triton kernels (RMSNorm, RoPE, cross-entropy)", "pip install liger-kernel"),
    "tensorboard": ("tensorboard", "logger=tensorboard", 'pip install -e ".[tensorboard]"'),
    "optuna": ("optuna", "Optuna sweeps (hparams_search=...)", 'pip install -e ".[sweep]"'),
    "hydra_plugins.hydra_submitit_launcher": (
        "hydra-submitit-launcher",
        "SLURM jobs (launcher=slurm)",
        'pip install -e ".[slurm]"',
    ),
}


def task_requirements() -> dict[str, tuple[str, str]]:
    """The packages the task configs name under ``task.requires``, as :data:`REQUIRED` entries (import name = distribution)."""
    import yaml  # PyYAML, a dependency of omegaconf

    found = {}
    for path in sorted(TASK_CONFIGS.glob("*.yaml")):
        task = (yaml.safe_load(path.read_text()) or {}).get("task") or {}
        for module, minimum in (task.get("requires") or {}).items():
            found[module] = (module, str(minimum))
    return found


REQUIRED.update(task_requirements())
# CUDA builds of torch; pick the tag for your torch and driver at https://pytorch.org/get-started/locally/.
CUDA_INDEX_URL = "https://download.pytorch.org/whl/cu126"
CUDA_TORCH_INSTALL = f"pip install torch --index-url {CUDA_INDEX_URL}"
PACKAGE = __package__ or "<package>"  # set under `python -m`, where __name__ is "__main__"


def collect() -> dict:
    """Gather the report as a JSON-ready dict (memory in GiB, ``None`` where unknown); prints nothing, never raises."""
    gpus, cuda_error = [], None
    if module_found("torch"):
        try:
            gpus = cuda_devices()
        except RuntimeError as error:  # e.g. "all CUDA-capable devices are busy or unavailable"
            cuda_error = str(error).strip()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"logical": os.cpu_count(), "usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None},
        "host_memory_gib": host_memory_gib(),
        "packages": {
            module: {"distribution": dist, "installed": module_found(module), "version": dist_version(dist), "minimum": minimum}
            for module, (dist, minimum) in REQUIRED.items()
        },
        "torch": torch_build() if module_found("torch") else None,
        "gpus": gpus,
        "cuda_error": cuda_error,
        "nvml": nvml_info(),
        "extras": {
            module: {
                "distribution": dist,
                "installed": module_found(module),
                "version": dist_version(dist),
                "enables": enables,
                "install": install,
            }
            for module, (dist, enables, install) in EXTRAS.items()
        },
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "version_differences": tested_version_differences(),
    }


def tested_version_differences() -> list[str] | None:
    """How the installed dependencies differ from ``tested_versions.txt``; ``None`` when that cannot be told."""
    from .core.run import versions

    try:
        installed = versions.dependency_versions(versions.project_distribution())
        return versions.version_differences(versions.read_tested_versions(), installed)
    except (LookupError, OSError, ValueError):
        return None


def problems(report: dict) -> list[str]:
    """One line per problem, each ending with its fix: a missing or too-old required package, or an NVIDIA
    GPU that NVML sees while torch can use none (no GPU at all is fine)."""
    found = []
    for module, package in report["packages"].items():
        dist, minimum = package["distribution"], package["minimum"]
        if not package["installed"]:
            found.append(f"{dist} is not installed (import {module} fails); fix: pip install -e . (in the project folder)")
        elif package["version"] is not None and older(package["version"], minimum):
            fix = f'pip install -U "{dist}>={minimum}"'
            if dist == "torch":
                fix += f" --index-url {CUDA_INDEX_URL} (the CUDA build; drop --index-url on a CPU-only machine)"
            found.append(f"{dist}=={package['version']} is older than the minimum {minimum} in pyproject.toml; fix: {fix}")

    torch, nvml = report["torch"], report["nvml"]
    if report["cuda_error"]:
        found.append(
            f"torch finds a GPU but cannot use it: {report['cuda_error']}; fix: look at `nvidia-smi` (another "
            "process holding the GPU in exclusive mode, or a GPU fallen off the bus), then free or reset the GPU"
        )
    if torch is not None and nvml["gpus"] and not torch["cuda_available"]:
        seen = f"NVML sees {len(nvml['gpus'])} NVIDIA GPU(s) ({', '.join(nvml['gpus'])})"
        if torch["cuda"] is None:
            found.append(f"{seen} but torch {torch['version']} is a CPU-only build; fix: {CUDA_TORCH_INSTALL}")
        elif nvml["cuda_driver"] and Version(torch["cuda"]).major > Version(nvml["cuda_driver"]).major:
            found.append(
                f"{seen} but torch {torch['version']} is built for CUDA {torch['cuda']} and the driver "
                f"{nvml['driver']} supports CUDA up to {nvml['cuda_driver']}; fix: update the NVIDIA driver, "
                f"or install a torch built for CUDA {Version(nvml['cuda_driver']).major}.x (https://pytorch.org/get-started/locally/)"
            )
        else:
            found.append(
                f"{seen} but torch {torch['version']} (CUDA {torch['cuda']}) finds none; fix: check "
                f"CUDA_VISIBLE_DEVICES (now {report['cuda_visible_devices']!r}) and that `nvidia-smi` runs, "
                f"then reinstall torch for the driver's CUDA {nvml['cuda_driver']}: {CUDA_TORCH_INSTALL}"
            )
    return found


# configs/hardware/rtx4090_24gb.yaml's host_budget_gib, and the RAM it leaves to everything else.
RTX4090_HOST_BUDGET_GIB = 24.0
HOST_RESERVE_GIB = 8.0


def notes(report: dict) -> list[str]:
    """Return lines about things that work but cost speed or memory, or were not tested (never a failure)."""
    found = []
    differences = report.get("version_differences")
    if differences:
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        found.append(
            f"{len(differences)} installed package(s) differ from the set the tests passed with (tested_versions.txt): {shown}. "
            f'It may work; to get the tested set: pip install -c src/{PACKAGE}/tested_versions.txt -e ".[dev]"'
        )
    for gpu in report["gpus"]:
        if not gpu["bf16"]:
            found.append(
                f"GPU {gpu['index']} ({gpu['name']}, compute {gpu['capability']}) has no native bf16: "
                "use precision=16-mixed (the default bf16-mixed is emulated there, slowly)"
            )
        if gpu["free_gib"] < 0.9 * gpu["total_gib"]:
            found.append(
                f"GPU {gpu['index']}: only {gpu['free_gib']:.2f} of {gpu['total_gib']:.2f} GiB free; another process "
                "holds the rest (see `nvidia-smi`), and the planner's budget assumes it is free"
            )
    total = (report.get("host_memory_gib") or {}).get("total")
    if total is not None and total - HOST_RESERVE_GIB < RTX4090_HOST_BUDGET_GIB:
        found.append(
            f"host memory {total:.2f} GiB: activation_checkpointing=offload is planned against hardware.host_budget_gib="
            f"{RTX4090_HOST_BUDGET_GIB} of pinned host memory (hardware=rtx4090_24gb); on this machine set "
            f"hardware.host_budget_gib={max(0.0, total - HOST_RESERVE_GIB):.0f} (the RAM less {HOST_RESERVE_GIB} GiB for the OS and the process)"
        )
    return found


def module_found(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (its parent is imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # the parent package is missing, or a module has no spec
        return False


def dist_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def older(version: str, minimum: str) -> bool:
    """Whether ``version`` is below ``minimum``; a local tag (``+cu124``) is ignored, an unparsable version is not older."""
    try:
        return Version(version) < Version(minimum)
    except InvalidVersion:
        return False


def host_memory_gib() -> dict:
    """Total and available host RAM in GiB (psutil when installed, else ``os.sysconf`` on Linux/macOS)."""
    if module_found("psutil"):
        import psutil

        memory = psutil.virtual_memory()
        return {"total": round(memory.total / GIB, 2), "available": round(memory.available / GIB, 2)}
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        available = page * os.sysconf("SC_AVPHYS_PAGES")  # free pages only: page cache counts as used
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return {"total": None, "available": None}
    return {"total": round(total / GIB, 2), "available": round(available / GIB, 2)}


def torch_build() -> dict:
    """torch's version, the CUDA it was built with (``None`` for a CPU-only build) and cuDNN."""
    import torch

    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
    }


def cuda_devices() -> list[dict]:
    """Each GPU torch can use: name, compute capability, total and free memory (GiB), bf16, TF32.
    bf16/TF32 mean native (capability >= 8.0); ``torch.cuda.is_bf16_supported()`` also says yes where bf16 is emulated."""
    import torch

    if not torch.cuda.is_available():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        free, total = torch.cuda.mem_get_info(index)  # bytes, as cudaMemGetInfo reports them
        devices.append(
            {
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "capability": f"{major}.{minor}",
                "total_gib": round(total / GIB, 2),
                "free_gib": round(free / GIB, 2),
                "bf16": major >= 8,
                "tf32": major >= 8,
            }
        )
    return devices


def nvml_info() -> dict:
    """What the driver reports through NVML: ``driver``, ``cuda_driver`` (newest CUDA it supports, e.g. ``"12.4"``),
    ``gpus`` (names) and ``error`` (why NVML could not be read, else ``None``)."""
    info = {"driver": None, "cuda_driver": None, "gpus": [], "error": None}
    if not module_found("pynvml"):
        info["error"] = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        return info
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:  # libnvidia-ml missing (no driver), or the driver is not loaded
        info["error"] = f"no NVIDIA driver found ({error})"
        return info
    try:
        info["driver"] = as_text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 for CUDA 12.4
        info["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        info["gpus"] = [
            as_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))) for index in range(pynvml.nvmlDeviceGetCount())
        ]
    except pynvml.NVMLError as error:
        info["error"] = f"NVML query failed ({error})"
    finally:
        pynvml.nvmlShutdown()
    return info


def as_text(value: str | bytes) -> str:
    """NVML strings are ``bytes`` in older nvidia-ml-py releases and ``str`` in newer ones."""
    return value.decode() if isinstance(value, bytes) else value


def sections(report: dict) -> list[tuple[str, list[tuple[str, ...]]]]:
    """The report as titled tables of rows (item, value[, what it enables]), in print order."""
    memory, torch, nvml = report["host_memory_gib"], report["torch"], report["nvml"]
    machine = [
        ("python", report["python"]),
        ("platform", report["platform"]),
        ("CPUs", f"{report['cpu']['usable'] or report['cpu']['logical']} usable of {report['cpu']['logical']}"),
        ("host memory", "unknown" if memory["total"] is None else f"{memory['available']:.2f} GiB available of {memory['total']:.2f} GiB"),
    ]
    if torch is not None:
        machine += [
            ("torch", torch["version"]),
            ("torch build", f"CUDA {torch['cuda']}" if torch["cuda"] else "CPU-only build"),
            ("cuDNN", str(torch["cudnn"]) if torch["cudnn"] else "none"),
        ]
    if nvml["error"]:
        machine.append(("NVIDIA driver", f"unknown: {nvml['error']}"))
    else:
        machine.append(("NVIDIA driver", f"{nvml['driver']} (CUDA up to {nvml['cuda_driver']}), sees {len(nvml['gpus'])} GPU(s)"))
    for gpu in report["gpus"]:
        machine.append(
            (
                f"GPU {gpu['index']}",
                f"{gpu['name']}, compute {gpu['capability']}, {gpu['free_gib']:.2f} GiB free of {gpu['total_gib']:.2f} GiB, "
                f"bf16 {'yes' if gpu['bf16'] else 'no'}, TF32 {'yes' if gpu['tf32'] else 'no'}",
            )
        )
    if not report["gpus"] and not report["cuda_error"]:
        machine.append(
            (
                "GPU",
                f"no CUDA GPU found: training runs on the CPU (slow); the planner (`python -m {PACKAGE}.plan`) still works",
            )
        )
    required = [
        (
            package["distribution"],
            f"{package['version'] or 'version unknown'} (needs >= {package['minimum']})" if package["installed"] else "MISSING",
        )
        for package in report["packages"].values()
    ]
    extras = [
        (
            extra["distribution"],
            (extra["version"] or "installed") if extra["installed"] else f"missing: {extra['install']}",
            extra["enables"],
        )
        for extra in report["extras"].values()
    ]
    return [("machine", machine), ("required packages", required), ("optional extras (never required)", extras)]


def render(report: dict, found: list[str], advice: list[str]) -> None:
    """Print the report as tables, then the notes and problems (each with its fix)."""
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:  # rich missing is itself a problem (below); print the report plainly
        for title, lines in sections(report):
            print(f"\n{title}")
            for item, *values in lines:
                print(f"  {item:<24} {'  '.join(values)}")
        for line in advice:
            print(f"note: {line}")
        for line in found:
            print(f"problem: {line}")
        return
    console = Console(highlight=False)
    for title, lines in sections(report):
        table = Table(title=title, title_justify="left", show_header=False)
        table.add_column(style="bold", no_wrap=True)
        for _ in lines[0][1:]:
            table.add_column(overflow="fold")
        for line in lines:
            table.add_row(*map(escape, line))  # values are text, not rich markup
        console.print(table)
    for line in advice:
        console.print(f"[yellow]note:[/yellow] {escape(line)}")
    for line in found:
        console.print(f"[red]problem:[/red] {escape(line)}")
    if not found:
        console.print("[green]ok:[/green] every required package is installed")


def main(argv: list[str] | None = None) -> int:
    """Console script / ``python -m`` entry; returns 1 when :func:`problems` finds any, else 0."""
    parser = argparse.ArgumentParser(prog=f"{PACKAGE} doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report (and its problems) as JSON")
    parser.add_argument(
        "--write-tested-versions",
        type=Path,
        metavar="PATH",
        help="write the installed versions of the project's dependencies (with the dev extra) as a constraints file, and exit",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also measure matmul TFLOP/s, memory bandwidth and per-op overhead (the first CUDA GPU, else the CPU) "
        "and print them as hardware.* overrides for plan.mode=fastest|time",
    )
    args = parser.parse_args(argv)
    if args.write_tested_versions is not None:
        from .core.run import versions

        installed = versions.dependency_versions(versions.project_distribution())
        versions.write_tested_versions(args.write_tested_versions, installed, PACKAGE)
        print(f"{len(installed)} versions written to {args.write_tested_versions}")
        return 0

    report = collect()
    found, advice = problems(report), notes(report)
    render(report, found, advice)
    if args.measure and report["torch"] is not None:
        from .core.memory.steptime import measure_peaks

        device = "cuda" if report["gpus"] else "cpu"
        report["measured_peaks"] = {"device": device, **measure_peaks(device)}
        overrides = " ".join(f"hardware.{key}={value}" for key, value in report["measured_peaks"].items() if key != "device")
        kind = "" if device == "cuda" else " hardware.kernels_overlap=false"
        print(f"\nMeasured peaks ({device}; the step-time model's, core/memory/steptime.py):\n  {overrides}{kind}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report, "problems": found, "notes": advice}, indent=2) + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
