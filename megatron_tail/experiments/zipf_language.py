"""A synthetic language with a real long tail, for the tail-mismatch experiment.

Words `w0 … w{N−1}` (N = `ZipfLanguage.num_words`, 8190 by default: with PAD and EOS the vocabulary is
8192 ids). Each word belongs to one of `num_clusters` clusters; the next word is drawn from its cluster's
Zipf distribution (exponent `zipf_exponent`) over a cluster-specific random permutation of all words. So
every context has a few likely continuations and thousands of unlikely ones, like an LLM's next-token
distribution, and a model with a small hidden size can represent it exactly (one logit row per cluster).

The RL task: continue a prompt of the language; the reward is the fraction of generated words that lie in a
fixed random `TARGET_FRACTION` of the vocabulary (`target_fraction_reward`). The pretrained model is
indifferent to the target set (reward ≈ `TARGET_FRACTION` at the start), so RL has to move probability mass
onto target words across each distribution, head and tail alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import torch

PAD, EOS = "<|pad|>", "<|endoftext|>"
TARGET_FRACTION = 0.25
TARGET_SEED = 4242
"""The target set is the same for every experiment (it defines the task, not a run)."""
_WORD = re.compile(r"\bw(\d+)\b")


@dataclass(frozen=True)
class ZipfLanguage:
    num_words: int = 8190
    num_clusters: int = 32
    zipf_exponent: float = 1.1
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        """PAD (id 0), EOS (id 1), then the words (word k = id k + 2)."""
        return self.num_words + 2

    @cached_property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[num_words]` int64 cluster of each word, `[num_clusters, num_words]` float64 next-word probs and
        their cumulative sums (for sampling)."""
        g = torch.Generator().manual_seed(self.seed)
        cluster = torch.randint(0, self.num_clusters, (self.num_words,), generator=g)
        probs = torch.empty(self.num_clusters, self.num_words, dtype=torch.float64)
        for c in range(self.num_clusters):
            probs[c, torch.randperm(self.num_words, generator=g)] = self.zipf_probs()
        return cluster, probs, probs.cumsum(dim=1)

    def zipf_probs(self) -> torch.Tensor:
        """`[num_words]` float64: the Zipf law by rank, p_r ∝ r^(−s). Every context's distribution is a
        permutation of it."""
        ranks = torch.arange(1, self.num_words + 1, dtype=torch.float64)
        zipf = ranks.pow(-self.zipf_exponent)
        return zipf / zipf.sum()

    def entropy(self) -> float:
        """The language's conditional entropy per word (nats): the best achievable next-word NLL."""
        p = self.zipf_probs()
        return float(-(p * p.log()).sum())

    def next_word_probs(self, word: int) -> torch.Tensor:
        """`[num_words]` float64: the true distribution of the word after `word`."""
        cluster, probs, _ = self._tables
        return probs[cluster[word]]

    def sample(self, num_sequences: int, length: int, seed: int) -> torch.Tensor:
        """`[num_sequences, length]` int64 word indices (not token ids): a first word from the stationary
        mix of the clusters' laws, then the chain (inverse-CDF sampling, one cluster at a time)."""
        cluster, probs, cdf = self._tables
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(num_sequences, length, dtype=torch.long)
        out[:, 0] = torch.multinomial(probs.mean(dim=0), num_sequences, replacement=True, generator=g)
        last = self.num_words - 1
        for t in range(1, length):
            u = torch.rand(num_sequences, generator=g, dtype=torch.float64)
            of = cluster[out[:, t - 1]]
            for c in range(self.num_clusters):
                rows = of == c
                out[rows, t] = torch.searchsorted(cdf[c], u[rows]).clamp_(max=last)
        return out

    def text(self, words: torch.Tensor | list[int]) -> str:
        return " ".join(f"w{int(w)}" for w in words)

    def tokenizer(self, save_dir: str | Path | None = None):
        """A word-level `PreTrainedTokenizerFast`: one id per word, split on whitespace, decoded with
        spaces; PAD = 0, EOS = 1."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {PAD: 0, EOS: 1, **{f"w{k}": k + 2 for k in range(self.num_words)}}
        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
        core.add_special_tokens([PAD, EOS])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS)
        if save_dir is not None:
            tokenizer.save_pretrained(str(save_dir))
        return tokenizer


@lru_cache(maxsize=8)
def target_words(num_words: int) -> frozenset[int]:
    """The task's target set: a fixed random `TARGET_FRACTION` of the words."""
    g = torch.Generator().manual_seed(TARGET_SEED)
    count = round(TARGET_FRACTION * num_words)
    return frozenset(torch.randperm(num_words, generator=g)[:count].tolist())


def target_fraction_reward(completion: str, answer: str) -> float:
    """Fraction of the completion's words in the target set of a `answer`-word language (0 for no words).

    `answer` holds the language's word count (the prompt files write it), so the reward needs no state.
    """
    num_words = int(answer)
    words = [int(m) for m in _WORD.findall(completion)]
    words = [w for w in words if w < num_words]
    if not words:
        return 0.0
    targets = target_words(num_words)
    return sum(w in targets for w in words) / len(words)


target_fraction_reward.reward_range = (0.0, 1.0)
