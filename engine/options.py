"""The engine options every entry point shares (`python -m telemetry`, `python -m tui`, each lab).

Defined once here: ``add_engine_args`` adds them to a parser, ``parse_checked`` parses and checks
them before anything is loaded, ``build_llm`` turns them into an ``LLM``. Entry points pass their own
defaults (the dashboard wants a small pool so that every mechanism shows quickly; the bench wants
the real thing). A usage error ends any entry point the same way: one line, ``error: ...``, on
stderr and exit status 2, as argparse's own errors do; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from engine.config import (
    BATCHING,
    DTYPES,
    OFFLOADING_POLICIES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    Config,
    ConfigError,
)
from models.errors import CheckpointError

N = TypeVar("N", int, float)
PRESETS = ("tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")


def add_engine_args(parser: argparse.ArgumentParser, **defaults) -> None:
    """Add the shared engine options; ``defaults`` overrides any option's default by its dest name."""
    g = parser.add_argument_group("engine")
    source = g.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="DIR", help="a Hugging Face-layout Qwen3 checkpoint directory")
    source.add_argument("--preset", choices=PRESETS, default="tiny",
                        help="a random-weight checkpoint, made on first use under $GLASSBOX_CACHE "
                             "(default ~/.cache/glassbox/checkpoints/NAME) (default: %(default)s)")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: CUDA when present, else CPU")
    g.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="weights and KV: auto is the checkpoint's on CUDA, float32 on the CPU (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seeds the checkpoint, the workload and sampling (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=256, help="KV block size in tokens, a power of two >= 16 (default: %(default)s)")
    g.add_argument("--num-blocks", type=int, default=-1, help="KV pool size in blocks; -1 sizes it from memory (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=512, help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=16384, help="token budget of one step (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + output (default: %(default)s)")
    g.add_argument("--max-waiting-requests", type=_count_or_none, default=None, metavar="N",
                   help="refuse new requests while N wait (queue_full); 'none' for no limit (default: %(default)s)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks to shard the model over: GPUs on CUDA, processes on the CPU (default: %(default)s)")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="tensor parallelism on CUDA: NCCL's all-reduce instead of the one-shot one fused into the norm")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens before scheduling the next (no host/GPU overlap)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    tier = g.add_mutually_exclusive_group()
    tier.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                      help="a host KV tier of this many GiB (pinned memory on CUDA); 0: none (default: %(default)s)")
    tier.add_argument("--num-host-kvcache-blocks", type=int, default=0, metavar="N",
                      help="a host KV tier of exactly N blocks (default: none)")
    g.add_argument("--kv-offloading-policy", choices=OFFLOADING_POLICIES, default="write-through",
                   help="when blocks are copied to the host tier: as they fill (write-through) or as the GPU "
                        "evicts them (write-back) (default: %(default)s)")
    g.add_argument("--enable-cpu-offload", action="store_true",
                   help="keep every KV block in host memory (sized by --kv-offloading-size or "
                        "--num-host-kvcache-blocks) and stream it through a GPU ring of --num-blocks slots: "
                        "contexts larger than the GPU's KV memory, one request computed per step")
    g.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute",
                   help="what a preempted request's K/V becomes: recomputed later, or swapped to the host "
                        "tier (default: %(default)s)")
    g.add_argument("--batching", choices=BATCHING, default="prefill-first",
                   help="how a step is filled: prefill first, decode only when nothing can be prefilled "
                        "(nano-vllm's), or mixed: running requests first, then chunked prefills from the "
                        "budget left (vLLM V1's) (default: %(default)s)")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="the order of the waiting queue and of preemption victims: first come first served, "
                        "priority (lower first, as vLLM's) or lpm (longest prefix-cache match first, as "
                        "SGLang's) (default: %(default)s)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="mixed batching: at most N tokens of a step for one prompt's chunk; 0: no cap "
                        "(default: %(default)s)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its message")
    parser.set_defaults(**defaults)


def checked_number(text: str, kind: Callable[[str], N], ok: Callable[[N], bool], expected: str) -> N:
    """An argparse type's body: ``text`` as ``kind`` where ``ok`` holds it, else argparse's error
    saying what was ``expected``."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a lab's sizes and counts)."""
    return checked_number(text, int, lambda v: v >= 1, "a whole number >= 1")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return checked_number(text, float, lambda v: 0 < v < math.inf, "a number > 0")


def _count_or_none(text: str) -> int | None:
    if text.lower() == "none":
        return None
    return checked_number(text, int, lambda v: v >= 1, "a whole number >= 1 or 'none'")


