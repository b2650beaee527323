"""Prompt data: local jsonl/parquet prompt sets (DAPO-Math-17k and DeepScaleR shapes), chat templates,
a deterministic prompt stream, the toy arithmetic task, and a character tokenizer for tiny CPU models."""

from megatron_tail.data.batches import PromptStream
from megatron_tail.data.char_tokenizer import build_char_tokenizer
from megatron_tail.data.prompts import (
    DAPO_MATH_FIELDS,
    DEEPSCALER_FIELDS,
    PromptDataConfig,
    PromptExample,
    load_prompts,
    read_records,
)
from megatron_tail.data.toy_arithmetic import make_arithmetic_examples

__all__ = [
    "DAPO_MATH_FIELDS",
    "DEEPSCALER_FIELDS",
    "PromptDataConfig",
    "PromptExample",
    "PromptStream",
    "build_char_tokenizer",
    "load_prompts",
    "make_arithmetic_examples",
    "read_records",
]
