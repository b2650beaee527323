"""A user reward used by the plug-in test: 1 if the completion ends with the answer."""


def ends_with_answer(completion: str, answer: str) -> float:
    return float(completion.rstrip().endswith(answer))


NOT_CALLABLE = 3
