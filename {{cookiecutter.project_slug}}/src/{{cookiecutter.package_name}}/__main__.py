"""One command for every entry point: ``<package> <verb> [Hydra overrides...]`` runs the verb's module as
``python -m <package>.<module>`` would; ``<package> --help`` lists the verbs."""

from __future__ import annotations

import importlib.util
import runpy
import sys

PACKAGE = __package__

# verb: (module, one line on what it does).  A verb whose module a single-task bake lacks is not listed.
VERBS = {
    "train": ("train", "fit a model, then test the best checkpoint (ckpt_path=last resumes)"),
    "eval": ("eval", "test a checkpoint (or an exported causal LM folder) on the data's test split"),
    "predict": ("predict", "a file of rows in, the task's predictions out (one per row)"),
    "generate": ("generate", "complete prompts with a causal LM checkpoint"),
    "chat": ("chat", "talk to a causal LM checkpoint or exported folder in the terminal"),
    "serve": ("serve", "an OpenAI-compatible HTTP endpoint for a causal LM checkpoint or exported folder, on 127.0.0.1"),
    "export": ("export", "a causal LM checkpoint as a Hugging Face folder (adapters merged) and adapter/, or a GGUF file"),
    "quantize": ("quantize", "quantized variants of a checkpoint, each one's size, latency and quality measured"),
    "plan": ("plan", "peak GPU memory of a config, predicted on the CPU (plan.mode: longest, fastest, time)"),
    "inspect-data": ("inspect_data", "how the data is tokenised, which tokens are trained on"),
    "doctor": ("doctor", "check this machine: GPU, drivers, packages against the tested versions"),
    "plot": ("plot", "PNGs of a run's curves or a sweep's trials, from local files"),
}


def available() -> dict[str, str]:
    """The verbs whose module this project has, with their line."""
    return {verb: line for verb, (module, line) in VERBS.items() if importlib.util.find_spec(f"{PACKAGE}.{module}")}


def usage(verbs: dict[str, str]) -> str:
    """The help text: the usage line and one line per verb."""
    width = max(map(len, verbs))
    lines = [f"  {verb:<{width}}  {line}" for verb, line in verbs.items()]
    return (
        f"usage: {PACKAGE} <verb> [overrides...]   (e.g. {PACKAGE} train experiment=demo_classification)\n\n"
        + "\n".join(lines)
        + f"\n\n`{PACKAGE} <verb> --help` shows the verb's own options (Hydra's, for the config-driven verbs)."
    )


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]``'s module with the rest of ``argv``; exits 0 after ``--help``, 2 on a missing or unknown verb."""
    args = sys.argv[1:] if argv is None else list(argv)
    verbs = available()
    if args[:1] in (["-h"], ["--help"], ["help"]):
        print(usage(verbs))
        sys.exit(0)
    if not args or args[0] not in verbs:
        given = f"unknown verb {args[0]!r}" if args else "no verb given"
        print(f"{PACKAGE}: {given}\n\n{usage(verbs)}", file=sys.stderr)
        sys.exit(2)
    module = VERBS[args[0]][0]
    # As `python -m <package>.<module> ...`: a DDP launch then re-runs the same module in each child process.
    sys.argv = [sys.argv[0], *args[1:]]
    runpy.run_module(f"{PACKAGE}.{module}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
