"""The loop benchmark's workload: a tiny random Qwen3 whose response length is driven by the prompt's
difficulty, the prompt mix, and the per-sample statistics of what an arm trained.

The model (`save_long_tail_model`) is random (hidden 64, 2 layers) except for three features built into its
weights, each read from the *current input token* so that no attention has to be constructed:
- a constant: coordinate 0 of every embedding is large, so after the final RMSNorm it is a near-constant
  feature whatever the context (the LM head's column 0 reads it: EOS and a few pinned rows);
- a mode: coordinate 1 of every embedding is +`MODE` for "hard" tokens (odd ids, and the hard marker) and
  −`MODE` for "easy" ones (even ids, and the easy marker); the LM head's column 1 is positive on hard rows
  and negative on easy rows (`STICK`), so the next token is of the current token's class with probability
  1 − ~e^-15: a response stays in the mode its first token was drawn in, and that is the mode of the
  prompt's last token;
- the end of sequence: the EOS row reads both columns, solved so that P(EOS) is `EASY_EOS_P` in easy mode
  and `HARD_EOS_P` (4× lower) in hard mode at every position (calibrated on random single-mode sequences).
Lengths are therefore geometric per mode, capped at `max_new_tokens`: easy prompts (ending with
`EASY_MARKER`) mean ≈ 1/`EASY_EOS_P`, hard ones (`HARD_MARKER`) ≈ 4× longer. Half the prompts are hard
(`write_prompt_mix`). A "hard sample" is one whose prompt ends with the hard marker.

Multi-turn (the agentic arm, `rollout.env.name: calculator`): `<tool_call>` is emitted with probability
`TOOL_CALL_P` per token in either mode; a turn with one is a (malformed) tool-call attempt, which the
calculator environment answers with an error observation, so the episode goes on to another turn. The newline
(the last token of every observation: `<|im_start|>assistant\\n`) and `<tool_call>` are neutral (coordinate 1
zero, coordinate 0 raised to keep the norm), so a turn after an observation, or the rest of a turn after a
call, draws its mode afresh (easy or hard, about half each). Pad, `<|im_start|>`, `<|im_end|>` and the newline
are never generated (their rows read the constant strongly negative): turns end at EOS only.
"""

from __future__ import annotations

import math
from pathlib import Path

LOOP_MODEL = dict(
    hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=640,
)  # fmt: skip
EASY_EOS_P = 0.04
"""P(EOS) at every position of an easy response (mean length ≈ 25)."""
HARD_EOS_P = 0.01
"""P(EOS) at every position of a hard response: 4× lower (mean ≈ 92 under a cap of 256)."""
TOOL_CALL_P = 0.01
"""P(`<tool_call>`) at every position, either mode (the agentic arm's turns call a tool now and then)."""
HARD_MARKER, EASY_MARKER = "?", "."
"""The last character of a hard / an easy prompt (after the arithmetic problem's "=")."""
CONSTANT = 50.0
"""Embedding coordinate 0 of every token."""
MODE = 20.0
"""|Embedding coordinate 1| of a hard / easy token."""
STICK = 3.0
"""|LM-head column 1| of a frequent hard / easy row (`FREQUENT` of each class); the other ("rare") rows of
the class have `STICK − 1`. With coordinate 1 ≈ ±3 after the final norm, a mode's frequent rows are
≈ 3 nats above its rare ones and the other mode's rows ≈ 15 nats below them."""
FREQUENT = 6
"""Frequent rows per mode: ≈ 2/3 of the mass on 6 tokens, ≈ 0.006 on each of the ~49 rare ones. EOS and
`<tool_call>` (≥ 0.01) then rank between the two, and Qwen3's truncation (top-k 20, then top-p 0.95 on
the renormalised rest) keeps them: top-k leaves 12 rare tokens below them (≈ 0.09 of the kept mass), more
than the 0.05 top-p cuts from the bottom."""
NEVER = -4.0
"""LM-head column 0 of the rows never generated: ≈ −30 nats."""


def tokenizer():
    from megatron_tail.data.char_tokenizer import build_char_tokenizer

    return build_char_tokenizer(tool_tokens=True)


def token_classes(tok) -> dict[str, list[int]]:
    """Token ids by role: "hard", "easy" (the two modes), "neutral" (newline, `<tool_call>`), "never"
    (never generated: pad, im_start, im_end, newline), "eos", "call" (`<tool_call>`)."""
    n = len(tok)
    ids = tok.convert_tokens_to_ids
    eos, newline, call = tok.eos_token_id, ids("\n"), ids("<tool_call>")
    hard_marker, easy_marker = ids(HARD_MARKER), ids(EASY_MARKER)
    specials = {tok.pad_token_id, eos, ids("<|im_start|>"), ids("<|im_end|>")}
    neutral = {newline, call}
    modal = [i for i in range(n) if i not in specials and i not in neutral]
    hard = sorted({i for i in modal if i % 2 == 1 and i != easy_marker} | {hard_marker})
    easy = sorted(set(modal) - set(hard))
    never = sorted((specials - {eos}) | {newline})
    return {
        "hard": hard,
        "easy": easy,
        "neutral": sorted(neutral),
        "never": never,
        "eos": [eos],
        "call": [call],
    }


