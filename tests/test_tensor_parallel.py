"""Tensor parallelism on the CPU (gloo): two ranks give the single rank's greedy tokens, and the
worker processes fail loudly and shut down cleanly.

DESIGN.md's greedy-equality rule as in test_engine: teacher-forced against transformers' float32
argmax at every position whose top-2 gap is at least 1e-4 (exemptions counted), and free-running
tokens equal exactly, here both to transformers' and to the single-rank engine's.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine.config import Config, ConfigError
from engine.llm_engine import LLM
from engine.model_runner import ModelRunner
from engine.tensor_parallel import (WorkerError, _abort_destroying_graphs, _choose_all_reduce, _GuardedGraphs,
                                    start_ignoring_sigint)
import kernels.skinny_gemm as skinny_gemm_module
from models.all_reduce import OneShotAllReduce
from models.qwen3 import QKV_SKINNY_MAX_MACS, skinny_fits
from tests.test_engine import GAP, MAX_TOKENS, greedy, prompts, reference, teacher_forced_mismatches  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    # Rank 0 (this process) and the worker share the machine's cores; each worker takes its share,
    # and an oversubscribed thread pool here would spin against it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_shard_takes_the_skinny_gemm_up_to_the_rows_one_gpu_does(tp, monkeypatch):
    # The rule is the same rows at every size: Qwen3-4B's qkv (6,144 x 2,560) up to 34 rows, the
    # 0.6B's gate/up (2 x 3,072 x 1,024) up to 341. Operands on the meta device carry the shapes; the
    # CUDA check the kernels make is the only part taken out.
    monkeypatch.setattr(skinny_gemm_module, "_tiled_for", lambda x: True)
    for (rows, cols), max_macs, last_row in (((6144, 2560), QKV_SKINNY_MAX_MACS, 34),
                                              ((6144, 1024), skinny_gemm_module.MAX_MACS, 341)):
        shard = SimpleNamespace(weight=torch.empty(rows // tp, cols, device="meta"), tp_size=tp)
        assert skinny_fits(torch.empty(last_row, cols, device="meta"), shard, max_macs)
        assert not skinny_fits(torch.empty(last_row + 1, cols, device="meta"), shard, max_macs)


class FakeGraph:
    """A CUDA graph's replay and reset, counted (the guarded containers hold any such object)."""

    def __init__(self) -> None:
        self.replays = self.resets = 0

    def replay(self) -> None:
        self.replays += 1

    def reset(self) -> None:
        self.resets += 1


def test_an_abort_destroys_rank_0s_decode_graphs_and_every_prefill_piece_which_then_refuse_to_run():
    # NCCL's abort waits until no graph holds its communicator: the prefill graphs' pieces hold it (the
    # embedding's all-reduce, and NCCL's all-reduces) as the decode graphs do, so shutdown reaches them.
    decode, pieces = _GuardedGraphs(), _GuardedGraphs()
    originals = [FakeGraph() for _ in range(4)]
    decode[8], pieces[16] = originals[0], originals[1:]
    guarded = [decode[8], *pieces[16]]
    for piece in guarded[1:]:
        piece.replay()
    aborted = []
    _abort_destroying_graphs(lambda: aborted.append(True), decode, pieces)
    assert aborted == [True] and not decode and not pieces
    assert [graph.resets for graph in originals] == [1, 1, 1, 1]
    assert [graph.replays for graph in originals] == [0, 1, 1, 1]
    for graph in guarded:
        with pytest.raises(RuntimeError, match="destroyed after a tensor-parallel worker failed"):
            graph.replay()


