"""The CPU demo: a tiny Qwen3 on a toy verifiable task (multi-digit addition), pretrained by a reproducible
script so RL starts from non-zero accuracy, then RL with the local bf16 engine and an fp32 TP=2 trainer."""
