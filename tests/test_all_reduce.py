"""The one-shot all-reduce's two kernels, with every rank in this process: the norm that sums each
rank's term where it lies (against the pure-torch norm of the sum), and the barrier's flag protocol.
The interpreter runs them on CPU-only machines, ``-m gpu`` compiled; two real ranks on two GPUs
are ``tests/test_tensor_parallel_gpu.py``'s."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kernels.all_reduce import _barrier_kernel, symmetric_barrier
from kernels.reference import add_rms_norm_ref
from kernels.rms_norm import _rms_norm_kernel, rms_norm

from tests.hopper import hopper_ptx, ptx_op, run_compiled
from tests.servers import REPO, python_with_repo


def addresses(tensors: list[torch.Tensor], device: str) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def check_norm_across_ranks(world: int, num_rows: int, n: int, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(world * 100 + num_rows)
    # One allocation per rank, as each rank's symmetric buffer is.
    terms = [(torch.randn(num_rows, n, generator=gen) * 2).to(dtype=dtype, device=device) for _ in range(world)]
    residual = (torch.randn(num_rows, n, generator=gen) * 4).to(dtype=dtype, device=device)
    weight = (torch.rand(n, generator=gen) + 0.5).to(dtype=dtype, device=device)
    before = [t.clone() for t in terms]
    out, new_residual = rms_norm(terms[0], weight, 1e-6, residual, ranks=addresses(terms, device))
    # The oracle: the terms summed in float32 in rank order and rounded once, then add + norm.
    total = torch.stack([t.float() for t in terms]).sum(0).to(dtype)
    ref, ref_residual = add_rms_norm_ref(total, residual, weight, 1e-6)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, ref, atol=eps, rtol=2 * eps)
    torch.testing.assert_close(new_residual, ref_residual, atol=eps, rtol=2 * eps)
    assert all(torch.equal(t, b) for t, b in zip(terms, before))
    # Whichever rank's term is passed as x, the result is the same: every rank holds one sum.
    other, _ = rms_norm(terms[-1], weight, 1e-6, residual, ranks=addresses(terms, device))
    assert torch.equal(other, out)


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("world,num_rows,n", [(2, 1, 64), (2, 7, 100), (4, 5, 256)])
def test_norm_sums_every_ranks_term_cpu(world: int, num_rows: int, n: int) -> None:
    check_norm_across_ranks(world, num_rows, n, torch.float16, "cpu")


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("world,num_rows,n", [(2, 1, 2560), (2, 256, 2560), (2, 4096, 1024), (4, 33, 4096)])
def test_norm_sums_every_ranks_term_gpu(world: int, num_rows: int, n: int) -> None:
    check_norm_across_ranks(world, num_rows, n, torch.bfloat16, "cuda")


def test_norm_across_ranks_refuses_what_it_cannot_sum() -> None:
    x, weight = torch.randn(4, 64), torch.ones(64)
    with pytest.raises(ValueError, match="needs a residual"):
        rms_norm(x, weight, 1e-6, ranks=addresses([x, x], "cpu"))
    with pytest.raises(ValueError, match="int64"):
        rms_norm(x, weight, 1e-6, torch.randn(4, 64), ranks=torch.zeros(2, dtype=torch.int32))


def flag_buffers(world: int, device: str) -> list[torch.Tensor]:
    """Each rank's buffer: the arrivals of every rank seen by it, then its own count."""
    return [torch.zeros(world + 1, dtype=torch.int32, device=device) for _ in range(world)]


def check_barrier_protocol(device: str, abort: torch.Tensor) -> None:
    flags = flag_buffers(2, device)
    table = addresses(flags, device)
    # Rank 1 has arrived once, as its barrier would have recorded it: rank 0 passes its first
    # barrier and records its own arrival in rank 1's buffer.
    flags[0][1] = flags[1][2] = 1
    symmetric_barrier(table, abort, rank=0)
    assert flags[0].tolist() == [0, 1, 1] and flags[1].tolist() == [1, 0, 1]
    # Rank 1 arrives a second time, after rank 0's second arrival (recorded here as it would be).
    flags[1][0] += 1
    symmetric_barrier(table, abort, rank=1)
    assert flags[0].tolist() == [0, 2, 1] and flags[1].tolist() == [2, 0, 2]
    # Three ranks: each waits for both others.
    flags = flag_buffers(3, device)
    flags[2][0] = flags[2][1] = 1
    symmetric_barrier(addresses(flags, device), abort, rank=2)
    assert [f.tolist() for f in flags] == [[0, 0, 1, 0], [0, 0, 1, 0], [1, 1, 0, 1]]
    # Counts wrap around: 2**31 - 1 arrivals, then the next.
    flags = flag_buffers(2, device)
    flags[0][2] = flags[1][2] = flags[1][0] = 2**31 - 1
    flags[0][1] = -2**31  # rank 1's 2**31-th arrival, wrapped
    symmetric_barrier(addresses(flags, device), abort, rank=0)
    assert flags[0][2] == -2**31 and flags[1][0] == -2**31


