"""Record, or check, the golden dry-run command lines of the launch cases (tests/golden/launch_cases.py).

    python tests/golden/record_launch.py [--check] [--repo CHECKOUT] [NAME ...]

runs each case's script with DRY_RUN=1 in a clean environment and a temporary folder of its own, and writes
tests/golden/launch/<name>.txt: the exit status, then the command line the script would start (one argument
per line) and what the resume rule decided, or for a refused setting its error line. --check compares
instead of writing: a unified diff per case that differs, exit status 1 if any does. It prints how long each
dry run took, and the total. --repo runs the scripts of another checkout of zero-lab instead (its paths read
<repo> all the same): bench/bench_dry_run.sh times an older one beside this one.
"""
from __future__ import annotations

import argparse
import difflib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_cases import CASES, Case  # noqa: E402  (the case list lives beside this script)

GOLDEN_DIR = Path(__file__).resolve().parent
REPO_ROOT = GOLDEN_DIR.parent.parent
SCRIPTS_ROOT = REPO_ROOT  # the checkout whose scripts run (--repo)
LAUNCH_DIR = GOLDEN_DIR / "launch"
FIXTURES = GOLDEN_DIR / "fixtures"
# the line each path prints its command in: the drivers (and train.sbatch through them) with printf %q, ALCF's
# launch.sh quoted only where needed; both read back with shlex
COMMAND_MARKERS = ("[examples_zero] DRY_RUN=1, not starting: ", "[launch] ")
# what `mpiexec --version` answers, per flavour: ALCF/launch.sh picks its flags from it
MPI_BANNERS = {"pals": "mpiexec version 1.2.12 (HPE PALS stand-in)",
               "hydra": "HYDRA build details:\n    Version:                                 4.0.2",
               "openmpi": "mpiexec (OpenRTE) 4.1.2"}
# torch.cuda.device_count() as the drivers asked it before the launch planner (which asks nvidia-smi, a stand-in
# too), answered by a stand-in: this machine has no GPU. Only that probe is answered, so no other Python of the dry
# run imports torch on its account (--repo with a checkout from before the planner).
GPU_SITECUSTOMIZE = """import os, sys
if any("torch.cuda.device_count()" in arg for arg in sys.orig_argv):
    import torch
    torch.cuda.device_count = lambda: int(os.environ["ZL_GOLDEN_GPUS"])
"""


@dataclass
class Golden:
    status: int
    command: list[str]  # empty for a refused setting
    notes: list[str]  # the resume rule's decision ([run] lines on stderr)
    error: str  # stderr's last line, for a refused setting


def case_description(case: Case) -> str:
    """The case as one shell line (placeholders kept), the first line of its golden file."""
    env = " ".join(f"{name}={shlex.quote(value)}" if value is not None else f"-u {name}"
                   for name, value in case.env.items())
    extras = [f"gpus={case.gpus}"] * bool(case.gpus) + [f"mpi={case.mpi}"] * (case.mpi != "pals")
    extras += [f"checkpoint in {case.checkpoint}"] * bool(case.checkpoint)
    line = " ".join(part for part in (env and f"env {env}", "bash", case.script, shlex.join(case.args)) if part)
    return line + (f"  ({', '.join(extras)})" if extras else "")


def render(case: Case, golden: Golden) -> str:
    lines = [f"# {case.name}: {case_description(case)}", f"status: {golden.status}"]
    if golden.command:
        lines += ["--- command", *(shlex.quote(arg) for arg in golden.command)]
    if golden.notes:
        lines += ["--- notes", *golden.notes]
    if golden.error:
        lines += ["--- error", golden.error]
    return "\n".join(lines) + "\n"


def parse(text: str) -> tuple[str, Golden]:
    """(the header line, the golden) of a golden file; ValueError when it is not one."""
    header, status_line, *rest = text.splitlines()
    if not header.startswith("# ") or not status_line.startswith("status: "):
        raise ValueError(f"expected '# <name>: ...' and 'status: N' first, got {header!r}, {status_line!r}")
    sections: dict[str, list[str]] = {}
    current = None
    for line in rest:
        if line.startswith("--- "):
            current = line[4:]
            if current not in ("command", "notes", "error") or current in sections:
                raise ValueError(f"unexpected section {line!r}")
            sections[current] = []
        elif current is None:
            raise ValueError(f"line outside a section: {line!r}")
        else:
            sections[current].append(line)
    command = []
    for line in sections.get("command", []):
        words = shlex.split(line)
        if len(words) != 1:
            raise ValueError(f"expected one shell-quoted argument per line, got {line!r}")
        command += words
    error = sections.get("error", [])
    if len(error) > 1:
        raise ValueError(f"expected one error line, got {len(error)}")
    return header, Golden(int(status_line[8:]), command, sections.get("notes", []), "".join(error))


