"""The tail-mismatch experiment's base config (the naive arm); `examples/experiments/tail_mismatch.yaml` is
the same text (a test keeps them identical). The arms add their knobs (`tail_mismatch.ARMS`)."""

TAIL_CONFIG_YAML = r"""
# The tail-mismatch experiment (issue 14 §6): RL on a model whose next-token distributions have real tails.
# A tiny Qwen3 (hidden 64, 2 layers) over an 8192-id synthetic Zipf language (megatron_tail/experiments/
# zipf_language.py), pretrained on it; the task rewards the fraction of generated words in a fixed random
# quarter of the vocabulary, so RL must move mass onto target words across each distribution, tail included.
# Engine in bf16, trainer in fp32. This file is the naive arm (no DVP, no IS correction, no veto); the
# experiment adds one remedy per arm and runs 3 seeds each:
#   megatron-tail experiment tail-mismatch --out runs/tail_mismatch
# or one run by hand:
#   torchrun --standalone --nproc-per-node 2 -m megatron_tail.cli train \
#       examples/experiments/tail_mismatch.yaml --set model.hf_path=<dir> --set data.train_path=<jsonl>
run_dir: runs/tail_mismatch/naive/seed0
seed: 0
model:
  hf_path: ""               # set by the experiment (the pretrained tail model)
  precision: fp32           # trainer in fp32
  vocab_pad_multiple: 128   # 8192 ids: no padding
parallel:
  tensor_parallel: 2
rollout:
  engine: local
  max_new_tokens: 8
  local:
    dtype: bfloat16             # the engine in bf16: the training–inference mismatch under study
    num_threads: 1
  sampling:
    temperature: 1.0
algorithm:
  advantage_estimator: grpo
  group_size: 8
  log_rho: null             # DVP off
  is_mode: none             # no importance correction
  veto_threshold: 0.0       # no veto
optimizer:
  lr: 1.0e-3
  clip_grad: 1.0
data:
  train_path: ""            # set by the experiment (zipf_train.jsonl)
  eval_path: null
  apply_chat_template: false
  reward: megatron_tail.experiments.zipf_language:target_fraction_reward
  correct_reward: 0.5       # "correct": at least half of the words are targets
  prompts_per_step: 16
train:
  steps: 20
  micro_batch_size: 64
  eval_every: 0
  checkpoint_every: 20
  keep_checkpoints: 1
logging:
  progress: never
"""[1:]
