#!/usr/bin/env bash
# The GPU path on a bare CUDA node, in one command (≤ 8 minutes on one H100), ending with one table.
#
#   scripts/gpu_check.sh [--wheels DIR] [--limit-s S]    run `pytest -m gpu tests/gpu` and print the table
#   scripts/gpu_check.sh --dry-run                       what it would run and which wheels it needs; exit 0
#   scripts/gpu_check.sh --prepare                       check the node and install the wheels only (the benches'
#                                                        set-up: scripts/gpu_session.sh)
#   scripts/gpu_check.sh --download [--python-version V] pip download the wheels into DIR (needs the registry)
#
# The node brings Python >= 3.11, PyTorch >= 2.11 built with CUDA, transformers, safetensors, tensorboard,
# pandas and pyarrow. megatron-core 0.16.1, datasets and the few packages the tests import beyond those
# travel as wheels (list and reasons: tests/gpu/node.py); the ones the node lacks are installed with `pip
# install --no-index --no-deps` into .gpu_check/site, on PYTHONPATH with the checkout: nothing resolves
# packages or reaches the network, the node's environment is left as it was. Environment: MT_PYTHON
# (python3), MT_GPU_WHEELS (wheels/gpu_check), MT_GPU_LIMIT_S (450: pytest's share of the 8 minutes).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${MT_PYTHON:-python3}"
WHEELS="${MT_GPU_WHEELS:-$ROOT/wheels/gpu_check}"
LIMIT_S="${MT_GPU_LIMIT_S:-450}"
WORK="$ROOT/.gpu_check"
MODE=run
DOWNLOAD_ARGS=()

while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version|--platform|--wheels|--limit-s)
            if [[ $# -lt 2 || "$2" == --* ]]; then echo "gpu_check: $1 needs a value (see --help)" >&2; exit 2; fi ;;
    esac
    case "$1" in
        --dry-run) MODE=dry ;;
        --download) MODE=download ;;
        --python-version) DOWNLOAD_ARGS+=(--python-version "$2"); shift ;;
        --platform) DOWNLOAD_ARGS+=(--platform "$2"); shift ;;
        --wheels) WHEELS="$2"; shift ;;
        --limit-s) LIMIT_S="$2"; shift ;;
        --prepare) MODE=prepare ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

cd "$ROOT"
if [[ "$MODE" == download ]]; then
    exec "$PY" tests/gpu/node.py download "$WHEELS" ${DOWNLOAD_ARGS[@]+"${DOWNLOAD_ARGS[@]}"}
fi

BY_CONSTRUCTION="Right by construction, not run here (cited upstream sources in the code, recording stand-ins in the CPU tests):
  - Transformer Engine attention and fused RoPE (the TE layer spec): not assumed on the node; the tests use the
    local spec, whose THD core attention gets the same PackedSeqParams TE would (model/thd_attention.py)
  - SGLang rollout servers (DVP logit processor, weight sync, pause/continue): their own environment and GPUs
  - NCCL across several GPUs or nodes (TP/PP/DP > 1, the in-memory weight sync): world size 1 here
  - gradient-accumulation fusion (model.gradient_accumulation_fusion): apex's CUDA extension is not assumed on
    the node (null turns it off without it; bench.step says which ran); megatron's code around apex's kernel
    runs in tests/train/test_grad_accum_fusion.py with a stand-in for the kernel"

list_tests() {
    # The gpu tests pytest would run (collect only); where collecting fails (no pytest or no torch on this
    # host), their names from the files.
    local listed
    listed="$(PYTHONPATH="$1" HF_HUB_OFFLINE=1 "$PY" -m pytest --collect-only -q -m gpu tests/gpu \
        -p no:cacheprovider 2>/dev/null | grep '::' || true)"
    if [[ -z "$listed" ]]; then
        echo "  (pytest cannot collect here; the test functions, parameters not expanded:)"
        listed="$(grep -Hn '^def test_' tests/gpu/test_*.py | sed 's/:[0-9]*:def \([a-z0-9_]*\).*/::\1/')"
    fi
    while IFS= read -r line; do echo "  $line"; done <<<"$listed"
}

PATCHES_LINK="megatron_tail/patches"
echo "== megatron_tail GPU check ($ROOT)"
if [[ "$MODE" == dry ]]; then
    echo "-- dry run: nothing is installed or run"
    "$PY" tests/gpu/node.py check "$WHEELS" --site "$WORK/site" || true
    [[ -e "$PATCHES_LINK" ]] || echo "Would link $PATCHES_LINK -> ../patches (what an install maps; git-ignored)"
    echo "Tests it would run (pytest -m gpu tests/gpu, limit ${LIMIT_S} s):"
    list_tests "$ROOT"
    echo "$BY_CONSTRUCTION"
    exit 0
fi

if ! "$PY" tests/gpu/node.py check "$WHEELS" --site "$WORK/site"; then
    echo "gpu_check: the node is not ready (see above); nothing was run" >&2
    exit 2
fi
"$PY" tests/gpu/node.py install "$WHEELS" "$WORK/site"
if [[ ! -e "$PATCHES_LINK" ]]; then
    ln -s ../patches "$PATCHES_LINK"  # the checkout is used in place: `patches/` is megatron_tail.patches
    echo "gpu_check: linked $PATCHES_LINK -> ../patches"
fi
if [[ "$MODE" == prepare ]]; then
    echo "gpu_check: prepared; run with PYTHONPATH=$WORK/site:$ROOT HF_HUB_OFFLINE=1"
    exit 0
fi
RESULTS="$WORK/results.json"
rm -f "$RESULTS"
export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 MT_GPU_RESULTS="$RESULTS"
echo "-- pytest -m gpu tests/gpu (stopped after ${LIMIT_S} s)"
set +e
timeout --kill-after=20 "$LIMIT_S" "$PY" -m pytest -m gpu tests/gpu -p tests.gpu.results_plugin \
    -p no:cacheprovider -q -rfE
status=$?
set -e
STOPPED=()
[[ $status -eq 124 || $status -eq 137 ]] && STOPPED=(--stopped)
echo
echo "$BY_CONSTRUCTION"
echo
echo "== GPU check results"
"$PY" -m tests.gpu.table "$RESULTS" --limit-s "$LIMIT_S" ${STOPPED[@]+"${STOPPED[@]}"}
