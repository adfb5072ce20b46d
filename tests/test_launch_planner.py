"""The launch planner in-process (megatron/launch/plan.py): what each path hands its launcher besides the command
line (the golden files hold the command lines: tests/test_launch_golden.py), the run lock, and one process
supervising every attempt of a run."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT
from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron.launch.alcf import AlcfPlanner
from megatron.launch.drivers import DriverPlanner
from megatron.launch.plan import RunLock
from megatron.launch.settings import LaunchError


def driver_launch(tmp_path, experiment="Z1", **env):
    environment = subprocess_env(RUNS_DIR=tmp_path, CUDA_VISIBLE_DEVICES="", DRY_RUN=1, **env)
    return DriverPlanner(experiment).plan(environment, [], dry_run=True)


def test_srun_ranks_take_their_port_from_the_job_unless_master_port_is_set(tmp_path):
    """Two jobs sharing a node must not meet at one port: srun's ranks derive theirs from the job id
    (megatron/runtime/dist_env.py), so the launch does not export a MASTER_PORT of its own default."""
    environment = subprocess_env(RUNS_DIR=tmp_path, CUDA_VISIBLE_DEVICES="", LAUNCHER="srun", SLURM_JOB_ID="7",
                                 SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="3")
    environment.pop("MASTER_PORT", None)
    launch = DriverPlanner("Z1").plan(environment, [], dry_run=True)
    assert "MASTER_PORT" not in launch.env
    assert launch.env["OMP_NUM_THREADS"] == "3" and launch.command[:6] == ["srun", "--ntasks", "2", "--cpus-per-task",
                                                                         "3", "--kill-on-bad-exit=1"]
    given = DriverPlanner("Z1").plan(dict(environment, MASTER_PORT="29999"), [], dry_run=True)
    assert given.env["MASTER_PORT"] == "29999"


def test_mpiexec_ranks_find_the_port_in_their_environment(tmp_path):
    launch = driver_launch(tmp_path, LAUNCHER="mpiexec", NGPUS=4)
    assert int(launch.env["MASTER_PORT"]) > 0 and launch.env["OMP_NUM_THREADS"] == "1"
    assert launch.command[:3] == ["mpiexec", "-n", "4"]
    assert driver_launch(tmp_path, LAUNCHER="mpiexec", MASTER_PORT="29611").env["MASTER_PORT"] == "29611"


def listening_socket() -> socket.socket:
    """A socket listening on a free port of this host, as another run's rendezvous store would."""
    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    return held


def test_a_single_host_run_without_master_port_takes_a_free_port(tmp_path):
    """Two single-host runs on one machine do not meet at 29500: torchrun's --standalone, a free port for the
    deepspeed launcher and mpiexec (drivers and ALCF); the hosts of a multi-host run agree on MASTER_PORT or 29500."""
    with listening_socket() as held:
        busy = str(held.getsockname()[1])
        torchrun = driver_launch(tmp_path).command
        assert "--standalone" in torchrun and "--master_port" not in torchrun
        for launch in (driver_launch(tmp_path, LAUNCHER="deepspeed"), driver_launch(tmp_path, LAUNCHER="mpiexec"),
                       AlcfPlanner().plan(subprocess_env(OUTPUT_ROOT=tmp_path, CUDA_VISIBLE_DEVICES=""), [],
                                          dry_run=True)):
            port = launch.env.get("MASTER_PORT") or launch.command[launch.command.index("--master_port") + 1]
            assert port != busy
            with socket.socket() as probe:  # free: a store can listen there
                probe.bind(("", int(port)))
    assert driver_launch(tmp_path, MASTER_PORT="29611").command[5:7] == ["--master_port", "29611"]
    two_hosts = driver_launch(tmp_path, NNODES=2, NODE_RANK=0, MASTER_ADDR="10.0.0.1").command
    assert "10.0.0.1:29500" in two_hosts


@pytest.mark.parametrize("script", ["examples_zero/gpt_deepspeed_Z1.sh", "ALCF/train-gpt3.sh"])
def test_a_master_port_in_use_is_refused_before_anything_starts(tmp_path, script):
    with listening_socket() as held:
        port = held.getsockname()[1]
        result = subprocess.run(["bash", str(REPO_ROOT / script)], cwd=REPO_ROOT, capture_output=True, text=True,
                                env=subprocess_env(RUNS_DIR=tmp_path / "runs", OUTPUT_ROOT=tmp_path / "outputs",
                                                   CUDA_VISIBLE_DEVICES="", MASTER_PORT=port), timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"error: MASTER_PORT={port}: the port is in use on this host (Address already in use; another run's?): set "
        "another MASTER_PORT, or leave it unset on a single host for a free one")
    assert not any(path.is_file() for path in tmp_path.rglob("*"))  # no run folder, log or lock written


