"""Validate the names before cookiecutter writes any file.

Cookiecutter renders this file with the user's answers and runs it before generating the
project; a non-zero exit makes cookiecutter generate nothing.  Both ``project_slug`` and
``package_name`` must be valid, non-keyword Python identifiers: the slug names the
directory and the console scripts, the package is imported as ``import <package_name>``.
"""

import keyword
import sys

NAMES = {
    "project_slug": {{ cookiecutter.project_slug | jsonify }},
    "package_name": {{ cookiecutter.package_name | jsonify }},
}
PROJECT_NAME = {{ cookiecutter.project_name | jsonify }}
# cookiecutter.json derives the slug as this marker when the project name has no letters or
# digits (an empty folder name would make cookiecutter fail before this hook could explain).
EMPTY = "-empty-"


def problems(field: str, value: str) -> list[str]:
    """Return the reasons ``value`` is not usable as ``field`` (empty when it is fine)."""
    if not value or value == EMPTY:
        return [f"{field} is empty: project_name={PROJECT_NAME!r} has no ASCII letters or digits to derive it from"]
    if not value.isidentifier() or not value.isascii():
        return [f"{field}={value!r} is not a valid Python identifier: use ASCII letters, digits and underscores, not starting with a digit"]
    if keyword.iskeyword(value):
        return [f"{field}={value!r} is a Python keyword"]
    return []


def main() -> int:
    slug, package = NAMES["project_slug"], NAMES["package_name"]
    # The package defaults to the slug: report a shared bad value once.
    found = problems("project_slug", slug) + (problems("package_name", package) if package != slug else [])
    if not found:
        return 0
    print("ERROR: cannot generate the project:", file=sys.stderr)
    for problem in found:
        print(f"  - {problem}", file=sys.stderr)
    print(
        "Fix: choose a name such as project_slug=bert_4090 package_name=bert_4090, e.g.\n"
        "  cookiecutter --no-input . project_slug=bert_4090 package_name=bert_4090",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
