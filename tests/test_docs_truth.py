"""What the docs say about the flags, checked against the code that says it."""
from pathlib import Path

from megatron.arguments import build_parser

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