def save_long_tail_model(path: Path, *, tool_calls: bool = False) -> None:
    """The benchmark's model (module docstring), seeded; nothing if `path` holds one already. `tool_calls`:
    `<tool_call>` has probability `TOOL_CALL_P` per token (the agentic arm's model); else it is never
    generated (a neutral token would redraw a single-turn response's mode)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from megatron_tail.demo.model import save_hf, tiny_qwen3_config

    if (path / "config.json").is_file():
        return
    tok = tokenizer()
    classes = token_classes(tok)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=len(tok), **LOOP_MODEL)).eval()
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    rows = {classes["eos"][0]: (EASY_EOS_P, HARD_EOS_P)}
    if tool_calls:
        rows[classes["call"][0]] = (TOOL_CALL_P, TOOL_CALL_P)
    with torch.no_grad():
        emb[:, 0], emb[:, 1] = CONSTANT, 0.0
        emb[classes["hard"], 1], emb[classes["easy"], 1] = MODE, -MODE
        emb[classes["neutral"], 0] = math.hypot(CONSTANT, MODE)  # the same norm as every other token
        head[:, :2] = 0.0
        for name, sign in (("hard", 1.0), ("easy", -1.0)):
            head[classes[name], 1] = sign * (STICK - 1.0)
            head[classes[name][:FREQUENT], 1] = sign * STICK
        head[classes["never"], 0] = NEVER
        if not tool_calls:
            head[classes["call"], 0] = NEVER
        for _ in range(3):  # each row's calibration moves the others' normaliser a little
            for row, probs in rows.items():
                _calibrate_row(model, classes, row, probs)
    save_hf(model, tok, path)


def _calibrate_row(model, classes: dict, row: int, probs: tuple[float, float]) -> None:
    """Set `row`'s LM-head columns 0 and 1 so that its probability is probs[0] on easy-mode sequences and
    probs[1] on hard-mode ones, on average over random sequences of each mode: the two means of the final
    hidden (f0, f1) and of the other rows' log-sum-exp give two linear equations."""
    import torch

    gen = torch.Generator().manual_seed(1)
    f, targets = [], []
    for mode, p in zip(("easy", "hard"), probs, strict=True):
        pool = torch.tensor(classes[mode])
        ids = pool[torch.randint(len(pool), (16, 48), generator=gen)]
        hidden = model.model(input_ids=ids).last_hidden_state[:, 8:]  # past the first few positions
        logits = model.lm_head(hidden)
        others = torch.cat([logits[..., :row], logits[..., row + 1 :]], dim=-1).logsumexp(-1)
        f.append([float(hidden[..., 0].mean()), float(hidden[..., 1].mean())])
        targets.append(math.log(p / (1 - p)) + float(others.mean()))
    w0, w1 = torch.linalg.solve(
        torch.tensor(f, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64)
    )
    model.lm_head.weight[row, 0], model.lm_head.weight[row, 1] = float(w0), float(w1)


def write_prompt_mix(path: Path, n: int = 256, seed: int = 0) -> None:
    """`n` arithmetic prompts, alternately easy and hard (the marker after the "=")."""
    from megatron_tail.data.toy_arithmetic import make_arithmetic_examples, write_jsonl

    rows = make_arithmetic_examples(n, seed=seed)
    for i, row in enumerate(rows):
        row["prompt"] += HARD_MARKER if i % 2 else EASY_MARKER
    write_jsonl(rows, path)


def record_trained_samples(out: list[list[tuple[bool, int]]]) -> None:
    """In an arm's process: wrap the loop's per-step `rollout_metrics(batch, ...)` (called once per step on
    the batch it trains) so that each step appends `[(hard prompt?, response tokens), ...]` to `out`."""
    from megatron_tail.train.run import loop

    hard = tokenizer().convert_tokens_to_ids(HARD_MARKER)
    original = getattr(loop, "rollout_metrics", None)
    if original is None:
        raise RuntimeError("train.run.loop no longer calls rollout_metrics: update bench.loop_model")

    def recording(batch, *args, **kwargs):
        out.append(
            [(p[-1] == hard, len(r)) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
        )
        return original(batch, *args, **kwargs)

    loop.rollout_metrics = recording


def length_stats(samples: list[tuple[bool, int]]) -> dict[str, float]:
    """Over the trained samples (hard?, length): the mean length of the longest decile (⌈n/10⌉ samples), the
    mean length, and the fraction from hard prompts."""
    if not samples:
        raise ValueError("no trained samples")
    lengths = sorted((n for _, n in samples), reverse=True)
    top = lengths[: math.ceil(len(lengths) / 10)]
    return {
        "length_top_decile_mean": sum(top) / len(top),
        "length_trained_mean": sum(lengths) / len(lengths),
        "hard_fraction": sum(h for h, _ in samples) / len(samples),
        "trained_samples": float(len(samples)),
    }