def prepare(case: Case, tmp: Path) -> dict[str, str]:
    """The case's folder (stand-in tools, a checkpoint to resume) and its clean environment."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    tools = {"mpiexec": f"#!/bin/sh\necho '{MPI_BANNERS[case.mpi]}'\n"}
    if case.gpus:
        gpu_lines = "".join(f"GPU {i}: NVIDIA A100-SXM4-40GB (UUID: GPU-{i})\n" for i in range(case.gpus))
        tools["nvidia-smi"] = f"#!/bin/sh\nprintf '{gpu_lines}'\n"
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(GPU_SITECUSTOMIZE)
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if case.checkpoint:
        committed_checkpoint(tmp / case.checkpoint / "checkpoints", "global_step3")
    python = sys.executable
    env = {
        # nothing of the caller's environment: only this, then the case's settings
        "PATH": os.pathsep.join([str(bin_dir), str(Path(python).parent), "/usr/local/sbin", "/usr/local/bin",
                                 "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
        "HOME": os.environ.get("HOME", str(tmp)), "USER": "tester", "LC_ALL": "C",
        # tests/conftest.py's test_env
        "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHON": python,
        "PYTHONPATH": os.pathsep.join([str(SCRIPTS_ROOT), *([str(tmp / "site")] if case.gpus else [])]),
        "DRY_RUN": "1", "RUNS_DIR": str(tmp / "runs"), "OUTPUT_ROOT": str(tmp / "outputs"),
        "LOGFILES": str(tmp / "logfiles"),
    }
    if case.gpus:
        env["ZL_GOLDEN_GPUS"] = str(case.gpus)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # hides a real GPU from torch and ALCF's count alike
    for name, value in case.env.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value.replace("{tmp}", str(tmp)).replace("{repo}", str(SCRIPTS_ROOT)).replace(
                "{fixtures}", str(FIXTURES))
    return env


def committed_checkpoint(checkpoints: Path, tag: str) -> None:
    """A checkpoint the resume rule takes as intact, as a save commits it (tests/test_launch_settings.py)."""
    from megatron.checkpointing import protocol

    protocol.prepare_save(str(checkpoints), tag)
    (checkpoints / protocol.staging_tag(tag)).mkdir()
    protocol.commit(str(checkpoints), tag, {"iteration": int(tag.removeprefix("global_step"))})


def normalise(text: str, tmp: Path) -> str:
    """What differs between machines and runs: the interpreter, the case's folder, the repository."""
    python = sys.executable
    for real, token in ((python, "<python>"), (os.path.realpath(python), "<python>"), (str(tmp), "<tmp>"),
                        (str(SCRIPTS_ROOT), "<repo>")):
        text = text.replace(real, token)
    return text


def run_case(case: Case) -> tuple[Golden, float]:
    """The case's dry run: its golden and how long the script took (seconds)."""
    with tempfile.TemporaryDirectory(prefix="zl-golden-") as folder:
        tmp = Path(os.path.realpath(folder))  # the scripts resolve their run folders (realpath)
        env = prepare(case, tmp)
        start = time.perf_counter()
        result = subprocess.run(["bash", str(SCRIPTS_ROOT / case.script), *case.args], cwd=SCRIPTS_ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - start
        stdout, stderr = normalise(result.stdout, tmp), normalise(result.stderr, tmp)
    lines = [line.split(marker, 1)[1] for line in stdout.splitlines() for marker in COMMAND_MARKERS
             if marker in line and "pretrain_gpt.py" in line]
    if len(lines) > 1:
        raise RuntimeError(f"{case.name}: {len(lines)} command lines in the dry run's output:\n{stdout}")
    command = shlex.split(lines[0]) if lines else []
    if "MASTER_PORT" not in case.env and "--master_port" in command:  # a single host's free port (drivers.py)
        command[command.index("--master_port") + 1] = "<free port>"
    notes = [line for line in stderr.splitlines() if line.startswith("[run] ")]
    error = stderr.splitlines()[-1] if result.returncode and stderr.strip() else ""
    golden = Golden(result.returncode, command, notes if command else [], error)
    refused = result.returncode != 0 and not command
    if refused != case.error:  # a case must be what the list says it is, else its setup is wrong
        raise RuntimeError(f"{case.name}: expected {'a refusal' if case.error else 'a command line'}, got status "
                           f"{result.returncode}\n--- stdout\n{stdout}--- stderr\n{stderr}")
    return golden, seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the golden files instead of writing")
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="run this checkout's scripts (default: this one)")
    parser.add_argument("names", nargs="*", metavar="NAME", help="only these cases (default: all)")
    ns = parser.parse_args(argv)
    global SCRIPTS_ROOT
    SCRIPTS_ROOT = ns.repo.resolve()
    by_name = {case.name: case for case in CASES}
    unknown = [name for name in ns.names if name not in by_name]
    if unknown:
        print(f"error: no such case: {', '.join(unknown)} (tests/golden/launch_cases.py)", file=sys.stderr)
        return 2
    cases = [by_name[name] for name in ns.names] if ns.names else CASES
    LAUNCH_DIR.mkdir(exist_ok=True)
    differing, total = [], 0.0
    for case in cases:
        golden, seconds = run_case(case)
        total += seconds
        text, path = render(case, golden), LAUNCH_DIR / f"{case.name}.txt"
        old = path.read_text() if path.exists() else ""
        if ns.check and text != old:
            differing.append(case.name)
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       f"golden/{case.name}.txt", f"now/{case.name}.txt"))
        elif not ns.check:
            path.write_text(text)
        print(f"{case.name:45s} {seconds:6.2f} s  status {golden.status}"
              f"{'  DIFFERS' if case.name in differing else ''}", flush=True)
    print(f"{len(cases)} dry runs: {total:.1f} s in all, {total / len(cases):.2f} s each on average")
    if differing:
        print(f"{len(differing)} of {len(cases)} cases differ from their golden files: {' '.join(differing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
