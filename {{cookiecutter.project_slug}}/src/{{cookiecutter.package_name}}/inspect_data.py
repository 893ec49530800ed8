"""See what a chat run trains on: rows rendered with the chat template, trained tokens marked.

    python -m <package>.inspect_data experiment=demo_sft_sentiment rows=3
    python -m <package>.inspect_data data=chat data.splits.train=data/train.jsonl split=train first_row=40

Prints ``rows`` rows of ``split`` (from ``first_row``) as ``train`` tokenises them, trained tokens green
(or between ``[[`` and ``]]``; ``color=always|never``), with token counts; a preference pair shows each side.
Then names the rows ``train`` would drop, by reason (the data module's ``drops``: no trained token left after truncation;
a preference pair tied by it). (``inspect`` is stdlib's.)

Exit codes: 0 every row is kept; 2 some rows would be dropped (no trained token; a preference pair tied by truncation);
1 bad config or data."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig
from rich.console import Console
from rich.text import Text

from .core.errors import ConfigError
from .core.run.entry import exit_on_bad_input, hydra_main
from .tasks import check_config
from .tasks.causal_lm.chat import ChatDataModule
from .tasks.causal_lm.text import IGNORE_INDEX

EXIT_ROWS_DROPPED = 2
OPEN, CLOSE = "[[", "]]"  # around trained tokens when there is no colour


def marked_text(tokenizer, input_ids: list[int], labels: list[int], color: bool) -> Text:
    """The row's text run by run: trained runs (label kept) green or between :data:`OPEN`/:data:`CLOSE`; position 0 is never a target."""
    text = Text()
    trained = [index > 0 and label != IGNORE_INDEX for index, label in enumerate(labels)]
    start = 0
    while start < len(input_ids):
        end = start
        while end < len(input_ids) and trained[end] == trained[start]:
            end += 1
        piece = tokenizer.decode(input_ids[start:end])
        if not trained[start]:
            text.append(piece, style="dim" if color else "")
        elif color:
            text.append(piece, style="bold green")
        else:
            text.append(f"{OPEN}{piece}{CLOSE}")
        start = end
    return text


def inspect_data(cfg: DictConfig, console: Console | None = None) -> list[int]:
    """Print the rows (see the module docstring); return the rows of the split with no trained token.

    Raises:
        ConfigError: a data config that is not chat data, or an unknown ``split``/``color``.
        DataError: the data module's errors (a malformed row, a template whose spans cannot be found).
    """
    check_config(cfg)
    if cfg.color not in ("auto", "always", "never"):
        raise ConfigError(f"color={cfg.color!r} is not one of auto, always, never; fix: color=auto")
    if not isinstance(cfg.rows, int) or cfg.rows < 0 or not isinstance(cfg.first_row, int) or cfg.first_row < 0:
        raise ConfigError(f"rows={cfg.rows!r} and first_row={cfg.first_row!r} must be integers >= 0; fix: rows=5 first_row=0")
    datamodule = hydra.utils.instantiate(cfg.data)
    if not isinstance(datamodule, ChatDataModule):
        raise ConfigError(
            f"data._target_={cfg.data._target_!r} is not chat data; inspect_data shows chat rows (fix: data=chat, or an experiment that uses it)"
        )
    if cfg.split not in datamodule.splits:
        raise ConfigError(
            f"split={cfg.split!r} is not one of this data's splits ({', '.join(datamodule.splits)}); fix: split=train "
            "(with data.splits.validation null, train holds out data.val_fraction of train's rows: they are train rows here)"
        )
    datamodule.prepare_data()
    datamodule.prepare_tokenizer()
    rows = datamodule.split_rows(cfg.split)  # (a list of train files: the mix, as train reads it)
    console = console or Console(force_terminal={"always": True, "never": False}.get(cfg.color), highlight=False, soft_wrap=True)
    color = console.is_terminal if cfg.color == "auto" else cfg.color == "always"
    legend = "trained tokens in green, masked ones dim" if color else f"trained tokens between {OPEN} and {CLOSE}, masked ones plain"
    console.print(f"{cfg.split}: {len(rows)} rows, train_on={datamodule.train_on}, max_length={datamodule.max_length}; {legend}\n")
    if cfg.first_row >= len(rows):
        console.print(f"first_row={cfg.first_row} is past the last row ({len(rows) - 1}): no row printed")
    for index in range(cfg.first_row, min(cfg.first_row + cfg.rows, len(rows))):
        row = rows[index]
        where = f"row {row['row']} of data.splits.{cfg.split}[{row['part']}]" if "part" in row else f"row {row['row']}"
        if "desirable" in row:  # (KTO's unpaired answers)
            where += ": a desirable answer" if row["desirable"] else ": an undesirable answer"
        console.print(
            f"--- {where}: {row['length']} tokens, {row['n_trained']} trained, "
            + (f"{row['truncated']} truncated" if row["truncated"] >= 0 else "more truncated (a long row: not tokenised past the cut)"),
            style="bold" if color else "",
        )
        for prefix in datamodule.SIDE_PREFIXES:  # a preference pair: each side, as trained
            if prefix:
                console.print(f"{prefix.rstrip('_')}: {row[prefix + 'n_trained']} trained", style="bold" if color else "")
            console.print(marked_text(datamodule.tokenizer, row[prefix + "input_ids"], row[prefix + "labels"], color))
    dropped = []
    for reason, at in datamodule.drops(rows).items():
        numbers = [rows[index]["row"] for index in at]
        if numbers:
            shown = f"{numbers[:50]}{' ...' if len(numbers) > 50 else ''}"
            console.print(f"\n{len(numbers)} of {len(rows)} rows would be dropped by train, eval and test: rows {shown}, {reason}")
        dropped += numbers
    if not dropped:
        console.print(f"\nevery one of the {len(rows)} rows is kept")
    return dropped


@hydra_main("inspect_data")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: exit codes as in the module docstring."""
    with exit_on_bad_input():
        dropped = inspect_data(cfg)
    if dropped:
        sys.exit(EXIT_ROWS_DROPPED)


if __name__ == "__main__":
    main()
