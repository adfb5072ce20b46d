#!/usr/bin/env bash
# Set up zero-lab on a fresh machine: a virtual environment in .venv with torch, the package
# (which compiles the pybind11 helper), and an MPI launcher for the ALCF scripts. Safe to run
# again: every step is skipped when already done.
#
# torch: without an NVIDIA GPU, torch==TORCH_VERSION as pip finds it (the CPU build on the project
# machines). With one (nvidia-smi answers), the CUDA build for the newest CUDA the driver runs that
# matches the CUDA toolkit's nvcc, when there is one (DeepSpeed builds its CPU Adam for offload with
# that nvcc and refuses another CUDA), from PyTorch's index (TORCH_INDEX_URL overrides), unless PYTHON
# already imports a CUDA torch: that one is kept, and the new .venv sees PYTHON's packages. Either way
# one warning line says when offload would find no matching nvcc. zero-lab runs on torch 2.11 to 2.13.
# WHEELHOUSE=DIR: install from DIR only (made by scripts/wheelhouse.sh), never from the network;
# the torch found in .venv or PYTHON is kept, whatever its build, since DIR holds none.
# SETUP_DRY_RUN=1: print every command a real run would run, and change nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV_DIR=${VENV_DIR:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_MIN=2.11 TORCH_BELOW=2.14  # the torch releases zero-lab runs on (setup.py and docs/gpu.md say the same)
TORCH_CUDA_BUILDS="13.0 12.8 12.6"  # CUDA versions PyTorch's index has torch 2.13 wheels for
WHEELHOUSE=${WHEELHOUSE:-}
DRY_RUN=${SETUP_DRY_RUN:-0}

die() { echo "error: $*" >&2; exit 1; }
# Every change goes through `run`, so a dry run prints exactly what a real run does.
run() { echo "[setup] $*"; [[ "$DRY_RUN" == 1 ]] || "$@"; }
pip_install() { "$VENV_DIR/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
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

# The pip arguments that install torch here: the CUDA wheels for the newest CUDA the driver runs (the
# "CUDA Version" in nvidia-smi's header) that nvcc matches, else torch==TORCH_VERSION as pip finds it.
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
    [[ -n "$chosen" ]] \
        || die "the NVIDIA driver runs CUDA $driver, older than every CUDA build of torch $TORCH_VERSION" \
               "(${TORCH_CUDA_BUILDS// /, }): update the driver, or set TORCH_INDEX_URL"
    warn_offload_nvcc "$chosen" "$nvcc"
    echo "torch==$TORCH_VERSION --index-url https://download.pytorch.org/whl/cu${chosen/./}"
}

# Debian's and Ubuntu's Python without python3-venv has no ensurepip, so `-m venv` fails after
# making a venv without pip; then pip goes in from the wheelhouse, or through PYTHON's own pip.
make_venv() {
    local python=$1 venv=$2 report wheel
    report=$("$python" -m venv "$venv" 2>&1) && return
    echo "[setup] $python -m venv failed ($(head -n 1 <<< "$report")): adding pip to $venv by hand"
    "$python" -m venv --clear --without-pip "$venv"
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

torch_found=""
if [[ -x "$VENV_DIR/bin/python" ]]; then
    torch_found=$(torch_of "$VENV_DIR/bin/python") || torch_found=""
else
    run make_venv "$PYTHON" "$VENV_DIR"
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
    run pip_install "${torch_args[@]}"
fi

echo "[setup] installing zero-lab (pip install -e .[test], builds megatron.data.helpers)"
if [[ -z "$WHEELHOUSE" ]]; then
    run pip_install -e ".[test]"
else
    # Build isolation stays on: pip installs setuptools, wheel and pybind11 for the build from
    # the wheelhouse too. pip's own message for a missing wheel is a page; one line names it.
    log=$(mktemp); trap 'rm -f "$log"' EXIT
    if ! run pip_install --no-index --find-links "$WHEELHOUSE" -e ".[test]" > "$log" 2>&1; then
        missing=$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$log" | head -n 1)
        [[ -z "$missing" ]] \
            || die "WHEELHOUSE=$WHEELHOUSE has no wheel for $missing for $("$VENV_DIR/bin/python" -V):" \
            "rebuild it with 'bash scripts/wheelhouse.sh DIR --python-version X.Y' on a machine with package access"
        cat "$log" >&2
        die "pip install from WHEELHOUSE=$WHEELHOUSE failed (pip's output above)"
    fi
    cat "$log"
fi

# mpiexec is needed by ALCF/train-gpt3.sh and its tests; Debian's MPICH provides it.
if ! command -v mpiexec >/dev/null 2>&1; then
    if [[ -z "$WHEELHOUSE" ]] && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
        echo "[setup] installing mpich (mpiexec) from Debian"
        run apt-get update -qq
        DEBIAN_FRONTEND=noninteractive run apt-get install -y -qq mpich
    else
        echo "[setup] warning: no mpiexec found; install MPICH or Open MPI to use ALCF/train-gpt3.sh" >&2
    fi
fi

# DeepSpeed's async I/O op (NVMe offload: examples_zero/gpt_deepspeed_Z3_NVMe.sh) builds against libaio.
if [[ ! -f /usr/include/libaio.h ]]; then
    if [[ -z "$WHEELHOUSE" ]] && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
        echo "[setup] installing libaio-dev (NVMe offload) from Debian"
        run apt-get update -qq
        DEBIAN_FRONTEND=noninteractive run apt-get install -y -qq libaio-dev
    else
        echo "[setup] warning: no libaio headers; install libaio-dev to use NVMe offload (gpt_deepspeed_Z3_NVMe.sh)" >&2
    fi
fi
# DeepSpeed compiles its C++ ops at first use: on the CPU accelerator the CPU Adam (Z3_OL) and the async I/O
# op (Z3_NVMe) take about 1 and 3 minutes on a 2-core machine. Built here once (cached in
# ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), no run stalls compiling. Not with a GPU or from a
# wheelhouse: a GPU machine builds its CUDA ops, against its toolkit, at their first use.
if [[ -z "$WHEELHOUSE" ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "[setup] building DeepSpeed's CPU ops (cpu_adam, async_io, ...): minutes the first time, seconds after"
    # the venv's ninja, by an absolute path: torch runs ninja inside the build folder, where a relative PATH
    # entry finds nothing, and a build recorded by another ninja (Debian's) is rebuilt by the venv's at first use
    venv_bin=$VENV_DIR/bin; [[ "$venv_bin" == /* ]] || venv_bin=$PWD/$venv_bin
    run env DS_ACCELERATOR=cpu PATH="$venv_bin:$PATH" "$VENV_DIR/bin/python" -c '
from deepspeed.accelerator import get_accelerator
for name in ("ShareMemCommBuilder", "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible(verbose=False):
        builder.load(verbose=False)'
fi
echo "[setup] done: activate with 'source $VENV_DIR/bin/activate'"
