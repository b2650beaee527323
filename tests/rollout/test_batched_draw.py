"""The local engine's batched categorical draw (`batcher.draw_categorical`) against float64 references."""

import torch

from megatron_tail.rollout.local_engine.batcher import draw_categorical


def test_the_batched_draw_gives_torch_multinomials_tokens_for_the_same_seeds():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 50, generator=g) * 3, -1)
    probs[:, ::7] = 0.0  # masked tokens (a processor's -inf)
    seeds = range(64)
    want = [
        int(torch.multinomial(probs[i], 1, generator=torch.Generator().manual_seed(s))[0])
        for i, s in enumerate(seeds)
    ]
    got = draw_categorical(probs, [torch.Generator().manual_seed(s) for s in seeds])
    assert got.tolist() == want
    assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_frequencies_follow_the_distribution_and_never_a_masked_token():
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.0, 0.05])
    n = 20_000
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens = draw_categorical(p.expand(n, -1).contiguous(), gens)
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert freq[1] == 0 and freq[4] == 0
    # 5 standard errors of a binomial proportion
    assert torch.all((freq - p.double()).abs() <= 5 * (p.double() * (1 - p.double()) / n).sqrt() + 1e-12)


def test_prefill_chunks_are_the_cheapest_cut_and_keep_every_row_once():
    import itertools
    from types import SimpleNamespace

    from megatron_tail.rollout.local_engine.batcher import prefill_chunks

    lengths = [12, 12, 13, 250, 12, 40, 44, 12, 251, 90]
    rows = [
        SimpleNamespace(item=SimpleNamespace(input_ids=[0] * 12), outputs=[1] * (n - 12)) for n in lengths
    ]

    def cost(chunks, forward):
        return sum(forward + len(c) * max(len(r.item.input_ids) + len(r.outputs) for r in c) for c in chunks)

    for forward in (0, 64, 256, 10_000):
        chunks = prefill_chunks(rows, forward_tokens=forward)
        assert sorted(id(r) for c in chunks for r in c) == sorted(id(r) for r in rows)
        # against every way to cut the sorted rows (2^9 of them)
        ordered = sorted(rows, key=lambda r: len(r.outputs))
        brute = min(
            cost([ordered[a:b] for a, b in itertools.pairwise([0, *cuts, len(ordered)])], forward)
            for k in range(len(ordered))
            for cuts in itertools.combinations(range(1, len(ordered)), k)
        )
        assert cost(chunks, forward) == brute
    # free forwards: one per distinct length; a costly forward: all rows in one
    assert len(prefill_chunks(rows, forward_tokens=0)) == len(set(lengths))
    assert len(prefill_chunks(rows, forward_tokens=10_000)) == 1


def test_waiting_rows_join_within_a_bounded_number_of_decoding_steps():
    from types import SimpleNamespace

    from megatron_tail.rollout.local_engine.batcher import ADMIT_WITHIN_STEPS, ContinuousBatcher

    batcher = SimpleNamespace(running=[object()] * 40, waiting=[object()], _waited_steps=0)
    decide = lambda: ContinuousBatcher._prefill_now(batcher)  # noqa: E731
    # one row against 40 running: it waits (its prefill would cost a forward for one row) ...
    waits = 0
    while not decide():
        batcher._waited_steps += 1
        waits += 1
    assert waits == ADMIT_WITHIN_STEPS
    # ... a quarter of the batch, or an empty batch, is admitted at once
    batcher._waited_steps = 0
    batcher.waiting = [object()] * 10
    assert decide()
    batcher.running, batcher.waiting = [], [object()]
    assert decide()
