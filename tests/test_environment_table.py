"""docs/environment.md lists every environment variable the launch scripts read, and nothing else: the table
cannot drift from the scripts. A variable a script reads from its caller appears with a default or a test
(`${NAME:-...}`, `${NAME:+...}`, `${NAME-...}`, `${NAME+...}`); the scripts' own variables are lower-case or
set before they are read."""
import re

from conftest import REPO_ROOT

SCRIPTS = [*sorted((REPO_ROOT / "examples_zero").glob("*.sh")), REPO_ROOT / "examples_zero" / "slurm" / "train.sbatch",
           *sorted((REPO_ROOT / "ALCF").glob("*.sh")), REPO_ROOT / "scripts" / "defaults.sh",
           REPO_ROOT / "scripts" / "launch_common.sh"]
READ_FROM_CALLER = re.compile(r"\$\{!?([A-Z][A-Z0-9_]*):?[-+]")
ANY_REFERENCE = re.compile(r"\$\{?!?([A-Z][A-Z0-9_]*)")


def table_variables() -> set[str]:
    """Every `NAME` in the first cell of a table row of docs/environment.md."""
    names = set()
    for line in (REPO_ROOT / "docs" / "environment.md").read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]*)`", line.split("|")[1]))
    return names


def test_every_variable_the_scripts_read_is_in_the_table():
    text = "\n".join(path.read_text() for path in SCRIPTS)
    read = set(READ_FROM_CALLER.findall(text))
    documented = table_variables()
    assert sorted(read - documented) == [], "read by the scripts, missing from docs/environment.md"
    referenced = set(ANY_REFERENCE.findall(text))
    assert sorted(documented - referenced) == [], "in docs/environment.md, read by no script"
