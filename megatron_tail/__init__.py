"""megatron_tail: token-level stable RL post-training on megatron-core + SGLang (DVP, STAPO, AR/Lopti)."""

__version__ = "0.1.0"
