#!/usr/bin/env bash
# Set up zero-lab on a fresh machine: a virtual environment in .venv with torch, the package
# (which compiles the pybind11 helper), and an MPI launcher for the ALCF scripts. Safe to run
# again: every step is skipped when already done.
#
# torch: without an NVIDIA GPU, torch==TORCH_VERSION as pip finds it (the CPU build on the project
# machines). With one (nvidia-smi answers), the CUDA build for the newest CUDA the driver runs that
# matches the CUDA toolkit's nvcc, when there is one (DeepSpeed builds its CPU Adam for offload with
# that nvcc and refuses another CUDA; a CUDA 12.0-12.5 driver gets the 12.6 build, which it runs through
# minor-version compatibility), from PyTorch's index (TORCH_INDEX_URL overrides), unless PYTHON
# already imports a CUDA torch: that one is kept, and the new .venv sees PYTHON's packages. Either way
# one warning line says when offload would find no matching nvcc. zero-lab runs on torch 2.11 to 2.13.
# WHEELHOUSE=DIR: install from DIR only (made by scripts/wheelhouse.sh), never from the network;
# the torch found in .venv or PYTHON is kept, whatever its build, since DIR holds none.
# SETUP_EXTRAS=test (default) or empty: setup.py's extras installed with zero-lab (empty: the package alone).
# SETUP_DRY_RUN=1: print every command a real run would run, and change nothing.
# Output: one line per step (what it installs or builds, how long it took, what happens next time); the
# tools' own output (pip, apt, the op builds) is appended to build/setup.log, which a failed step names
# with the end of its output. VERBOSE=1 prints each command and all of its output here instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV_DIR=${VENV_DIR:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_MIN=2.11 TORCH_BELOW=2.14  # the torch releases zero-lab runs on (setup.py and docs/gpu.md say the same)
TORCH_CUDA_BUILDS="13.0 12.8 12.6"  # CUDA versions PyTorch's index has torch 2.13 wheels for
WHEELHOUSE=${WHEELHOUSE:-}
DRY_RUN=${SETUP_DRY_RUN:-0}
VERBOSE=${VERBOSE:-0}
LOG=$PWD/build/setup.log  # in the repository's ignored build folder, whichever folder the user ran from