def add_workload_args(parser: argparse.ArgumentParser, workload: str = "mixed", rate: float | None = None,
                      duration: float | None = None) -> None:
    from engine.workloads import WORKLOADS

    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=list(WORKLOADS), default=workload, help="default: %(default)s")
    g.add_argument("--rate", type=float, default=rate, help="arrivals per second (default: the workload's own)")
    g.add_argument("--duration", type=float, default=duration, metavar="SECONDS",
                   help="stop after this long" + (" (default: %(default)s)" if duration else " (default: run until interrupted)"))


class OptionError(ValueError):
    """An option (or a combination of them) that cannot work; the message names it and what would."""


def option_error(exc: OSError | ValueError) -> OptionError:
    """An error from opening what an option names (a port, a file, an endpoint), as an ``OptionError``
    with the same text, less the "[Errno N]" that an ``OSError`` puts first."""
    return OptionError(getattr(exc, "strerror", None) or str(exc))


# What the user can fix: reported in one line. Anything else is a bug and keeps its traceback.
USAGE_ERRORS = (OptionError, ConfigError, CheckpointError)

# Config fields whose option is not named after them.
_RENAMED = {"kvcache_block_size": "--block-size", "num_kvcache_blocks": "--num-blocks"}
# Options (by dest) that must be positive wherever an entry point defines them.
_POSITIVE = ("rate", "duration", "interval", "speed", "num_requests", "ab_runs")


@contextmanager
def reported_errors(args: argparse.Namespace) -> Iterator[None]:
    """A usage error raised inside ends the program: ``error: ...`` on stderr, exit status 2
    (``SystemExit``, like argparse). Under ``--debug`` it propagates with its traceback."""
    try:
        yield
    except USAGE_ERRORS as exc:
        if args.debug:
            raise
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)
        raise SystemExit(2) from None


def parse_checked(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, then check everything that can be checked before a model is made or loaded."""
    args = parser.parse_args(argv)
    with reported_errors(args):
        check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Raise a usage error for what would otherwise fail only after loading: the engine's ``Config``
    is built from the options, the checkpoint's config and weight files are found, numbers that must
    be positive are. Cheap: nothing is made, loaded or allocated."""
    try:
        Config(model=args.model or "", **engine_kwargs(args))
    except ConfigError as exc:  # "field=value is invalid: ...", said with the option's name instead
        field, _, rest = str(exc).partition("=")
        raise OptionError(f"{_RENAMED.get(field, '--' + field.replace('_', '-'))} {rest}") from exc
    for name in _POSITIVE:
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            raise OptionError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise OptionError("--device cuda: no CUDA device is available here (leave --device out to use the CPU)")
    if args.model:
        from models.config import load_qwen3_config
        from models.loader import checkpoint_files

        load_qwen3_config(args.model)
        checkpoint_files(args.model)


def model_dir(args: argparse.Namespace) -> Path:
    """The checkpoint to serve: ``--model`` as given, or the preset's, made if missing."""
    if args.model:
        return Path(args.model)
    from models.checkpoint import ensure_checkpoint

    return ensure_checkpoint(args.preset, seed=args.seed)


def model_name(args: argparse.Namespace) -> str:
    """The served model's name for labels and headers, known before its checkpoint is made."""
    return Path(args.model).name if args.model else args.preset


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options as ``Config`` fields: what ``check_args`` validates is what ``build_llm`` builds."""
    return dict(device=args.device, dtype=None if args.dtype == "auto" else args.dtype, seed=args.seed,
                kvcache_block_size=args.block_size,
                num_kvcache_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                max_waiting_requests=args.max_waiting_requests,
                enforce_eager=args.enforce_eager, async_scheduling=not args.no_async_scheduling,
                enable_prefix_caching=not args.no_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size,
                disable_custom_all_reduce=args.disable_custom_all_reduce, kv_offloading_size=args.kv_offloading_size,
                num_host_kvcache_blocks=args.num_host_kvcache_blocks,
                kv_offloading_policy=args.kv_offloading_policy, preemption_mode=args.preemption_mode,
                batching=args.batching, scheduling_policy=args.scheduling_policy,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enable_cpu_offload=args.enable_cpu_offload)


def build_llm(args: argparse.Namespace):
    from engine.llm_engine import LLM

    return LLM(str(model_dir(args)), **engine_kwargs(args))


def build_workload(args: argparse.Namespace, vocab_size: int):
    from engine.workloads import make_workload

    params = {} if args.rate is None else {"rate": args.rate}
    return make_workload(args.workload, vocab_size, seed=args.seed, **params)


# What the dashboard and `python -m telemetry` run with unless told otherwise: a pool small enough
# that prefix hits, chunked prefill, preemption and eviction all show within half a minute, and a
# waiting queue that sheds load rather than grow without bound when arrivals outrun the engine.
LIVE_DEFAULTS = dict(block_size=16, num_blocks=160, max_num_seqs=32, max_num_batched_tokens=256,
                     max_model_len=2048, max_waiting_requests=256)
