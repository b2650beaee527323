"""The demo's embedded default config (`megatron-tail demo` needs no file); `examples/demo/demo.yaml` is the
same text (a test keeps them identical), for running the demo config by hand."""

DEMO_CONFIG_YAML = r"""
# The CPU demo: RL on toy addition ("12+34=" → "46") from a tiny pretrained Qwen3 that often rambles past
# its answer (see megatron_tail/demo/pretrain.py); RL on the exact-match reward teaches it to stop.
# `megatron-tail demo` fills in model.hf_path and the data paths (its cache directory) and runs this
# with torchrun at TP = 2 over gloo; the local engine samples in bf16, the trainer computes in fp32.
# Run it yourself with:
#   torchrun --standalone --nproc-per-node 2 -m megatron_tail.cli train examples/demo/demo.yaml \
#       --set model.hf_path=<dir> --set data.train_path=<jsonl> --set data.eval_path=<jsonl>
run_dir: runs/demo
seed: 1234
model:
  hf_path: ""               # set by `megatron-tail demo` (the pretrained tiny Qwen3)
  precision: fp32           # trainer in fp32
  vocab_pad_multiple: 128   # vocab 100 → 128 rows: 64 per TP rank
parallel:
  tensor_parallel: 2
rollout:
  engine: local
  max_new_tokens: 6
  local:
    dtype: bfloat16             # the engine in bf16: a real training–inference mismatch
    num_threads: 1
  sampling:
    temperature: 1.0
algorithm:
  advantage_estimator: grpo
  group_size: 8
  log_rho: -13.0            # DVP on
  is_mode: mis              # MIS with the sequence veto
  veto_threshold: 1.0e-4
optimizer:
  lr: 1.0e-4
  clip_grad: 1.0
data:
  train_path: ""            # set by `megatron-tail demo` (toy_arithmetic_train.jsonl)
  eval_path: null           # set by `megatron-tail demo`
  apply_chat_template: false
  reward: arithmetic
  prompts_per_step: 32
  eval_prompts: 200
train:
  steps: 60
  max_tokens_per_micro_batch: 1024  # THD: samples packed back to back, ≤ 1024 tokens per micro-batch
  eval_every: 10
  checkpoint_every: 10
  keep_checkpoints: 1
logging:
  progress: auto
"""[1:]

PRETRAIN_DIR_NAME = "tiny_qwen3_arith"
DATA_DIR_NAME = "data"
