"""Predict a run's peak GPU memory and step time without a GPU: the same overrides as ``train``.

    python -m <package>.plan experiment=lm_llama31_8b_qlora
    python -m <package>.plan experiment=lm_llama32_1b_full batch.micro_batch_size=2 hydra.run.dir=RUN
    python -m <package>.plan experiment=lm_llama31_8b_qlora_chat plan.mode=longest   # or largest, fastest, time
    python -m <package>.plan experiment=lm_llama31_8b_qlora_grpo plan.mode=largest plan.key=grpo.num_generations

``plan.mode=fit`` (default) prints the memory table (GiB) against ``hardware.budget_gib``, the verdict and the
largest micro-batch that fits; for the other modes see :mod:`.core.memory.modes`. Writes ``plan.json`` and
``plan.txt``; reads no weights and no data (method: :mod:`.core.memory.planner`); exits 1 on bad config."""

from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig

from .core.config.validate import config_warnings
from .core.memory import modes
from .core.memory.planner import architecture, for_the_card, plan_memory, write_plan
from .core.run.entry import exit_on_bad_input, hydra_main
from .core.run.outputs import claim_outputs
from .tasks import check_config


@hydra_main("plan")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry."""
    with exit_on_bad_input():
        cfg = for_the_card(cfg)  # precision=auto: the card's, not this machine's
        task = check_config(cfg, runs_here=False)  # planned for cfg.hardware, not for this machine
        for warning in config_warnings(cfg):
            rank_zero_warn(warning)
        mode = modes.check_mode(cfg)  # (before any trace)
        claim_outputs(cfg, {}, {}, run_files=("plan.json", "plan.txt"))  # (never over another run's plan)
        start = time.perf_counter()
        config = architecture(cfg)
        run_dir = Path(cfg.paths.output_dir)
        hardware = cfg.hardware.name
        if mode == "fit":
            plan = plan_memory(cfg, task, config=config)
            text, extra = plan.table(hardware), {}
        elif mode == "longest":
            found = modes.longest_context(cfg, task, config)
            plan, text = found.plan, found.text(hardware)
            extra = {"longest_max_length": found.length, "length_step": found.step, "above": found.above, "traces": found.traces}
            extra["settings"] = found.changes
        elif mode == "largest":
            found = modes.largest_value(cfg, task, config)
            plan, text = found.plan, found.text(hardware)
            extra = {"key": found.key, "largest": found.value, "max_value": found.bound, "traces": found.traces}
        elif mode == "fastest":
            ranked, traced, closest = modes.fastest_levers(cfg, task, config)
            plan, text = None, modes.fastest_text(cfg, ranked, traced, closest)
            extra = {"fastest": [modes.candidate_json(c) for c in ranked], "closest": closest, "traces": traced}
        else:
            end = modes.time_to_end(cfg, task, config)
            plan, text = end.plan, end.text(hardware)
            extra = {"steps": end.steps, "hours": round(end.hours, 3), "step_time": modes.time_json(end.time)}
    write_plan(plan, run_dir, hardware, text, {"mode": mode, **extra})
    print(text)
    print(f"({time.perf_counter() - start:.1f} s; written to {run_dir / 'plan.json'})")


if __name__ == "__main__":
    main()
