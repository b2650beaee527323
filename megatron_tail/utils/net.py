"""Small networking helpers."""

from __future__ import annotations

import socket
from collections.abc import Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free right now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def base_url_problem(url: object) -> str | None:
    """What makes `url` unusable as an engine's base URL, `http(s)://HOST[:PORT][/PREFIX]` (the client appends
    `/generate` etc. to it), e.g. "its port is not an integer"; None when it is usable. Parsed as aiohttp
    parses it (`yarl`), so a URL that passes never fails in the client as `aiohttp.InvalidURL`."""
    import yarl

    if not isinstance(url, str):
        return "it is not a string"
    if any(c.isspace() for c in url):
        return "it contains whitespace"
    if "?" in url or "#" in url:
        return "it has a query or fragment (paths such as /generate are appended to it)"
    try:
        parsed = yarl.URL(url)
    except ValueError as e:  # a port that is no integer or out of range, a broken IPv6 literal, ...
        return f"it does not parse ({e})"
    if parsed.scheme not in ("http", "https"):
        return "it is not an http:// or https:// URL"
    if not parsed.host:
        return "it names no host"
    if parsed.explicit_port == 0:
        return "its port is 0"
    return None


def base_urls(server_urls: str | Sequence[str]) -> list[str]:
    """`server_urls` (one URL or several) without trailing slashes; ValueError naming each unusable one
    (`base_url_problem`) and any URL given twice, or when there is none."""
    urls = [u.rstrip("/") for u in ([server_urls] if isinstance(server_urls, str) else server_urls)]
    bad = [f"{u!r}: {why}" for u in urls if (why := base_url_problem(u)) is not None]
    if not urls or bad or len(set(urls)) != len(urls):
        raise ValueError(
            f"server_urls must be distinct, non-empty http(s) base URLs; got {list(urls)!r}"
            + "".join(f"; {b}" for b in bad)
        )
    return urls