# The user's stdout and stderr stay on 3 and 4 while a step sends its tools' output to the log, so that a
# message from inside a step (a note, die) still reaches the user.
exec 3>&1 4>&2
line_open=0  # 1 while a step's line waits for its "done in", 2 once something else was printed under it
end_line() { if [[ "$line_open" == 1 ]]; then echo >&3; line_open=2; fi; }
say() { end_line; echo "$*" >&3; }
warn() { end_line; echo "$*" >&4; }
die() { end_line; echo "error: $*" >&4; exit 1; }
# Instant changes with nothing to report go through `run`, so a dry run prints exactly what a real run does.
run() { if [[ "$DRY_RUN" == 1 ]]; then echo "[setup] $*"; else "$@"; fi; }
pip_install() { "$VENV_DIR/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
apt_install() { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; }

# "41 s", "3 min 20 s": the time since bash's clock ($SECONDS) read $1
since() {
    local s=$((SECONDS - $1))
    if (( s < 120 )); then echo "$s s"; else echo "$((s / 60)) min $((s % 60)) s"; fi
}

# try_step WHAT NEXT COMMAND...: runs COMMAND as one step, printed as one line, "[setup] WHAT ... done in 41 s
# (NEXT)", NEXT saying what happens the next time; COMMAND's own output is appended to the log, from byte
# step_from on. A dry run prints "[setup] COMMAND" instead and runs nothing; VERBOSE=1 prints COMMAND and
# lets its output through. Returns COMMAND's exit status; `step` stops the set-up on a failure.
# COMMAND runs as the left side of `||`, where bash ignores `set -e`: a function run here stops at its own
# failures (`|| return`).
try_step() {
    local what=$1 next=$2 started rc=0; shift 2
    if [[ "$DRY_RUN" == 1 ]]; then echo "[setup] $*"; return; fi
    started=$SECONDS
    if [[ "$VERBOSE" == 1 ]]; then
        echo "[setup] $what: $*"
        "$@" || rc=$?
    else
        printf '\n--- %s: %s\n' "$what" "$*" >> "$LOG"
        step_from=$(wc -c < "$LOG")
        printf '[setup] %s ... ' "$what"; line_open=1
        "$@" >> "$LOG" 2>&1 < /dev/null || rc=$?
    fi
    local took; took=$(since "$started")
    [[ "$line_open" == 1 ]] || printf '[setup] %s: ' "$what"
    line_open=0
    if (( rc == 0 )); then echo "done in $took${next:+ ($next)}"; else echo "failed after $took"; fi
    return "$rc"
}

# step_failed WHAT STATUS: the end of the failed step's output, then one line naming the step and the log.
step_failed() {
    if [[ "$VERBOSE" == 1 ]]; then die "$1 failed (exit $2); its output is above"; fi
    tail -c +"$((step_from + 1))" "$LOG" | tail -n 12 | sed 's/^/    /' >&4
    die "$1 failed (exit $2); its output: $LOG"
}

step() { try_step "$@" || step_failed "$1" "$?"; }

version_at_least() { [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" == "$2" ]]; }
# "<version> <cuda version or cpu>" of the torch that Python $1 imports; fails when it has none.
torch_of() { "$1" -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu")' 2>/dev/null; }

# X.Y of the CUDA toolkit's nvcc, found as torch's extension builds find it (CUDA_HOME or CUDA_PATH, else
# nvcc on PATH, else /usr/local/cuda); empty when there is none.
nvcc_release() {
    local nvcc=/usr/local/cuda/bin/nvcc home=${CUDA_HOME:-${CUDA_PATH:-}}
    if [[ -n "$home" ]]; then nvcc=$home/bin/nvcc
    elif command -v nvcc >/dev/null 2>&1; then nvcc=$(command -v nvcc); fi
    [[ -x "$nvcc" ]] || return 0
    "$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1
}

# DeepSpeed (op_builder's assert_no_cuda_mismatch) builds an op only with nvcc's CUDA equal to torch's, or
# both within 10.x, 11.x or 12.x; 13.x minors must be equal.
cuda_matches() {
    [[ "$1" == "$2" ]] || { [[ "${1%%.*}" == "${2%%.*}" ]] && (( ${1%%.*} <= 12 )); }
}

# One warning line when the offload driver's CPU Adam could not be built for torch's CUDA $1.
warn_offload_nvcc() {
    local torch_cuda=$1 nvcc=$2
    if [[ -z "$nvcc" ]]; then
        echo "[setup] warning: no CUDA toolkit (nvcc) found: offload (the Z3_OL driver) compiles DeepSpeed's CPU" \
             "Adam with nvcc and needs the CUDA $torch_cuda toolkit, as CUDA_HOME or nvcc on PATH" >&2
    elif ! cuda_matches "$nvcc" "$torch_cuda"; then
        echo "[setup] warning: nvcc is CUDA $nvcc but torch is built for CUDA $torch_cuda: offload (the Z3_OL" \
             "driver) compiles DeepSpeed's CPU Adam with nvcc and needs the CUDA $torch_cuda toolkit as CUDA_HOME" >&2
    fi
}

# CUDA minor-version compatibility: a build for CUDA M.y runs on any driver for CUDA M.x (R525 onward for
# 12.x, R580 for 13.x). The oldest build of the driver's major, since a newer one's PTX could not be
# compiled by that driver for a GPU the build has no code for. Empty when torch has no build of that major.
minor_compatible_build() {
    local build found=""
    for build in $TORCH_CUDA_BUILDS; do [[ "${build%%.*}" == "${1%%.*}" ]] && found=$build; done
    echo "$found"
}
minimum_driver() { if [[ "${1%%.*}" == 12 ]]; then echo 525; else echo 580; fi; }

# The pip arguments that install torch here: the CUDA wheels for the newest CUDA the driver runs (the
# "CUDA Version" in nvidia-smi's header) that nvcc matches, else torch==TORCH_VERSION as pip finds it.
# A 12.0-12.5 driver, older than every 12.x build, runs the oldest one (minor-version compatibility).
torch_install_args() {
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        echo "torch==$TORCH_VERSION --index-url $TORCH_INDEX_URL"; return
    fi
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "torch==$TORCH_VERSION"; return
    fi
    local report driver build nvcc chosen=""
    if ! report=$(nvidia-smi 2>&1); then
        echo "[setup] warning: nvidia-smi failed ($(head -n 1 <<< "$report")): installing torch without CUDA" >&2
        echo "torch==$TORCH_VERSION"; return
    fi
    driver=$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' <<< "$report" | head -n 1)
    [[ -n "$driver" ]] \
        || die "nvidia-smi prints no 'CUDA Version': set TORCH_INDEX_URL to the PyTorch index for your CUDA"
    nvcc=$(nvcc_release)
    for build in $TORCH_CUDA_BUILDS; do
        version_at_least "$driver" "$build" || continue
        [[ -n "$chosen" ]] || chosen=$build  # the newest the driver runs, when nvcc matches none
        if [[ -n "$nvcc" ]] && cuda_matches "$nvcc" "$build"; then chosen=$build; break; fi
    done
    if [[ -z "$chosen" ]]; then
        chosen=$(minor_compatible_build "$driver")
        [[ -n "$chosen" ]] \
            || die "the NVIDIA driver runs CUDA $driver, older than every CUDA build of torch $TORCH_VERSION" \
                   "(${TORCH_CUDA_BUILDS// /, }): update the driver, or set TORCH_INDEX_URL"
        echo "[setup] the driver runs CUDA $driver; torch's cu${chosen/./} build runs on it through CUDA" \
             "minor-version compatibility (driver >= $(minimum_driver "$chosen"))" >&2
    fi
    warn_offload_nvcc "$chosen" "$nvcc"
    echo "torch==$TORCH_VERSION --index-url https://download.pytorch.org/whl/cu${chosen/./}"
}

# Debian's and Ubuntu's Python without python3-venv has no ensurepip, so `-m venv` fails after
# making a venv without pip; then pip goes in from the wheelhouse, or through PYTHON's own pip.
make_venv() {
    local python=$1 venv=$2 report wheel
    report=$("$python" -m venv "$venv" 2>&1) && return
    say "[setup] $python -m venv failed ($(head -n 1 <<< "$report")): adding pip to $venv by hand"
    "$python" -m venv --clear --without-pip "$venv" || return
    if [[ -n "$WHEELHOUSE" ]]; then
        wheel=$(compgen -G "$WHEELHOUSE/pip-*.whl" | head -n 1) \
            || die "PYTHON=$python has no ensurepip and WHEELHOUSE=$WHEELHOUSE no pip wheel: rebuild it with" \
                   "scripts/wheelhouse.sh, or install python3-venv"
        "$venv/bin/python" "$wheel/pip" install --quiet --no-index "$wheel"  # pip runs from its own wheel
    else
        "$python" -m pip --python "$venv/bin/python" install --quiet pip \
            || die "PYTHON=$python has no ensurepip and its pip cannot install pip into $venv: install python3-venv"
    fi
}

# A venv made from another venv (a GPU image's /opt/torch/.venv, say) cannot see that venv's
# packages through --system-site-packages, which reaches only the base interpreter's; a .pth
# file can. Its folders come after .venv's own, so zero-lab's pins still win.
link_site_packages() {
    local pth=$1; shift
    printf '%s\n' "$@" > "$pth"
}

if [[ -n "$WHEELHOUSE" ]]; then
    [[ -d "$WHEELHOUSE" ]] || die "WHEELHOUSE=$WHEELHOUSE: no such folder (make one with scripts/wheelhouse.sh)"
    WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
fi
if [[ "$DRY_RUN" != 1 && "$VERBOSE" != 1 ]]; then
    mkdir -p "$(dirname "$LOG")"
    printf '\n===== scripts/setup.sh, %s, VENV_DIR=%s PYTHON=%s%s\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" \
        "$VENV_DIR" "$PYTHON" "${WHEELHOUSE:+ WHEELHOUSE=$WHEELHOUSE}" >> "$LOG"
    echo "[setup] the tools' own output goes to $LOG (VERBOSE=1 prints it here)"
fi

torch_found=""
if [[ -x "$VENV_DIR/bin/python" ]]; then
    torch_found=$(torch_of "$VENV_DIR/bin/python") || torch_found=""
else
    step "making the virtual environment $VENV_DIR" "kept: skipped next time" make_venv "$PYTHON" "$VENV_DIR"
    base_torch=$(torch_of "$PYTHON") || base_torch=""
    if [[ -n "$base_torch" && ( "${base_torch#* }" != cpu || -n "$WHEELHOUSE" ) ]]; then
        py_dir=$("$PYTHON" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
        mapfile -t base_sites < <("$PYTHON" -c 'import sysconfig
paths = sysconfig.get_paths()
print(*dict.fromkeys([paths["purelib"], paths["platlib"]]), sep="\n")')
        echo "[setup] keeping torch ${base_torch% *} of PYTHON=$PYTHON: $VENV_DIR sees its packages"
        run link_site_packages "$VENV_DIR/lib/$py_dir/site-packages/zero_lab_base.pth" "${base_sites[@]}"
        torch_found=$base_torch
    fi
fi

if [[ -n "$torch_found" ]]; then
    version=${torch_found%% *}; version=${version%%+*}
    { version_at_least "$version" "$TORCH_MIN" && ! version_at_least "$version" "$TORCH_BELOW"; } \
        || die "torch $version found, but zero-lab needs torch >= $TORCH_MIN, < $TORCH_BELOW:" \
               "install one of those (a CUDA build on a GPU machine) or use a fresh VENV_DIR and PYTHON"
    [[ -x "$VENV_DIR/bin/python" ]] && echo "[setup] torch ${torch_found% *} (${torch_found#* }) is already installed"
    [[ "${torch_found#* }" == cpu ]] || warn_offload_nvcc "${torch_found#* }" "$(nvcc_release)"
elif [[ -n "$WHEELHOUSE" ]]; then
    die "WHEELHOUSE=$WHEELHOUSE: neither $VENV_DIR nor PYTHON=$PYTHON imports torch, and a wheelhouse holds none:" \
        "install torch >= $TORCH_MIN, < $TORCH_BELOW first (the CUDA build on a GPU machine)"
else
    # torch first and pinned: an unpinned torch requirement would pull whatever build PyPI has (GBs).
    torch_args=$(torch_install_args) || exit 1
    read -r -a torch_args <<< "$torch_args"
    torch_build=""
    [[ "${torch_args[*]}" != *download.pytorch.org/whl/cu* ]] \
        || torch_build=" for CUDA $(sed 's/.*whl\/cu\([0-9]*\)\([0-9]\).*/\1.\2/' <<< "${torch_args[*]}")"
    step "installing torch $TORCH_VERSION$torch_build" "kept in $VENV_DIR: skipped next time" \
        pip_install "${torch_args[@]}"
fi

# SETUP_EXTRAS (default test): the extras of setup.py installed with zero-lab; empty for the package alone
# (a GPU machine that only trains, from a wheelhouse made with scripts/wheelhouse.sh --no-test).
extras=${SETUP_EXTRAS-test}
[[ "$extras" =~ ^[a-z,]*$ ]] || die "SETUP_EXTRAS=$extras: expected extras of setup.py such as test, or nothing"
target=.${extras:+[$extras]}
zero_lab="installing zero-lab (pip install -e $target, builds megatron.data.helpers)"
zero_lab_next="checked again next time: seconds"
if [[ -z "$WHEELHOUSE" ]]; then
    # constraints.txt: the exact versions the project runs, within setup.py's ranges
    step "$zero_lab" "$zero_lab_next" pip_install -c constraints.txt -e "$target"
else
    # No constraints: what the machine has within setup.py's ranges is kept, the wheelhouse adds the rest.
    # Build isolation stays on: pip installs setuptools, wheel and pybind11 for the build from
    # the wheelhouse too. pip's own message for a missing wheel is a page; one line names it.
    try_step "$zero_lab from WHEELHOUSE" "$zero_lab_next" \
        pip_install --no-index --find-links "$WHEELHOUSE" -e "$target" || {
        status=$?
        missing=""
        [[ "$VERBOSE" == 1 ]] \
            || missing=$(tail -c +"$((step_from + 1))" "$LOG" \
                         | sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' | head -n 1)
        [[ -z "$missing" ]] \
            || die "WHEELHOUSE=$WHEELHOUSE has no wheel for $missing for $("$VENV_DIR/bin/python" -V):" \
            "rebuild it with 'bash scripts/wheelhouse.sh DIR --python-version X.Y' on a machine with package access"
        step_failed "$zero_lab from WHEELHOUSE" "$status"
    }
fi

# From Debian, in one step: mpiexec, which ALCF/train-gpt3.sh and its tests need (MPICH provides it), and
# libaio's headers, which DeepSpeed's async I/O op (NVMe offload: examples_zero/gpt_deepspeed_Z3_NVMe.sh)
# builds against.
can_apt=0
[[ -z "$WHEELHOUSE" ]] && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && can_apt=1
apt_packages=() apt_uses=()
if ! command -v mpiexec >/dev/null 2>&1; then
    if [[ "$can_apt" == 1 ]]; then
        apt_packages+=(mpich) apt_uses+=("mpich (mpiexec)")
    else
        warn "[setup] warning: no mpiexec found; install MPICH or Open MPI to use ALCF/train-gpt3.sh"
    fi
fi
if [[ ! -f /usr/include/libaio.h ]]; then
    if [[ "$can_apt" == 1 ]]; then
        apt_packages+=(libaio-dev) apt_uses+=("libaio-dev (NVMe offload)")
    else
        warn "[setup] warning: no libaio headers; install libaio-dev to use NVMe offload (gpt_deepspeed_Z3_NVMe.sh)"
    fi
fi
if (( ${#apt_packages[@]} )); then
    uses=$(printf ', %s' "${apt_uses[@]}")
    step "installing ${uses#, } from Debian" "installed: skipped next time" apt_install "${apt_packages[@]}"
fi
# DeepSpeed compiles its C++ ops at first use, into the environment's own folder (megatron/deepspeed_ops.py
# says where, for this script, scripts/test.sh and every rank). The main job (ZeRO-1 on the CPU accelerator)
# loads one, the shared-memory collectives that DeepSpeed's init_distributed loads on every CPU run (about
# 1 min on a 2-core machine): built here, the first run starts at once. The others (cpu_adam for CPU offload,
# async_io for NVMe, pin_memory) are built at their first use, a line saying so before each build. Not with
# a GPU or from a wheelhouse: a GPU machine builds its CUDA ops, against its toolkit, at their first use.
if [[ -z "$WHEELHOUSE" ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    # the venv's ninja, by an absolute path: torch runs ninja inside the build folder, where a relative PATH
    # entry finds nothing, and a build recorded by another ninja (Debian's) is rebuilt by the venv's at first use
    venv_bin=$VENV_DIR/bin; [[ "$venv_bin" == /* ]] || venv_bin=$PWD/$venv_bin
    ops_folder="the environment's torch_extensions"  # a dry run has no venv to ask
    [[ "$DRY_RUN" == 1 ]] || ops_folder=$("$VENV_DIR/bin/python" -m megatron.deepspeed_ops folder)
    step "building DeepSpeed's deepspeed_shm_comm, the one op the main job loads (the others at first use)" \
         "cached in $ops_folder: seconds next time" \
         env DS_ACCELERATOR=cpu PATH="$venv_bin:$PATH" "$VENV_DIR/bin/python" -m megatron.deepspeed_ops build \
         deepspeed_shm_comm
fi
echo "[setup] done in $(since 0): activate with 'source $VENV_DIR/bin/activate'"
