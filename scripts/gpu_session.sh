#!/usr/bin/env bash
# Issue 51's GPU measurements, prepared for a lent GPU's few minutes: two calls of under 600 s each, every
# table teed into OUT (the device tool's $OUT, or .gpu_session here), so a call stopped at its limit still
# brings back what it printed.
#
#   scripts/gpu_session.sh benches [--dry-run]   the op report (bench.op --device cuda: the op against Liger's
#       CE at every TP shard width, the TP = 1 forward's designs and where their time goes, the fused output
#       layer, the targets), then bench.step at the Qwen3-1.7B shape with --recompute selective, unfused and
#       fused; both steps' peaks recorded into OUT/measured_peaks.json (a copy of the planner's file: only
#       OUT comes back)
#   scripts/gpu_session.sh check [--dry-run]     scripts/gpu_check.sh (its tests, its table), results in OUT
#
# First, where the registry is reachable: `make gpu-wheels` (GPU_PYTHON_VERSION: the node's Python, 3.12 on
# the lent H200s), and carry wheels/gpu_check with the checkout. Environment: MT_PYTHON (python3), OUT,
# MT_GPU_LIMIT_S (gpu_check's pytest limit, 400 here: 155 s on an H200), MT_COMMIT (the commit the peaks are
# recorded under: `MT_COMMIT=<this checkout's short HEAD> scripts/gpu_session.sh …`, the hash written into
# the command where it is composed, as the device tool's copy of the tree may sit on an older git HEAD).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${MT_PYTHON:-python3}"
OUT="${OUT:-$ROOT/.gpu_session}"
PART="${1:-}"
DRY=""
case "${2:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    *) echo "gpu_session: unknown argument '$2' after '$PART' (only --dry-run; see --help)" >&2; exit 2 ;;
esac
[[ $# -le 2 ]] || { echo "gpu_session: too many arguments (see --help)" >&2; exit 2; }
case "$PART" in
    benches|check) ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_session: say which part: benches or check (see --help)" >&2; exit 2 ;;
esac

cd "$ROOT"
run() {  # one step: its command line first, then its output teed into OUT/<name>.txt, under `timeout`
    local name="$1" limit="$2"
    shift 2
    echo "== $name (at most ${limit} s): $*"
    [[ -n "$DRY" ]] && return 0
    set +e
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local status="${PIPESTATUS[0]}"
    set -e
    echo "== $name: exit $status"
}

[[ -n "$DRY" ]] || mkdir -p "$OUT"
if [[ "$PART" == check ]]; then
    run gpu_check 560 env MT_GPU_LIMIT_S="${MT_GPU_LIMIT_S:-400}" bash scripts/gpu_check.sh
    [[ -n "$DRY" ]] || cp -f .gpu_check/results.json "$OUT/" 2>/dev/null || true
    exit 0
fi

[[ -n "$DRY" ]] || bash scripts/gpu_check.sh --prepare
export PYTHONPATH="$ROOT/.gpu_check/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
RECORD="$OUT/measured_peaks.json"
[[ -n "$DRY" ]] || cp -f megatron_tail/plan/measured_peaks.json "$RECORD"
run bench_op 240 "$PY" -m megatron_tail.bench.op --device cuda
run bench_step 150 "$PY" -m megatron_tail.bench.step --device cuda --recompute selective --record "$RECORD"
run bench_step_fused 150 "$PY" -m megatron_tail.bench.step --device cuda --recompute selective \
    --fused-output-layer --record "$RECORD"
[[ -n "$DRY" ]] || echo "${MT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" > "$OUT/commit.txt" || true