def test_a_drivers_launcher_gets_this_pythons_tools_first_and_the_flag_sources(tmp_path):
    launch = driver_launch(tmp_path, GLOBAL_BATCH=16)
    assert launch.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert launch.env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    assert launch.env["DS_ACCELERATOR"] == "cpu"
    assert "--global-batch-size=GLOBAL_BATCH" in launch.env["ZERO_LAB_FLAG_SOURCES"].split()
    assert launch.launcher == "torchrun" and launch.log == f"{launch.run_dir}/train.log" and launch.node is None


def test_host_k_of_a_torchrun_run_writes_its_own_files_and_cannot_go_on_alone(tmp_path):
    host1 = driver_launch(tmp_path, NNODES=2, NODE_RANK=1, MASTER_ADDR="10.0.0.1")
    assert (host1.node, host1.log, host1.note) == ("node1", f"{host1.run_dir}/train.node1.log", "host 1 of 2")
    assert host1.alone is None
    host0 = driver_launch(tmp_path, NNODES=2, NODE_RANK=0, MASTER_ADDR="10.0.0.1", GAS=2)
    # the global batch host 0 keeps when it goes on alone: 4 x 2 ranks x 2 hosts x GAS 2
    assert host0.alone == dict(NNODES="1", GAS="", GLOBAL_BATCH="32", NGPUS="2")


def test_alcf_ranks_share_the_hosts_cores_and_keep_kernels_in_order(tmp_path):
    environment = subprocess_env(OUTPUT_ROOT=tmp_path, CUDA_VISIBLE_DEVICES="", NGPU_PER_HOST=2, DRY_RUN=1)
    environment.pop("OMP_NUM_THREADS", None)
    launch = AlcfPlanner().plan(environment, [], dry_run=True)
    assert launch.env["OMP_NUM_THREADS"] == str(max(len(os.sched_getaffinity(0)) // 2, 1))
    assert launch.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and launch.env["IBV_FORK_SAFE"] == "1"
    assert launch.env["DS_ACCELERATOR"] == "cpu" and launch.launcher == "mpiexec"
    assert launch.log.startswith(f"{launch.run_dir}/logs/") and launch.log.endswith(".log")


def test_the_run_lock_is_held_by_one_process_and_names_it(tmp_path):
    """A second lock on the run folder, from another process, is refused naming the first; the first's line stays;
    the lock goes with the process that held it."""
    held = RunLock(str(tmp_path), ".zero-lab.lock")
    holder = (tmp_path / ".zero-lab.lock").read_text()
    assert holder.startswith(f"pid {os.getpid()} on ")
    code = textwrap.dedent(f"""
        from megatron.launch.plan import RunLock
        from megatron.launch.settings import LaunchError
        try:
            RunLock({str(tmp_path)!r}, ".zero-lab.lock")
        except LaunchError as error:
            print(error)
    """)
    second = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                            timeout=60)
    assert second.stdout.strip() == (f"run folder {tmp_path} is in use by another launch ({holder.strip()}): wait for "
                                     "it to end or stop it; a second launch would mix its checkpoints and logs with "
                                     "the first's")
    assert (tmp_path / ".zero-lab.lock").read_text() == holder
    os.close(held.fd)
    again = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and again.stdout == ""


def test_a_driver_refuses_a_stage_not_its_own_before_anything_else(tmp_path):
    with pytest.raises(LaunchError, match=r"^ZERO_STAGE=2: gpt_deepspeed_Z3_OL.sh runs ZeRO stage 3 "):
        driver_launch(tmp_path, "Z3_OL", ZERO_STAGE=2)
    # a stage that does not exist is named as such, not answered with the driver's own stage
    with pytest.raises(LaunchError, match=r"^ZERO_STAGE=4: ZeRO has stages 0 to 3 only; leave ZERO_STAGE unset "
                                          r"\(gpt_deepspeed_Z1.sh runs stage 1\)"):
        driver_launch(tmp_path, "Z1", ZERO_STAGE=4)
    assert not any(tmp_path.iterdir())


def test_restarts_run_in_one_supervising_process(tmp_path):
    """MAX_RESTARTS: the planner process that started the run supervises every attempt (no script started again):
    a launcher that dies without an error line (a fault) is restarted, each attempt planned afresh by the resume
    rule, and every attempt's header names the same supervisor."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a stand-in torch.distributed.run: prints its parent (the supervisor) and dies of a signal, like a killed rank
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, sys
        if "torch.distributed.run" in sys.orig_argv:
            print(f"supervisor {os.getppid()}", flush=True)
            os.kill(os.getpid(), 9)
    """))
    env = subprocess_env(RUNS_DIR=tmp_path / "runs", CUDA_VISIBLE_DEVICES="", MAX_RESTARTS=2, DATA_PATH=tmp_path / "d",
                         PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO_ROOT}")
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    supervisors = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("supervisor ")]
    assert len(supervisors) == 3 and len(set(supervisors)) == 1, result.stdout + result.stderr
    assert result.stdout.count("[run] restarting the run from its newest intact checkpoint") == 2, result.stdout
    # no checkpoint was saved: each restart starts afresh by the resume rule; the failed attempts trained nothing, so
    # their files stay (no <run>.old-<time> folder) and the log holds the three attempts in order
    assert result.stderr.count("[run] starting afresh (no checkpoint to resume there)") == 2, result.stderr
    log = (tmp_path / "runs" / "gpt_tiny_Z1" / "train.log").read_text()
    headers = [line for line in log.splitlines() if line.startswith("[zero-lab] attempt ")]
    assert [header.split(": ", 1)[1] for header in headers] == [
        "fresh start", "restart 1 of 2, fresh start", "restart 2 of 2, fresh start"], log
    assert not list((tmp_path / "runs").glob("gpt_tiny_Z1.old-*"))


