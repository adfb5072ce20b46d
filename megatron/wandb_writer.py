"""Weights & Biases, optional (`pip install -e .[wandb]`): with --wandb-project the rank that prints logs the
scalars TensorBoard gets (megatron/training_log.py's *_scalars, through the Reporter), the run's config and the
DeepSpeed JSON actually used. wandb missing or not starting (no network, no login) costs one line, never the run.
"""
import dataclasses
import json
import os


class WandbWriter:
    """One of the Reporter's writers, as training_log.TensorBoardWriter: each interval's scalars at its iteration."""

    def __init__(self, run):
        self.run = run

    def scalars(self, values: dict[str, float], iteration: int):
        self.run.log(values, step=iteration)

    def close(self):
        self.run.finish()


def run_config(args, schedule, ds_config: dict) -> dict:
    """The parsed flags by section (megatron/arguments.py's Args), the schedule they come to and the DeepSpeed JSON,
    as JSON values (a dtype becomes its name)."""
    config = dataclasses.asdict(args) | {"schedule": dataclasses.asdict(schedule), "deepspeed_config": ds_config}
    return json.loads(json.dumps(config, default=str))


def open_wandb(project: str, exp_name: str | None, save_dir: str | None, run_dir: str | None,
               config: dict) -> tuple[WandbWriter | None, str | None]:
    """(a writer to a new wandb run, None), or (None, the one line saying why there is none). The run is named
    exp_name, else after the run folder, and keeps its files under save_dir, else the run folder, else where wandb
    keeps them by default (./wandb). WANDB_MODE=offline (wandb's own variable) keeps everything local."""
    name = exp_name or (os.path.basename(os.path.normpath(run_dir)) if run_dir else None)
    folder = save_dir or run_dir
    try:
        import wandb
    except Exception as err:  # ImportError, or an install too broken to import
        return None, (f"warning: --wandb-project {project}: wandb cannot be imported ({_first_line(err)}); training "
                      "goes on without it (pip install -e .[wandb])")
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
        # console off: the run's output stays in its log, untouched (wandb would wrap the printing rank's stdout)
        run = wandb.init(project=project, name=name, dir=folder, config=config,
                         settings=wandb.Settings(console="off"))
    except Exception as err:  # no network or login (wandb's CommError, UsageError after its init_timeout), a bad folder
        return None, (f"warning: --wandb-project {project}: wandb did not start ({type(err).__name__}: "
                      f"{_first_line(err)}); training goes on without it (WANDB_MODE=offline logs without network)")
    return WandbWriter(run), None


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0]
