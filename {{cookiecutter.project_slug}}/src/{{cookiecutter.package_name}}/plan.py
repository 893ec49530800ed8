"""Predict a run's peak GPU memory without a GPU: the same overrides as ``train``.

    python -m <package>.plan experiment=lm_llama31_8b_qlora
    python -m <package>.plan experiment=lm_llama32_1b_full batch.micro_batch_size=2 hydra.run.dir=RUN

Prints a table (parameters, gradients, optimizer state, activations, temporaries, total, in GiB)
against ``hardware.budget_gib``, the verdict and the largest micro-batch that fits, and writes
``plan.json`` and ``plan.txt`` into the run directory.  Reads no weights and no data; see
:mod:`.memory.planner` for the method and its corrections.
"""

from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig

from .checks import validate_config
from .memory.planner import for_the_card, plan_memory, write_plan
from .utils.config import config_warnings
from .utils.outputs import claim_outputs
from .utils.run import exit_on_bad_input, hydra_main


@hydra_main("plan")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry."""
    with exit_on_bad_input():
        cfg = for_the_card(cfg)  # precision=auto: the card's, not this machine's
        validate_config(cfg, runs_here=False)  # planned for cfg.hardware, not for this machine
        for warning in config_warnings(cfg):
            rank_zero_warn(warning)
        claim_outputs(cfg, {}, {}, run_files=("plan.json", "plan.txt"))  # (never over another run's plan)
        start = time.perf_counter()
        plan = plan_memory(cfg)
    run_dir = Path(cfg.paths.output_dir)
    write_plan(plan, run_dir, cfg.hardware.name)
    print(plan.table(cfg.hardware.name))
    print(f"({time.perf_counter() - start:.1f} s; written to {run_dir / 'plan.json'})")


if __name__ == "__main__":
    main()
