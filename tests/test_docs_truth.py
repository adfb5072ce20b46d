"""What the docs say about the flags, checked against the code that says it."""
import re
import subprocess
from pathlib import Path

import pytest

from conftest import test_env
from megatron.arguments import build_parser
from megatron.model.presets import MODEL_PRESETS

ROOT = Path(__file__).resolve().parent.parent


def test_help_says_deepspeed_flag_is_accepted_and_ignored():
    """--deepspeed comes from deepspeed.add_config_arguments; --help must not claim it enables anything."""
    help_text = " ".join(build_parser().format_help().split())
    assert "--deepspeed accepted and ignored: every run uses DeepSpeed (Megatron-DeepSpeed's scripts pass it)" \
        in help_text
    assert "Enable DeepSpeed (helper flag" not in help_text  # DeepSpeed's own text (--deepscale's says "enable")


def test_parsing_deepspeed_changes_nothing():
    parser = build_parser()
    with_flag = vars(parser.parse_args(["--deepspeed"]))
    without = vars(parser.parse_args([]))
    assert with_flag.pop("deepspeed") is True and without.pop("deepspeed") is False
    assert with_flag == without


def test_readme_says_the_same():
    assert "`--deepspeed`, which every Megatron-DeepSpeed\nscript passes, is accepted and does nothing" \
        in (ROOT / "README.md").read_text()


# A documented Llama command: MODEL_SIZE=<a Llama preset> [VAR=value ...] bash examples_zero/<driver>.sh
LLAMA_COMMAND = re.compile(r"MODEL_SIZE=(llama\S*)((?: [A-Z_]+=\S+)*) bash (examples_zero/\S+\.sh)")


def documented_llama_commands(page: str) -> list[tuple[str, dict[str, str], str]]:
    """(preset, the other variables, driver) of each Llama training command the page shows."""
    return [(preset, dict(pair.split("=", 1) for pair in variables.split()), driver)
            for preset, variables, driver in LLAMA_COMMAND.findall((ROOT / page).read_text())]


@pytest.mark.parametrize("page", ["README.md", "docs/model.md"])
def test_the_llama_commands_the_docs_show_are_ones_the_drivers_accept(page, tmp_path):
    """Each command names a Llama preset and an existing driver, and the driver's launch planner (DRY_RUN=1) takes
    it and passes the preset on to pretrain_gpt.py. tests/test_llama_training.py trains the CPU one for real."""
    commands = documented_llama_commands(page)
    assert ("llama-tiny", {}, "examples_zero/gpt_deepspeed_Z1.sh") in commands  # the one that runs on a laptop
    for preset, variables, driver in commands:
        assert MODEL_PRESETS[preset]["normalization"] == "rmsnorm" and (ROOT / driver).is_file()
        run = subprocess.run(["bash", str(ROOT / driver)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env=test_env(MODEL_SIZE=preset, DRY_RUN=1, RUNS_DIR=tmp_path, **variables))
        assert run.returncode == 0, run.stderr
        assert f"pretrain_gpt.py --model-size {preset} " in run.stdout


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+?\.md)(?:#([^)\s]+))?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=[page.name if page.parent.name == "docs" else "README" for page in PAGES])
def test_every_link_between_the_pages_reaches_a_page_and_its_heading(page):
    broken = []
    for target, anchor in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        linked = (page.parent / target).resolve()
        if not linked.is_file() or (anchor and anchor not in anchors(linked)):
            broken.append(f"{target}#{anchor}" if anchor else target)
    assert broken == []


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    assert [page.name for page in PAGES[1:] if page.name != "README.md" and f"]({page.name})" not in index] == []


# Task pages a user reads in minutes; their derivations live in the *-reference.md pages beside them
@pytest.mark.parametrize("name", ["zero-tradeoff.md", "moe.md", "faults.md", "gpu.md", "checkpoints.md",
                                  "bad-input.md"])
def test_task_pages_stay_short(name):
    assert len((ROOT / "docs" / name).read_text().split()) <= 2500
