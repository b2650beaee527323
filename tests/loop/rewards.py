"""A reward for loop tests: a random tiny model scores varied rewards on it, so advantages are non-zero."""


def digit_fraction(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    """Fraction of the completion's characters that are digits (0 for an empty completion)."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0


digit_fraction.reward_range = (0.0, 1.0)  # DVP's bias bound reads R_max from here


def has_digit(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    """1 if the completion contains a digit, else 0: a binary reward, so some groups get equal rewards (what
    dynamic sampling filters) and others do not."""
    return float(any(c.isdigit() for c in completion))


has_digit.reward_range = (0.0, 1.0)


def always_zero(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    """0 for everything: every group has equal rewards (dynamic sampling keeps none)."""
    return 0.0


always_zero.reward_range = (0.0, 1.0)


def hangs(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    """Never returns (a reward stuck on a lock or a network call): the run names it after its time limit."""
    import time

    while True:
        time.sleep(60)
