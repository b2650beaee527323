#!/bin/bash
# setup_envs.sh - the two Python environments a GPU cluster run needs, each with its own pins:
#   .venv         the trainer (`megatron-tail train`, slurm/rl.sbatch's MT_PYTHON): megatron_tail, megatron-core,
#                 Transformer Engine, on torch from the CUDA wheel index        pins: constraints-gpu.txt
#   .venv-sglang  the rollout servers and router (MT_SGLANG_PYTHON): SGLang with its own torch and
#                 transformers, plus megatron_tail without its dependencies (the DVP logit processor
#                 and slurm/mt_slurm.py import it)                             pins: constraints-sglang.txt
#
#   bash scripts/setup_envs.sh            (or: make cluster-envs) from the repository root, on a node with
#                                         the cluster's CUDA driver; rl.sbatch finds both environments
# Environment: PYTHON [python3], MT_TORCH_INDEX [https://download.pytorch.org/whl/cu128],
#              MT_TRAINER_VENV [.venv], MT_SGLANG_VENV [.venv-sglang], MT_WITH_TE [1]
# NVIDIA apex is not on PyPI (the PyPI "apex" is another project) and is optional: megatron-core falls back
# to torch's norms and Adam. To build it, see https://github.com/NVIDIA/apex#from-source.
set -euo pipefail

PYTHON=${PYTHON:-python3}
TORCH_INDEX=${MT_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
TRAINER=${MT_TRAINER_VENV:-.venv}
SGLANG=${MT_SGLANG_VENV:-.venv-sglang}
if [ ! -f pyproject.toml ] || [ ! -f constraints-gpu.txt ]; then
  echo "run from the repository root" >&2
  exit 1
fi

echo "== trainer environment: $TRAINER"
"$PYTHON" -m venv "$TRAINER"
"$TRAINER/bin/python" -m pip install -q --upgrade pip
"$TRAINER/bin/python" -m pip install -q -c constraints-gpu.txt --index-url "$TORCH_INDEX" torch
"$TRAINER/bin/python" -m pip install -q -c constraints-gpu.txt -e '.[test]'
if [ "${MT_WITH_TE:-1}" = 1 ]; then
  # Transformer Engine builds against the installed torch; no build isolation so it sees it.
  "$TRAINER/bin/python" -m pip install -q -c constraints-gpu.txt --no-build-isolation '.[gpu]'
fi

echo "== SGLang environment: $SGLANG"
"$PYTHON" -m venv "$SGLANG"
"$SGLANG/bin/python" -m pip install -q --upgrade pip
"$SGLANG/bin/python" -m pip install -q -c constraints-sglang.txt 'sglang==0.5.23' sglang-router
"$SGLANG/bin/python" -m pip install -q -c constraints-sglang.txt --no-deps -e .
"$SGLANG/bin/python" -m pip install -q -c constraints-sglang.txt dill pyyaml

echo "== done: MT_PYTHON=$TRAINER/bin/python, MT_SGLANG_PYTHON=$SGLANG/bin/python (rl.sbatch finds both)"
