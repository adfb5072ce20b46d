#!/usr/bin/env bash
# Usage: bash scripts/wheelhouse.sh DIR [--python-version X.Y] [--present FILE] [--no-test]
# On a machine with package access: every wheel zero-lab needs except torch (and what only torch
# needs), for CPython X.Y (default: this python3's) on x86-64 Linux, into DIR, so that
# `WHEELHOUSE=DIR bash scripts/setup.sh` installs on a machine without network next to the torch
# it already has. It holds: the requirements of setup.py and its [test] extra at constraints.txt's
# versions, with their dependencies; DeepSpeed as a pure-Python wheel (DS_BUILD_OPS=0: its ops compile
# at first use); the build requirements of pyproject.toml (setuptools, wheel, pybind11), since
# `pip install -e .` compiles the helper extension there from source.
# --no-test: without the [test] extra (for `SETUP_EXTRAS= WHEELHOUSE=DIR bash scripts/setup.sh`).
# --present FILE: the target machine's packages, as `python3 -m pip list --format=freeze` there prints
# them, or one name per line where versions are unknown. Its packages are left out where the target's
# pip will take them: one of setup.py's requirements at a version within setup.py's range (a name
# without a version is taken to be within it), any other (a dependency's dependency) at any version. If
# a present version falls outside a range, setup.sh names the wheel it misses: drop that line from FILE.
# The build requirements and pip always stay (pip builds in an isolated environment that sees no
# others; a venv made without ensurepip gets pip from here).
# WHEELHOUSE_GLIBC (default 2.28): the newest manylinux glibc a wheel may need (`ldd --version`
# on the target machine says its own). PYTHON: the interpreter whose pip downloads (python3).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
GLIBC=${WHEELHOUSE_GLIBC:-2.28}
die() { echo "error: $*" >&2; exit 1; }