def test_a_users_json_asking_for_another_stage_is_refused_before_anything_is_written(tmp_path):
    """The Z1 driver with a JSON of stage 3: one line naming the driver whose stage that is, exit 1, no run folder
    (a real launch, not a dry run); ALCF with ZERO_STAGE and a JSON that disagree, likewise."""
    user = tmp_path / "ds.json"
    user.write_text('{"zero_optimization": {"stage": 3}}')
    runs = tmp_path / "runs"
    env = subprocess_env(RUNS_DIR=runs, CUDA_VISIBLE_DEVICES="", DS_CONFIG=user, DATA_PATH=tmp_path / "d")
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "gpt_deepspeed_Z1.sh")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"error: DS_CONFIG={user} asks for ZeRO stage 3 (zero_optimization.stage) but gpt_deepspeed_Z1.sh runs "
        "stage 1: run gpt_deepspeed_Z3.sh, whose stage it is, or leave the stage out of the JSON")
    assert not runs.exists()
    alcf = subprocess.run(["bash", str(REPO_ROOT / "ALCF" / "train-gpt3.sh")], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(OUTPUT_ROOT=runs, CUDA_VISIBLE_DEVICES="", DS_CONFIG=user,
                                                          ZERO_STAGE=2))
    assert alcf.returncode == 1 and not runs.exists()
    assert alcf.stderr.splitlines()[-1] == (
        f"error: ZERO_STAGE=2 and zero_optimization.stage 3 in DS_CONFIG={user} disagree: set one of them (without "
        "ZERO_STAGE the JSON's stage is the run's)")


