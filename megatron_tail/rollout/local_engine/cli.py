"""`megatron-tail serve-local`: run the local engine as an HTTP server (SGLang's `/generate` subset)."""

from __future__ import annotations

import argparse
import logging
import math
import re

from megatron_tail.rollout.local_engine.sglang_defaults import (
    DEFAULT_SAMPLING_MASK_MAX_TOKENS,
    SAMPLING_BACKENDS,
)
from megatron_tail.utils.errors import UserError

DEFAULT_HOST = "127.0.0.1"


def add_serve_local_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve-local",
        help="serve a local HF model on CPU with SGLang's /generate and weight-update endpoints",
        description=__doc__,
    )
    parser.add_argument(
        "--model-path", required=True, help="directory with config.json, *.safetensors, tokenizer"
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this host only)"
    )
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="listen on this inherited socket, already bound to --host:--port, instead of binding it itself "
        "(how a trainer starts it; either way the port is held while the model loads)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "fp8", "fp8_tensor", "nvfp4_a16"],
        help="fp8: linear layers in e4m3 with per-channel weight and per-token activation scales, as "
        "SGLang's --quantization fp8; fp8_tensor: per-tensor scales; nvfp4_a16: NVFP4 weights, bf16 "
        "activations (default none)",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"], help="as SGLang's (default auto)"
    )
    parser.add_argument(
        "--logit-noise",
        type=float,
        default=0.0,
        help="SYNTHETIC: σ of Gaussian noise on the logits, scaled by (1 − p) (default 0: off)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of the model, e.g. cuda:0 (default cpu; sampling stays on CPU)",
    )
    parser.add_argument("--weight-version", default="default", help="initial weight_version (as SGLang's)")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--max-batch", type=int, default=1024, help="most samples accepted in one /generate")
    parser.add_argument(
        "--sampling-mask-max-tokens",
        type=int,
        default=DEFAULT_SAMPLING_MASK_MAX_TOKENS,
        help="SGLang's flag: most token ids in a returned sampling mask; a return_sampling_mask request "
        f"needs top_k ≤ this (default {DEFAULT_SAMPLING_MASK_MAX_TOKENS}, SGLang's)",
    )
    parser.add_argument(
        "--sampling-backend",
        default="flashinfer",
        choices=SAMPLING_BACKENDS,
        help="which SGLang sampler's truncation to follow: flashinfer (SGLang's CUDA default; with min_p > 0 "
        "anywhere in a batch, top-p is measured after top-k's renormalisation) or pytorch (what "
        "--enable-deterministic-inference forces; top-p on the full distribution) (default flashinfer)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="SGLang's flag: record an MoE model's routed experts per token and layer and return them when a "
        "request sets return_routed_experts (without it such requests get no routes, as with SGLang)",
    )
    parser.add_argument(
        "--enable-custom-logit-processor",
        action="store_true",
        help="SGLang's flag: run any custom_logit_processor a request sends (its pickled class is loaded and "
        "run: code from whoever reaches the port); without it only megatron_tail's DVP processor, loaded "
        "without running anything else",
    )
    parser.set_defaults(func=serve_local)
    return parser


def serve_local(args: argparse.Namespace) -> int:
    from megatron_tail.utils.parent_watch import die_with_parent_from_env
    from megatron_tail.utils.start_up import collector_paused

    die_with_parent_from_env()  # started by a trainer: never outlive it (not even its kill -9)
    check_serve_args(args)
    with collector_paused():  # the imports and the model the process serves for its life
        import torch
        from aiohttp import web

        from megatron_tail.model.directory import check_model_dir
        from megatron_tail.rollout.http_session import api_key
        from megatron_tail.rollout.launch import http_url
        from megatron_tail.rollout.local_engine.server import build_app
        from megatron_tail.utils.net import listen_on, reserve_named_port

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {args.device} needs CUDA, and this machine has none; use --device cpu")
        check_model_dir(args.model_path, key="--model-path")  # first: a cheaper mistake to name
        # a taken port (or a host not bound) is said now, not after minutes of loading; held while it loads
        if args.listen_fd is None:
            sock = reserve_named_port(f"--host {args.host} --port {args.port}", args.host, args.port)
        else:
            sock = _inherited_socket(args)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        app = build_app(make_engine(args), max_batch=args.max_batch, api_key=api_key())
    keyed = " (requests need the API key: MT_ROLLOUT_API_KEY)" if api_key() is not None else ""
    print(
        f"megatron-tail local engine serving {args.model_path} on {http_url(args.host, args.port)}{keyed}",
        flush=True,
    )
    # aiohttp's SockSite: `loop.create_server(sock=...)` listens on the socket as bound
    sock.set_inheritable(False)  # a process the engine starts must not keep its port
    web.run_app(app, sock=listen_on(sock), print=None, access_log=None)
    return 0


def check_serve_args(args: argparse.Namespace) -> None:
    """UserError naming the flag, before torch is imported or the model loaded (`LocalEngine` and torch
    refuse these too, with a traceback)."""
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535; got {args.port}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UserError(f"--device must be cpu, cuda or cuda:N; got {args.device!r}")
    if not 0 <= args.logit_noise < math.inf:
        raise UserError(f"--logit-noise must be a finite number ≥ 0 (0: off); got {args.logit_noise}")
    for flag in ("num_threads", "max_batch", "sampling_mask_max_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be ≥ 1; got {value}")


def make_engine(args: argparse.Namespace):
    """The `LocalEngine` of `serve-local`'s arguments (its model loaded): what the server process serves, and
    what `in_process.LocalEngineThread` serves in the trainer's process."""
    from megatron_tail.model.directory import check_model_dir
    from megatron_tail.rollout.local_engine.engine import LocalEngine

    check_model_dir(args.model_path, key="--model-path")  # one named error, not a Hugging Face one

    return LocalEngine(
        args.model_path,
        dtype=args.dtype,
        weight_version=args.weight_version,
        quantization=args.quantization,
        device=args.device,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        logit_noise=args.logit_noise,
        sampling_backend=args.sampling_backend,
        enable_return_routed_experts=args.enable_return_routed_experts,
        enable_custom_logit_processor=args.enable_custom_logit_processor,
    )


def parse_serve_local(argv: list[str]) -> argparse.Namespace:
    """`serve-local`'s arguments `argv` (after `serve-local`) as its parser reads them, defaults included."""
    return add_serve_local_parser(argparse.ArgumentParser().add_subparsers()).parse_args(argv)


def _inherited_socket(args: argparse.Namespace):
    """The socket of `--listen-fd`; SystemExit naming it when it is not a socket bound to `--port`."""
    import socket

    try:
        sock = socket.socket(fileno=args.listen_fd)
        port = sock.getsockname()[1]
    except OSError as e:
        raise SystemExit(f"--listen-fd {args.listen_fd} is not an open socket ({e})") from None
    if port != args.port:
        raise SystemExit(f"--listen-fd {args.listen_fd} is bound to port {port}, not --port {args.port}")
    return sock