def test_sizes_that_do_not_divide_the_model_are_refused_before_anything_starts(tiny_checkpoint):
    # tiny: 8 attention heads, 4 KV heads, intermediate 512, vocabulary 4096.
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 must divide num_attention_heads=8, "
                                          r"num_key_value_heads=4.*\[1, 2, 4\]"):
        LLM(str(tiny_checkpoint), tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=8 must divide num_key_value_heads=4:"):
        LLM(str(tiny_checkpoint), tensor_parallel_size=8)
    assert not dist.is_initialized()


SETTINGS = {
    # Chunked prefill (24-token budget) and, on the repeat, prefix-cache hits.
    "chunked_prefix_cache": {"kvcache_block_size": 16, "max_num_batched_tokens": 24},
    "preemption": {"kvcache_block_size": 16, "num_kvcache_blocks": 9},
    # vLLM V1's mixed steps: decode rows (workers know only each request's last token) beside chunks.
    "mixed_batching": {"kvcache_block_size": 16, "max_num_batched_tokens": 24, "batching": "mixed"},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_two_ranks_give_the_single_rank_greedy_tokens(name, tiny_checkpoint, prompts, reference, hf_model):
    runs = {}
    for tp in (1, 2):
        with LLM(str(tiny_checkpoint), tensor_parallel_size=tp, **SETTINGS[name]) as llm:
            events = []
            llm.events.subscribe(events.append)
            first = [o["token_ids"] for o in llm.generate(prompts, greedy(), use_tqdm=False)]
            again = [o["token_ids"] for o in llm.generate(prompts, greedy(), use_tqdm=False)]
            runs[tp] = first, again, events
            assert len(llm.scheduler.block_manager.free_block_ids) == llm.config.num_kvcache_blocks
    first, again, events = runs[2]
    exempt = 0
    for prompt, ref, got in zip(prompts, reference, first):
        mismatches, near_ties = teacher_forced_mismatches(hf_model, prompt, ref, got)
        assert mismatches == 0
        exempt += near_ties
    assert exempt <= 0.03 * len(prompts) * MAX_TOKENS, f"{exempt} near-tie positions (gap < {GAP})"
    assert first == again == reference == runs[1][0] == runs[1][1]
    # Only rank 0 emits, and it makes the single rank's decisions.
    started = [e for e in events if e.kind == "engine_started"]
    assert len(started) == 1 and started[0].tensor_parallel_size == 2 and started[0].all_reduce == "gloo"
    assert [e.kind for e in events] == [e.kind for e in runs[1][2]]
    kinds = {e.kind for e in events}
    if name == "preemption":
        assert "preempt" in kinds
    elif name == "mixed_batching":
        assert any(e.kind == "step" and e.phase == "mixed" for e in events)
    else:
        assert any(any(e.chunked) for e in events if e.kind == "schedule")
        assert sum(e.hit_tokens for e in events if e.kind == "prefix_hit") > 0


def test_shutdown_leaves_no_process_port_or_shared_memory(tiny_checkpoint, prompts):
    shm_before = set(os.listdir("/dev/shm"))
    with LLM(str(tiny_checkpoint), tensor_parallel_size=2, kvcache_block_size=16) as llm:
        llm.generate(prompts[:2], greedy(4), use_tqdm=False)
        pids = llm.tp_group.worker_pids
        port = llm.tp_group._workers.store.port
        assert len(pids) == 1 and all(alive(pid) for pid in pids)
    assert not any(alive(pid) for pid in pids)
    assert [p.exitcode for p in llm.tp_group._workers.processes] == [0]  # told to exit, not killed
    assert not dist.is_initialized()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert set(os.listdir("/dev/shm")) <= shm_before
    llm.close()  # idempotent


def test_a_killed_worker_fails_the_engine_promptly(tiny_checkpoint, prompts):
    with LLM(str(tiny_checkpoint), tensor_parallel_size=2, kvcache_block_size=16) as llm:
        llm.generate(prompts[:1], greedy(2), use_tqdm=False)
        (pid,) = llm.tp_group.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.perf_counter()
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            llm.generate(prompts, greedy(), use_tqdm=False)
        assert time.perf_counter() - start < 10
        with pytest.raises(WorkerError, match="SIGKILL"):  # and stays failed
            llm.generate(prompts[:1], greedy(2), use_tqdm=False)
        assert len(llm.scheduler.block_manager.free_block_ids) == llm.config.num_kvcache_blocks
    assert not dist.is_initialized()


def raise_on_workers(runner: ModelRunner) -> None:
    """Called on every rank: the worker raises, rank 0 waits for it in a collective."""
    if runner.rank != 0:
        raise ValueError("injected worker failure")
    dist.barrier()


def test_a_raising_worker_fails_the_engine_with_its_error(tiny_checkpoint, prompts):
    with LLM(str(tiny_checkpoint), tensor_parallel_size=2, kvcache_block_size=16) as llm:
        start = time.perf_counter()
        with pytest.raises(WorkerError, match=r"(?s)rank 1 .* raised ValueError: injected worker failure.*"
                                              r"Worker traceback:.*raise_on_workers"):
            llm.tp_group.call(raise_on_workers)
        assert time.perf_counter() - start < 10
        with pytest.raises(WorkerError, match="injected worker failure"):
            llm.generate(prompts[:1], greedy(2), use_tqdm=False)
    assert not dist.is_initialized()


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(int(link[len("socket:["):-1]))
    return inodes


def listening_addresses(inodes: set[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket among ``inodes`` in state LISTEN (0A), from /proc/net."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or int(fields[9]) not in inodes:
                continue
            host, port = fields[1].split(":")
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
            found.append((ipaddress.ip_address(raw), int(port, 16)))
    return found


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address, as a struct ifreq


def non_loopback_interface() -> str | None:
    """An interface with a non-loopback IPv4 address, if this machine has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            # ifreq: 16 bytes of name, then a sockaddr_in (family, port, address).
            if not ipaddress.ip_address(reply[20:24]).is_loopback:
                return name
    return None


def test_every_socket_the_group_listens_on_is_loopback(tiny_checkpoint, monkeypatch):
    # Without GLOO_SOCKET_IFNAME gloo binds the address the host name resolves to, loopback on some
    # machines only; one left in the environment for other work must not move gloo off loopback
    # either, and setting it to a real interface shows gloo's choice on any machine that has one.
    # The store listens on every interface unless it is given a socket.
    interface = non_loopback_interface()
    if interface is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    before = socket_inodes(os.getpid())
    with LLM(str(tiny_checkpoint), tensor_parallel_size=2, kvcache_block_size=16) as llm:
        (worker,) = llm.tp_group.worker_pids
        rank0 = listening_addresses(socket_inodes(os.getpid()) - before)
        rank1 = listening_addresses(socket_inodes(worker))
        store_port = llm.tp_group._workers.store.port
    # Rank 0: the store and gloo's listener; the worker: gloo's.
    assert store_port in [port for _, port in rank0] and len(rank0) >= 2 and rank1
    exposed = [f"{address}:{port}" for address, port in rank0 + rank1 if not is_loopback(address)]
    assert not exposed, f"the tensor-parallel group listens beyond loopback on {exposed}"
    assert os.environ.get("GLOO_SOCKET_IFNAME") == interface  # the user's setting is back


OTHER_ENGINE = """
import json, sys
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams

if __name__ == "__main__":
    prompts = json.loads(sys.argv[2])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16)
    tokens = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    print(json.dumps({"tokens": tokens, "workers": llm.tp_group.worker_pids}), flush=True)
    while True:  # until Ctrl-C
        llm.generate(prompts, params, use_tqdm=False)
"""


def _exit_with_sigint_disposition() -> None:
    # 0 when this process started with Ctrl-C ignored (nothing here has touched the handler).
    os._exit(0 if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else 3)


def test_spawned_processes_ignore_ctrl_c_from_their_first_import():
    """Workers and the engine process start with SIGINT ignored, not only once their target runs: a
    Ctrl-C while one still imports torch would otherwise end it with a traceback."""
    from multiprocessing import get_context

    process = get_context("spawn").Process(target=_exit_with_sigint_disposition)
    start_ignoring_sigint(process)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's own, back
    process.join(timeout=120)
    assert process.exitcode == 0
    plain = get_context("spawn").Process(target=_exit_with_sigint_disposition)
    plain.start()
    plain.join(timeout=120)
    assert plain.exitcode == 3  # what a plain start gives: Python's KeyboardInterrupt handler


def test_two_engines_side_by_side_and_ctrl_c_leaves_nothing(tiny_checkpoint, prompts, tmp_path):
    script = tmp_path / "other_engine.py"
    script.write_text(textwrap.dedent(OTHER_ENGINE))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with LLM(str(tiny_checkpoint), tensor_parallel_size=2, kvcache_block_size=16) as llm:
        other = subprocess.Popen([sys.executable, str(script), str(tiny_checkpoint), json.dumps(prompts)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            line = other.stdout.readline()
            assert line, other.stderr.read()
            result = json.loads(line)
            # Both engines generate at once, each in its own process group on its own port.
            mine = [o["token_ids"] for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
            assert result["tokens"] == mine
            other.send_signal(signal.SIGINT)
            _, stderr = other.communicate(timeout=30)
        finally:
            other.kill()
        assert "KeyboardInterrupt" in stderr
        assert not any(alive(pid) for pid in result["workers"])


def test_an_engine_after_a_one_shot_one_in_this_process_sums_with_nccl(monkeypatch, caplog):
    # torch's symmetric memory rendezvous hangs the second time in a process (models.all_reduce):
    # rank 0 decides before its workers start, and says why.
    gpu = torch.device("cuda", 0)
    config = Config(tensor_parallel_size=2)
    _choose_all_reduce(config, gpu)
    assert not config.disable_custom_all_reduce  # the first engine of a process keeps it
    monkeypatch.setattr(OneShotAllReduce, "used", True)
    _choose_all_reduce(config, torch.device("cpu"))
    assert not config.disable_custom_all_reduce  # gloo ranks never use it
    with caplog.at_level("WARNING", logger="engine.tensor_parallel"):
        _choose_all_reduce(config, gpu)
    assert config.disable_custom_all_reduce and "sums with NCCL" in caplog.text
