"""A user reward used by the plug-in test: 1 if the completion ends with the answer."""


def ends_with_answer(completion: str, answer: str) -> float:
    return float(completion.rstrip().endswith(answer))


NOT_CALLABLE = 3


def one_argument(completion: str) -> float:
    """A reward of the wrong shape: the run calls `fn(completion, answer)`."""
    return float(bool(completion))


def out_of_range(completion: str, answer: str) -> float:  # noqa: ARG001
    return 5.0


out_of_range.reward_range = (0.0, 1.0)


def badly_declared(completion: str, answer: str) -> float:  # noqa: ARG001
    return 0.0


badly_declared.reward_range = (1.0,)


class AClass:
    """A reward written as a class: calling it makes an instance, not a reward (refused at load)."""

    def __init__(self, completion: str, answer: str):
        self.completion, self.answer = completion, answer