usage="usage: scripts/wheelhouse.sh DIR [--python-version X.Y] [--present FILE] [--no-test]"
dir="" python_version="" present="" with_test=1
while (( $# )); do
    case "$1" in
        --python-version) [[ $# -ge 2 ]] || die "--python-version needs a value such as 3.12"
                          python_version=$2; shift 2 ;;
        --present) [[ $# -ge 2 && -f "${2:-}" ]] || die "--present ${2:-}: no such file ($usage)"
                   present=$2; shift 2 ;;
        --no-test) with_test=0; shift ;;
        -*) die "unknown option $1 ($usage)" ;;
        *) [[ -z "$dir" ]] || die "one folder expected, got '$dir' and '$1'"; dir=$1; shift ;;
    esac
done
[[ -n "$dir" ]] || die "no folder given ($usage)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "PYTHON=$PYTHON has no pip"
python_version=${python_version:-$("$PYTHON" -c 'import sys; print(*sys.version_info[:2], sep=".")')}
[[ "$python_version" =~ ^3\.[0-9]+$ ]] || die "--python-version $python_version: expected 3.N, such as 3.12"
[[ "$GLIBC" =~ ^2\.([0-9]+)$ ]] || die "WHEELHOUSE_GLIBC=$GLIBC: expected 2.N, such as 2.28"

# setup.py's requirements (with the [test] extra's unless --no-test) at constraints.txt's versions, setup.py's
# ranges of the same ("NAME RANGE" lines) and pyproject.toml's build requirements, read as data (nothing is built).
read_requirements() {
    "$PYTHON" - "$REPO" "$1" "$with_test" <<'EOF'
import ast, re, sys, tomllib
from pathlib import Path
repo, part, with_test = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
if part == "build":
    print(*tomllib.loads((repo / "pyproject.toml").read_text())["build-system"]["requires"], sep="\n")
    sys.exit()
call = next(node for node in ast.walk(ast.parse((repo / "setup.py").read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
requirements = keywords["install_requires"] + (keywords.get("extras_require", {}).get("test", []) if with_test else [])
pins = {}
for line in (repo / "constraints.txt").read_text().splitlines():
    if "==" in line and not line.startswith("#"):
        name, version = line.split("==")
        pins[name.strip().lower()] = version.strip()
for requirement in requirements:
    name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()
    if part == "ranges":
        print(name.lower(), spec)
    else:
        print(f"{name}=={pins[name.lower()]}" if name.lower() in pins else requirement)
EOF
}
mapfile -t project < <(read_requirements install)
mapfile -t ranges < <(read_requirements ranges)
mapfile -t build < <(read_requirements build)
deepspeed=$(printf '%s\n' "${project[@]}" | grep '^deepspeed') || die "setup.py pins no deepspeed"

# Fill a temporary folder and rename it at the end: a DIR that exists is complete.
mkdir -p "$(dirname "$dir")"
tmp=$(mktemp -d "$dir.partial.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# DeepSpeed is published as a source archive only; built with its ops left out, the wheel is pure
# Python and the same for every Python version. No build isolation: its build looks for torch
# only to pre-compile ops, which DS_BUILD_OPS=0 turns off.
echo "[wheelhouse] building $deepspeed (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$tmp" "$deepspeed"
ds_wheel=$(ls "$tmp"/deepspeed-*.whl)
# Its own requirements, less torch and the extras.
mapfile -t ds_requirements < <("$PYTHON" - "$ds_wheel" <<'EOF'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(wheel.read(name).decode())
for requirement in metadata.get_all("Requires-Dist") or []:
    if "extra ==" not in requirement and not requirement.startswith("torch"):
        print(requirement)
EOF
)

platforms=()
for (( minor = ${GLIBC#2.}; minor >= 17; minor-- )); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
# pip too: setup.sh installs it into a venv whose Python has no ensurepip (Debian without python3-venv).
requirements=("${build[@]}" pip "${ds_requirements[@]}")
for requirement in "${project[@]}"; do
    [[ "$requirement" == torch* || "$requirement" == deepspeed* ]] || requirements+=("$requirement")
done
echo "[wheelhouse] downloading wheels for CPython $python_version, manylinux glibc <= $GLIBC: ${requirements[*]}"
"$PYTHON" -m pip download --quiet --disable-pip-version-check -d "$tmp" --only-binary=:all: \
    --python-version "$python_version" --implementation cp "${platforms[@]}" "${requirements[@]}" \
    || die "pip could not download every wheel for CPython $python_version (pip's message above)"
if compgen -G "$tmp/torch-*" >/dev/null; then
    die "a requirement pulled torch into the wheelhouse; the wheelhouse must leave torch to the machine"
fi
if [[ -n "$present" ]]; then
    # pip builds zero-lab in an isolated environment that sees none of the target's packages: the build
    # requirements stay with everything they need (wheel needs packaging, say), whatever the target has.
    "$PYTHON" -m pip download --quiet --disable-pip-version-check -d "$tmp/.build" --only-binary=:all: \
        --python-version "$python_version" --implementation cp "${platforms[@]}" "${build[@]}" pip \
        || die "pip could not download the build requirements for CPython $python_version (pip's message above)"
    mapfile -t build_closure < <(ls "$tmp/.build" | cut -d- -f1)
    rm -rf "$tmp/.build"
    "$PYTHON" - "$tmp" "$present" "${ranges[@]}" --build "${build_closure[@]}" <<'EOF'
import re, sys
from pathlib import Path
from pip._vendor.packaging.specifiers import SpecifierSet

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

folder, present_file, *arguments = sys.argv[1:]
split = arguments.index("--build")
ranges = {norm(line.split(" ", 1)[0]): SpecifierSet(line.split(" ", 1)[1].strip()) for line in arguments[:split]}
build_names = {norm(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0]) for r in arguments[split + 1:]}
present = {}  # name -> version, None where the file names the package without one
for line in Path(present_file).read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
        continue
    name, _, version = line.partition("==")
    present[norm(name)] = version.strip() or None
left_out = []
for wheel in sorted(Path(folder).glob("*.whl")):
    name = norm(wheel.name.split("-")[0])
    if name in build_names or name not in present:
        continue
    version = present[name]
    if name not in ranges or version is None or ranges[name].contains(version, prereleases=True):
        left_out.append(f"{name} (target has {version or 'a version'})")
        wheel.unlink()
print(f"[wheelhouse] left out, present on the target: {', '.join(left_out) or 'none'}")
EOF
fi

rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "[wheelhouse] $dir: $(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
