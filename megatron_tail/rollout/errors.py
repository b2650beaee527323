"""The rollout client's errors: what a reply or a server did wrong, and whether another attempt may fix it
(`service.failures` classifies them)."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """Base class of rollout client errors."""


class MalformedResponseError(RolloutError):
    """A server answered 200 with a body that does not match the `/generate` contract. Not retried."""


class ResponseTooLargeError(MalformedResponseError):
    """A response body exceeded the client's `max_response_bytes`."""


class RequestRejectedError(RolloutError):
    """The server rejected the request (HTTP 4xx): retrying elsewhere would not help."""


class RetryableServerError(RolloutError):
    """A failure another attempt may fix: connection error, timeout, HTTP 5xx, aborted sample."""


class SampleAbortedError(RetryableServerError):
    """The server aborted a sample (`finish_reason.type == "abort"`, e.g. a weight-update pause)."""


class MissingRoutesError(MalformedResponseError):
    """Routes were requested and a finished sample came back without `meta_info.routed_experts`: the server
    was started without `--enable-return-routed-experts` (SGLang then ignores the request field). Not
    retried: every sample of that server would miss them."""
