"""The launch scripts' entry into the launch planner (megatron/launch/plan.py), one path each:

    python -m megatron.launch.cli driver Z1 [-- pretrain_gpt.py flags]   # examples_zero/gpt_deepspeed_Z1.sh
    python -m megatron.launch.cli alcf [--show STEP] [-- flags]         # ALCF/train-gpt3.sh, ALCF/<step>.sh
    python -m megatron.launch.cli slurm [-- flags]                      # examples_zero/slurm/train.sbatch

scripts/plan.sh finds the Python and runs this. A refused setting is one `error:` line, exit 1.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Mapping

from megatron.launch import alcf, drivers, slurm
from megatron.launch.plan import launch
from megatron.launch.settings import LaunchError


def main(argv: list[str], environ: Mapping[str, str] | None = None) -> int:
    """The launch scripts' entry: `env` is the script's environment (default: this process's)."""
    parser = argparse.ArgumentParser(prog="python -m megatron.launch.cli", description=__doc__.splitlines()[0])
    paths = parser.add_subparsers(dest="path", required=True)
    driver = paths.add_parser("driver", help="an examples_zero/gpt_deepspeed_*.sh experiment")
    driver.add_argument("experiment", choices=drivers.EXPERIMENTS, help="its ZeRO stage and offload")
    alcf_path = paths.add_parser("alcf", help="ALCF/train-gpt3.sh: mpiexec over the job's hosts")
    alcf_path.add_argument("--show", choices=alcf.STEPS,
                           help="print only what this step decides (ALCF/setup.sh, models.sh, args.sh, launch.sh)")
    paths.add_parser("slurm", help="examples_zero/slurm/train.sbatch: one experiment as a Slurm job")
    if "--" in argv:
        split = argv.index("--")
        argv, args = argv[:split], argv[split + 1:]
    else:
        args = []
    opts = parser.parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    try:
        if opts.path == "driver":
            return launch(drivers.DriverPlanner(opts.experiment), env, args)
        if opts.path == "alcf" and opts.show:
            return alcf.show(opts.show, env, args)
        if opts.path == "alcf":
            return launch(alcf.AlcfPlanner(), env, args)
        return slurm.run(env, args)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends the planner quietly
    sys.exit(main(sys.argv[1:]))
