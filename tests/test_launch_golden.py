"""The golden dry-run command lines (tests/golden/launch/): every case of tests/golden/launch_cases.py has its file,
recorded from the case as it now reads, and each case's dry run, through its launch script as a user starts it,
gives that file today (what `python tests/golden/record_launch.py --check` checks; about 0.1 s per case, 4 s for
INIT_HF's, in the slow tier).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
from launch_cases import CASES  # noqa: E402
from record_launch import FIXTURES, LAUNCH_DIR, REPO_ROOT, case_description, parse, render, run_case  # noqa: E402


def test_every_case_has_one_golden_file_and_no_file_is_stray():
    names = [case.name for case in CASES]
    assert len(names) == len(set(names)), "two cases share a name"
    files = {path.stem for path in LAUNCH_DIR.glob("*")}
    assert {path.suffix for path in LAUNCH_DIR.glob("*")} == {".txt"}
    assert sorted(set(names) - files) == [], "cases without a golden file: run tests/golden/record_launch.py NAME"
    assert sorted(files - set(names)) == [], "golden files of no case: remove them"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_each_golden_file_parses_and_was_recorded_from_its_case(case):
    header, golden = parse((LAUNCH_DIR / f"{case.name}.txt").read_text())
    # the header is the case as recorded: a case changed since is re-recorded
    assert header == f"# {case.name}: {case_description(case)}"
    assert (REPO_ROOT / case.script).is_file()
    for value in case.env.values():
        if value and value.startswith("{fixtures}/"):
            assert (FIXTURES / value.removeprefix("{fixtures}/")).exists(), value
    if case.error:
        assert golden.status != 0 and not golden.command and golden.error.startswith("error: ")
    else:
        assert golden.status == 0 and not golden.error
        assert "<repo>/pretrain_gpt.py" in golden.command
        assert golden.command[0] in ("<python>", "mpiexec", "srun")
        assert len(golden.notes) == 1 and golden.notes[0].startswith("[run] ")  # the resume rule's decision


# INIT_HF's dry runs read config.json in a Python that imports transformers (about 4 s each): slow tier
TIMED = [pytest.param(case, marks=pytest.mark.slow) if "INIT_HF" in case.env and not case.error else case
         for case in CASES]


@pytest.mark.parametrize("case", TIMED, ids=lambda case: case.name)
def test_each_cases_dry_run_gives_its_golden_file(case):
    golden, _ = run_case(case)
    assert render(case, golden) == (LAUNCH_DIR / f"{case.name}.txt").read_text()
