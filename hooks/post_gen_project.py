"""Tidy the generated project.  Never prompts: it must run under ``--no-input`` with no terminal."""

import pathlib

PROJECT = pathlib.Path.cwd()

# Empty folders that git would drop are kept with a .gitkeep; nothing else to remove yet
# (the causal-LM path arrives with the `tasks` option and is removed here when not chosen).
for folder in ("data", "logs"):
    (PROJECT / folder).mkdir(exist_ok=True)
    (PROJECT / folder / ".gitkeep").touch()
