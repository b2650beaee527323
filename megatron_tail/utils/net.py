"""Small networking helpers."""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free right now (the OS picks it; another process may take it later:
    only for a port bound at once, such as torch's `MASTER_PORT`; else `reserve_port`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a port the OS picks; "": every interface, IPv6 and IPv4 where
    the host has IPv6, as torch's TCPStore binds). The port is held from now on, so a server that starts
    listening only after seconds of loading (`serve-local --listen-fd`, a TCPStore given it as
    `master_listen_fd`) cannot lose it to another process meanwhile, as it can after `free_port`. OSError
    (EADDRINUSE) when the port is taken.

    A port the OS picks is bound, not listened on: connections are refused until its server listens, and
    no other socket binds it (the OS skips it for `bind(0)` and outgoing connections; SO_REUSEADDR is left
    off, which would let another such socket share it until one listens; `listen_on` sets it then).

    A given port is bound with SO_REUSEADDR, as servers bind theirs, so that a restarted run takes it at
    once although the last run's connections linger in TIME_WAIT; and it is listened on at once, since a
    socket with SO_REUSEADDR keeps others with it off only while it listens. Connections then wait in its
    backlog (a probe times out rather than being refused) until the server accepts."""
    given = port != 0
    if host == "" and socket.has_ipv6:
        try:
            return _held(socket.AF_INET6, ("::", port), given, dual_stack=True)
        except OSError as e:
            if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            # no IPv6 on this host after all: IPv4's every interface
    return _held(socket.AF_INET6 if ":" in host else socket.AF_INET, (host or "0.0.0.0", port), given)


def reserve_named_port(key: str, host: str, port: int | None) -> socket.socket:
    """`reserve_port(host, port or 0)`, with a `UserError` naming `key` (the setting or flag that chose the
    port) when the port is taken or `host` cannot be bound (an address not on this host, a name that does not
    resolve): said at once, not after a model has loaded."""
    from megatron_tail.utils.errors import UserError

    try:
        return reserve_port(host, port or 0)
    except OSError as e:
        where = f"on {host}" if host else "on this host"
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"{key}: port {port} is in use {where}; choose another") from None
        what = f"port {port}" if port else "a free port"
        raise UserError(f"{key}: cannot bind {what} {where} ({e.strerror})") from None


def listen_on(sock: socket.socket) -> socket.socket:
    """`sock` (from `reserve_port`), with SO_REUSEADDR set as a server is about to listen on it: the TIME_WAIT
    its connections leave must not keep the next run off a port given by the user."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def _held(family: int, address: tuple, given: bool, dual_stack: bool = False) -> socket.socket:
    s = socket.socket(family)
    try:
        if dual_stack:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        if given:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)
        if given:
            s.listen()
    except OSError:
        s.close()
        raise
    return s


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
    last = parsed.path.rstrip("/").rsplit("/", 1)[-1]
    if last in ENDPOINTS:
        return (
            f"it ends in /{last}, an endpoint (give the server's base URL: /generate etc. are appended to it)"
        )
    return None


ENDPOINTS = frozenset(
    {"generate", "health", "health_generate", "v1", "model_info", "get_model_info", "server_info",
     "get_server_info", "flush_cache", "update_weights_from_disk", "update_weights_from_distributed",
     "init_weights_update_group", "pause_generation", "continue_generation", "abort_request"}
)  # fmt: skip
"""The SGLang server endpoints (`srt/entrypoints/http_server.py`) the client appends to a base URL: a URL
ending in one is a copied endpoint, not a base (nothing is served under `/generate/...`)."""


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