@pytest.mark.usefixtures("cpu")
def test_barrier_flag_protocol_cpu() -> None:
    check_barrier_protocol("cpu", torch.zeros(1, dtype=torch.int32))


@pytest.mark.usefixtures("cpu")
def test_an_aborted_barrier_returns_without_its_peers_cpu() -> None:
    flags = flag_buffers(2, "cpu")
    # The peer never arrives: only the abort word ends the wait, after this rank's arrival counted.
    symmetric_barrier(addresses(flags, "cpu"), torch.ones(1, dtype=torch.int32), rank=0)
    assert flags[0].tolist() == [0, 0, 1] and flags[1].tolist() == [1, 0, 0]
    # Across the wrap the peer is one arrival behind (2**31 - 1 against this rank's -2**31): it must
    # wait (a plain "seen < arrivals" would let it through), so again only the abort ends it.
    flags = flag_buffers(2, "cpu")
    flags[0][1] = flags[0][2] = 2**31 - 1
    abort = torch.zeros(1, dtype=torch.int32)
    waiting = threading.Thread(target=symmetric_barrier, args=(addresses(flags, "cpu"), abort, 0))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()
    abort[0] = 1
    waiting.join(30)
    assert not waiting.is_alive() and flags[0][2] == -2**31


def test_barrier_refuses_a_rank_outside_the_table() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        symmetric_barrier(torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), rank=2)


def check_barrier_on_the_gpu() -> None:
    abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    check_barrier_protocol("cuda", abort)
    # A barrier whose peer never comes spins on the GPU until the host raises the pinned word.
    flags = flag_buffers(2, "cuda")
    raised = []

    def raise_abort() -> None:
        time.sleep(0.3)
        raised.append(time.perf_counter())
        abort.fill_(1)

    thread = threading.Thread(target=raise_abort)
    thread.start()
    symmetric_barrier(addresses(flags, "cuda"), abort, rank=0)
    torch.cuda.synchronize()
    returned = time.perf_counter()
    thread.join()
    assert raised and returned >= raised[0]
    assert flags[0].tolist() == [0, 0, 1] and flags[1].tolist() == [1, 0, 0]
    print("barrier ok", flush=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_barrier_on_the_gpu_and_its_abort_from_the_host() -> None:
    # In a process of its own: a barrier that never returns would otherwise hang the suite.
    code = "from tests.test_all_reduce import check_barrier_on_the_gpu; check_barrier_on_the_gpu()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO, env=python_with_repo(os.environ))
    assert result.returncode == 0 and "barrier ok" in result.stdout, result.stderr[-3000:]


def global_loads(ptx: str) -> dict[str, int]:
    return dict(collections.Counter(ptx_op(line)
                                    for line in ptx.splitlines() if "ld.global" in line))


def compile_both_for_hopper() -> None:
    """Prints what the test checks in the two kernels' PTX, as JSON."""
    barrier = hopper_ptx(_barrier_kernel, {"flag_ptrs": "*i64", "abort_ptr": "*i32"}, {"RANK": 0, "WORLD": 2},
                         aligned=(), num_warps=1)
    norm = hopper_ptx(_rms_norm_kernel, {
        "x_ptr": "*bf16", "ranks_ptr": "*i64", "residual_ptr": "*bf16", "residual_out_ptr": "*bf16",
        "weight_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32", "stride_split": "i32", "stride_x": "i32",
        "stride_r": "i32", "stride_y": "i32", "eps": "fp32"},
        {"SPLITS": 1, "RANKS": 2, "ADD_RESIDUAL": True, "BLOCK_N": 4096, "PDL": True}, aligned=(0, 1, 2, 3, 4, 5, 6, 8, 9, 10),
        num_warps=8)
    print(json.dumps({"release": "atom.global.sys.release.add" in barrier,
                      "acquire": "ld.global.sys.acquire" in barrier, "norm_loads": global_loads(norm)}))


def test_the_kernels_compile_for_hopper_with_system_scope_atomics_and_vector_loads() -> None:
    stdout = run_compiled("from tests.test_all_reduce import compile_both_for_hopper; compile_both_for_hopper()")
    found = json.loads(stdout.splitlines()[-1])
    # Arrivals are released into the peer, and waited for with acquire, at system scope (across GPUs):
    # the wait's atomic add of zero becomes an acquire load.
    assert found["release"] and found["acquire"]
    # Each rank's row, the residual and the weight in 16-byte loads; the two 8-byte loads are the
    # ranks' addresses. Without the alignment hint on those addresses the rows load 2 bytes at a time.
    assert found["norm_loads"] == {"ld.global.v4.b32": 8, "ld.global.b64": 2}
