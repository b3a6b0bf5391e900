#!/usr/bin/env bash
# Build real pyverbs (rdma-core 59) for the API-agreement test, or reuse a cached build.
#
# Usage: .ci/build_pyverbs.sh [PYTHON]        (default: $PYTHON, else python3)
#
# pyverbs on PyPI is an sdist that carries rdma-core's whole source tree. Its pip build needs
# libibverbs 59 at run time, which Debian 12 does not ship (it has 44), so instead we run
# rdma-core's own CMake build of that sdist in place: it yields libibverbs/librdmacm/providers 59
# in build/lib and pyverbs in build/python together.
#
# The build lives outside the repository, keyed by rdma-core version and Python ABI:
#     ${TRANSPORTD_CACHE:-/var/cache/transportd}/rdma-core-59.0-py3.11/
# It is built in place there (IN_PLACE bakes absolute paths in, so it is never moved) and is
# reused only when its stamp file, written last, matches. A lock serialises concurrent runs.
#
# All progress goes to stderr. stdout carries only `export` lines (also written to env.sh in the
# build root), so callers can do:  env="$(.ci/build_pyverbs.sh .venv/bin/python)"; eval "$env"
set -euo pipefail

PYVERBS_VERSION=59.0
# rdma-core's CMake build needs Cython < 3.1 (docs/design.md, "pyverbs from the node's rdma-core").
CYTHON_SPEC='cython>=0.29,<3.1'

py="${1:-${PYTHON:-python3}}"
if ! py="$(command -v "$py")"; then
    echo "build_pyverbs: python '${1:-${PYTHON:-python3}}' not found" >&2
    exit 2
fi
log() { echo "build_pyverbs: $*" >&2; }

pyver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
soabi="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("SOABI") or "")')"
cache="${TRANSPORTD_CACHE:-/var/cache/transportd}"
root="$cache/rdma-core-$PYVERBS_VERSION-py$pyver"
build="$root/rdma-core/build"
stamp="$root/.complete"
stamp_text="pyverbs=$PYVERBS_VERSION soabi=$soabi"

mkdir -p "$cache"
exec 9>"$root.lock"
if ! flock -w 3600 9; then
    log "timed out waiting for $root.lock"
    exit 1
fi

# Runs with the libraries and modules of the build; used to verify both fresh and cached builds.
run_built() {
    LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" \
        "$py" "$@"
}

verify() {
    run_built - <<'EOF'
import pyverbs
import pyverbs.device
from pyverbs.providers.efa import efadv
from pyverbs.providers.mlx5 import mlx5dv
from pyverbs.pyverbs_error import PyverbsRDMAError

for mod, names in ((efadv, ("EfaContext", "SRDQP", "SRDQPEx")), (mlx5dv, ("Mlx5Context",))):
    for name in names:
        assert hasattr(mod, name), f"{mod.__name__}.{name} missing"
try:
    devices = pyverbs.device.get_device_list()
except PyverbsRDMAError as e:
    print(f"get_device_list() raised PyverbsRDMAError (no device): {e}")
else:
    print(f"get_device_list() returned {len(devices)} device(s)")
print(f"pyverbs {pyverbs.__file__} OK")
EOF
}

emit_env() {
    local env_file="$root/env.sh"
    {
        printf 'export TRANSPORTD_PYVERBS_PATH=%q\n' "$build/python"
        printf 'export PYTHONPATH=%q"${PYTHONPATH:+:$PYTHONPATH}"\n' "$build/python"
        printf 'export LD_LIBRARY_PATH=%q"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n' "$build/lib"
    } >"$env_file.tmp"
    mv -f "$env_file.tmp" "$env_file"
    log "environment written to $env_file"
    cat "$env_file"
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]]; then
    log "reusing cached build in $root"
    if verify >&2; then
        emit_env
        exit 0
    fi
    log "cached build failed verification; rebuilding"
fi

t0=$SECONDS

# Debian build dependencies (the Python headers come with the interpreter itself).
export DEBIAN_FRONTEND=noninteractive
log "installing build dependencies with apt"
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends \
    gcc make cmake ninja-build pkg-config libnl-3-dev libnl-route-3-dev libudev-dev >&2

log "installing '$CYTHON_SPEC' into $py"
"$py" -m pip install -q "$CYTHON_SPEC" >&2

rm -rf "$root"
mkdir -p "$root"

# --no-binary for pyverbs alone: with ':all:' pip also compiles the sdist's build requirements
# (Cython) from source just to read its metadata, which costs minutes here.
log "downloading the pyverbs $PYVERBS_VERSION sdist"
"$py" -m pip download -q --no-deps --no-binary pyverbs -d "$root/dl" "pyverbs==$PYVERBS_VERSION" >&2
sdist="$root/dl/pyverbs-$PYVERBS_VERSION.tar.gz"
tar -xzf "$sdist" -C "$root" --strip-components=1
[[ -f "$root/rdma-core/CMakeLists.txt" ]] || { log "sdist carries no rdma-core/CMakeLists.txt"; exit 1; }

log "configuring rdma-core in $build"
mkdir -p "$build"
(
    cd "$build"
    cmake -GNinja -DIN_PLACE=1 -DNO_MAN_PAGES=1 -DCMAKE_BUILD_TYPE=Release \
        -DPYTHON_EXECUTABLE="$py" .. >&2
    # rdma-core's Findcython writes this wrapper only when it found a usable Cython.
    [[ -x python/cython ]] || {
        log "cmake found no usable Cython for $py; pyverbs would not be built"
        exit 1
    }
    log "building ($(nproc) jobs)"
    ninja >&2
)

verify >&2
printf '%s' "$stamp_text" >"$stamp"
log "built in $((SECONDS - t0)) s"
emit_env