def test_a_broken_json_is_named_with_its_line_and_column(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text('{"zero_optimization": {"stage": 1},\n  "bf16": }')
    with pytest.raises(LaunchError) as refused:
        driver_launch(tmp_path, DS_CONFIG=user)
    assert str(refused.value) == (f"DS_CONFIG={user}: not a readable JSON object (line 2, column 11: Expecting "
                                  "value)")


def test_run_all_analyses_in_the_projects_python(tmp_path):
    """examples_zero/run_all.sh with no PYTHON set and another python3 first on PATH (one without the project's
    packages): the six drivers and the analysis run in the repository's .venv, as each driver does."""
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip("no .venv in the repository (scripts/setup.sh makes it)")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "python3").symlink_to(os.path.join(sys.base_prefix, "bin", "python3"))  # the venv's base: no matplotlib
    (tmp_path / "runs").mkdir()
    env = subprocess_env(RUNS_DIR=tmp_path / "runs", DRY_RUN=1, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHON")
    env["PATH"] = f"{bare}{os.pathsep}{env['PATH']}"
    result = subprocess.run(["bash", str(REPO_ROOT / "examples_zero" / "run_all.sh")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.count(f"DRY_RUN=1, not starting: {venv_python} -m torch.distributed.run ") == 6
    assert "Traceback" not in result.stderr and "No module named" not in result.stderr
    assert result.stderr.splitlines()[-1] == (f"error: {tmp_path / 'runs'}: no training runs found (no log with "
                                              "iteration lines)")


def test_a_port_taken_after_the_check_is_named_with_its_variable(tmp_path, capsys):
    """The planner's check and the store's start are apart in time: a port taken in between ends the attempt with
    the port and the variable, not 'torchrun exited with status 1' (a real torchrun against a held port)."""
    from megatron.launch.attempt import Attempt

    with listening_socket() as held:
        port = held.getsockname()[1]
        attempt = Attempt(str(tmp_path), str(tmp_path / "train.log"), "torchrun", None)
        status = attempt.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                              "--master_port", str(port), "-m", "json.tool", os.devnull],
                             env=subprocess_env())
        attempt.close()
    assert status == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: port {port} (MASTER_PORT) is in use on this host (EADDRINUSE; another run's?): set another "
        f"MASTER_PORT, or leave it unset on a single host for a free one (launcher's report: {tmp_path}/launcher.log)")


@pytest.mark.parametrize("env, error", [
    (dict(EP_SIZE="2"), "EP_SIZE=2: the model has no experts to spread (NUM_EXPERTS unset), so the run would train "
                        "dense; set NUM_EXPERTS too (e.g. NUM_EXPERTS=4 EP_SIZE=2, docs/moe.md), or leave EP_SIZE unset"),
    (dict(NUM_EXPERTS="1", EP_SIZE="2"), "EP_SIZE=2: the model has no experts to spread (NUM_EXPERTS=1), so"),
    # the trainer's words (megatron/layout_check.py's expert_parallel_problems), the variables named
    (dict(NUM_EXPERTS="3", EP_SIZE="2"), "--moe-expert-parallel-size 2 (from EP_SIZE) must divide 3, an MoE layer's "
                                         "experts by --num-experts (from NUM_EXPERTS): each layer's experts are split "
                                         "evenly over the expert-parallel ranks; use a multiple of 2 experts, or a "
                                         "--moe-expert-parallel-size that divides 3"),
    (dict(NUM_EXPERTS="4 6", EP_SIZE="4", NGPUS="4"), "--moe-expert-parallel-size 4 (from EP_SIZE) must divide 6, an "
                                                      "MoE layer's experts by --num-experts (from NUM_EXPERTS): "),
    (dict(MODEL_SIZE="tiny-moe4", EP_SIZE="3", NGPUS="3"), "--moe-expert-parallel-size 3 (from EP_SIZE) must divide "
                                                           "4, an MoE layer's experts by --num-experts: "),
    (dict(NUM_EXPERTS="4", EP_SIZE="4"), "--moe-expert-parallel-size 4 (from EP_SIZE) must divide the data-parallel "
                                         "size 2: the experts are spread over groups of data-parallel ranks"),
])
def test_an_expert_parallel_size_the_run_would_ignore_or_refuse_is_refused_before_the_run_folder(tmp_path, env,
                                                                                                 error):
    """Issue 56, item 4: EP_SIZE without experts trained dense with --moe-expert-parallel-size in its command, and
    experts EP_SIZE does not divide were refused by DeepSpeed's MoE layer once the ranks had started; both are one
    line now, before the run folder exists, as SP_SIZE=3 is."""
    with pytest.raises(LaunchError) as refused:
        driver_launch(tmp_path, **env)
    assert str(refused.value).startswith(error), refused.value
    assert list(tmp_path.iterdir()) == []
    environment = subprocess_env(CUDA_VISIBLE_DEVICES="", OUTPUT_ROOT=tmp_path, DRY_RUN=1, **env)
    with pytest.raises(LaunchError, match="EP_SIZE"):  # ALCF's path reads the same settings
        AlcfPlanner().plan(environment, [], dry_run=True)


def test_an_expert_parallel_size_that_fits_plans_its_flags(tmp_path):
    for env in (dict(NUM_EXPERTS="4", EP_SIZE="2"), dict(MODEL_SIZE="tiny-moe4", EP_SIZE="2"),
                dict(NUM_EXPERTS="4 8", EP_SIZE="4", NGPUS="4")):
        command = driver_launch(tmp_path, **env).command
        assert command[command.index("--moe-expert-parallel-size") + 1] == env["EP_SIZE"]


def test_layout_flags_after_the_driver_count_as_their_variables(tmp_path):
    """Issue 56, item 4: `bash gpt_deepspeed_Z1.sh --ds-sequence-parallel-size 2`, as Megatron-DeepSpeed's users
    pass it, was planned as a data-parallel size of 2 the run would not have; the planner reads the flag as SP_SIZE
    (and TP, PP, NUM_EXPERTS, EP_SIZE, SP by theirs), or refuses a variable that says otherwise."""
    plan = DriverPlanner("Z1").plan
    environment = subprocess_env(RUNS_DIR=tmp_path, CUDA_VISIBLE_DEVICES="", DRY_RUN=1, NGPUS="2", MICRO_BATCH="4",
                                 GLOBAL_BATCH="4")
    command = plan(environment, ["--ds-sequence-parallel-size", "2"], dry_run=True).command
    assert command[command.index("--global-batch-size") + 1] == "4"
    assert command[-2:] == ["--ds-sequence-parallel-size", "2"]  # as the user typed it
    unset = dict(environment, MICRO_BATCH="", GLOBAL_BATCH="")
    command = plan(unset, ["--tensor-model-parallel-size=2"], dry_run=True).command
    assert command[command.index("--global-batch-size") + 1] == "4"  # 4 a rank x data-parallel size 1
    with pytest.raises(LaunchError) as refused:
        plan(dict(environment, SP_SIZE="1"), ["--ds-sequence-parallel-size", "2"], dry_run=True)
    assert str(refused.value) == ("--ds-sequence-parallel-size 2 after the launch script and SP_SIZE=1 set the same "
                                  "thing to different values: set one of them (SP_SIZE is the launch's own way)")
    with pytest.raises(LaunchError, match=r"^EP_SIZE=2: the model has no experts to spread"):
        plan(unset, ["--moe-expert-parallel-size", "2"], dry_run=True)
    command = plan(unset, ["--num-experts", "4", "4", "--moe-expert-parallel-size", "2"], dry_run=True).command
    assert command[command.index("--num-experts"):][:3] == ["--num-experts", "4", "4"]
    with pytest.raises(LaunchError, match=r"^--tensor-model-parallel-size two after the launch script: expected a "):
        plan(unset, ["--tensor-model-parallel-size", "two"], dry_run=True)


@pytest.mark.parametrize("env, args, name", [
    (dict(NUM_EXPERTS="4", EP_SIZE="2"), [], "gpt_tiny_Z1_moe4_ep2"),  # docs/moe.md's first command
    (dict(SP_SIZE="2"), [], "gpt_tiny_Z1_ulysses2"),  # docs/long-sequences.md's
    (dict(), ["--ds-sequence-parallel-size", "2"], "gpt_tiny_Z1_ulysses2"),
    (dict(NUM_EXPERTS="4 8", EP_SIZE="4", NGPUS="4"), [], "gpt_tiny_Z1_moe4-8_ep4"),
    (dict(NUM_EXPERTS="1"), [], "gpt_tiny_Z1"),  # dense, as the main run
    (dict(MODEL_SIZE="tiny-moe4", EP_SIZE="2"), [], "gpt_tiny-moe4_Z1_ep2"),
    (dict(POSITION_EMBEDDING_TYPE="rotary"), [], "gpt_tiny_Z1_rotary"),
    (dict(MODEL_SIZE="llama-tiny", POSITION_EMBEDDING_TYPE="rotary"), [], "gpt_llama-tiny_Z1"),  # its own positions
    (dict(MODEL_SIZE="llama-tiny", POSITION_EMBEDDING_TYPE="learned"), [], "gpt_llama-tiny_Z1_learned"),
])
def test_a_run_of_another_model_or_layout_gets_its_own_default_folder(tmp_path, env, args, name):
    """Issue 56, item 1: after the dense main run, docs/moe.md's NUM_EXPERTS=4 EP_SIZE=2 resumed the main run's
    folder (gpt_tiny_Z1) and docs/long-sequences.md's SP_SIZE=2 found it finished: the default name names the
    experts, their spread, the Ulysses size and positions other than the preset's."""
    environment = subprocess_env(RUNS_DIR=tmp_path, CUDA_VISIBLE_DEVICES="", DRY_RUN=1, **env)
    launch = DriverPlanner("Z1").plan(environment, args, dry_run=True)
    assert launch.run_dir == os.path.realpath(tmp_path / name)


def test_alcfs_run_name_names_the_ulysses_size_and_the_experts(tmp_path):
    environment = subprocess_env(CUDA_VISIBLE_DEVICES="", OUTPUT_ROOT=tmp_path, DRY_RUN=1, SP_SIZE="2")
    assert AlcfPlanner().plan(environment, [], dry_run=True).run_dir.endswith("_seqlen128_mp1_pp1_sp2_nl2_hs128_gb4_mb4")
    environment = subprocess_env(CUDA_VISIBLE_DEVICES="", OUTPUT_ROOT=tmp_path, DRY_RUN=1, NUM_EXPERTS="4", EP_SIZE="2")
    assert "_sp1_moe4_ep2_nl2_" in AlcfPlanner().plan(environment, [], dry_run=True).run_dir
