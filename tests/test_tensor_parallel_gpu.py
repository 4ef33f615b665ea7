"""Tensor parallelism over two GPUs (NCCL) against one GPU, same weights, bf16 (run with ``-m gpu``
on a machine with at least two GPUs; with fewer these tests fail, they do not skip).

Two ranks sum their partial products in another order than one does, so bf16 greedy generations may
part ways after a near-tie. Each engine's tokens are therefore held to test_gpu_engine's calibrated
criterion: teacher-forced against transformers in float32, an engine may disagree with the float32
argmax (where its top-2 gap is at least 1e-2) about as rarely as transformers' own bf16 path does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from models.checkpoint import ensure_checkpoint
from tests.servers import REPO, python_with_repo, serve_process
from tests.test_gpu_engine import check_against_reference, prompts_for

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def two_gpus() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.fail(f"tensor-parallel GPU tests need at least 2 GPUs; {count} visible")


def generate_twice(model_dir: Path, tp: int, prompts: list[list[int]], max_tokens: int,
                   all_reduce: str) -> list[list[int]]:
    """Greedy tokens, then the same prompts again through prefix-cache hits."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model_dir), tensor_parallel_size=tp, kvcache_block_size=16, max_model_len=2048,
             gpu_memory_utilization=0.5, disable_custom_all_reduce=all_reduce == "nccl") as llm:
        # CUDA graphs on every rank, prefill graphs too, rank 0's where an abort destroys them
        runner = llm.model_runner
        assert runner.dtype == torch.bfloat16 and runner.graphs and runner.prefill_graphs.graphs
        if tp > 1:
            assert runner.prefill_graphs.graphs is llm.tp_group._workers.prefill_pieces
        assert llm.model_runner.describe()["all_reduce"] == (all_reduce if tp > 1 else None)
        outputs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        outputs += [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    return outputs


def generate_alone(model_dir: Path, tp: int, prompts: list[list[int]], max_tokens: int,
                   all_reduce: str) -> list[list[int]]:
    """Greedy tokens of each prompt decoding alone: the decode graph of one row, whose attention
    reads its first K/V tile before its PDL wait (``kernels.paged_attention``)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model_dir), tensor_parallel_size=tp, kvcache_block_size=256, max_model_len=2048,
             gpu_memory_utilization=0.5, disable_custom_all_reduce=all_reduce == "nccl") as llm:
        assert llm.model_runner.dtype == torch.bfloat16 and llm.model_runner.graphs
        assert llm.model_runner.describe()["all_reduce"] == (all_reduce if tp > 1 else None)
        outputs = [llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] for prompt in prompts]
    del llm
    torch.cuda.empty_cache()
    return outputs


def generate_in_a_process(generate: str, model_dir: Path, prompts: list[list[int]], max_tokens: int,
                          all_reduce: str) -> list[list[int]]:
    """``generate`` (``generate_twice`` or ``generate_alone``) at TP=2 in a process of its own: a
    process sets up the one-shot all-reduce once (``models.all_reduce``)."""
    code = (f"import json, sys; from tests.test_tensor_parallel_gpu import {generate}; "
            f"print(json.dumps({generate}(sys.argv[1], 2, json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))")
    result = subprocess.run([sys.executable, "-c", code, str(model_dir), json.dumps(prompts), str(max_tokens),
                             all_reduce], capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=python_with_repo(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("preset,all_reduce", [("tiny", "one-shot"), ("tiny", "nccl"), ("qwen3-0.6b", "one-shot")])
def test_two_gpus_match_one_gpu_within_bf16_tolerance(preset, all_reduce):
    model_dir = ensure_checkpoint(preset)
    vocab = 4096 if preset == "tiny" else 151936
    prompts = prompts_for(vocab, [7, 100, 333, 600, 1000, 31])
    outputs = {1: generate_twice(model_dir, 1, prompts, 48, all_reduce),
               2: generate_in_a_process("generate_twice", model_dir, prompts, 48, all_reduce)}
    same = sum(a == b for one, two in zip(outputs[1], outputs[2]) for a, b in zip(one, two))
    identical = sum(one == two for one, two in zip(outputs[1], outputs[2]))
    total = sum(len(o) for o in outputs[1])
    print(f"{preset}, {all_reduce}: TP=2 equals TP=1 at {same}/{total} positions, {identical}/{len(outputs[1])} sequences identical")
    for tp in (1, 2):
        counts = check_against_reference(model_dir, prompts + prompts, outputs[tp])
        print(f"{preset} TP={tp}: {counts}")
        assert counts["exempt"] <= 0.05 * counts["checked"]
        assert counts["engine_mismatches"] <= 1.5 * counts["transformers_bf16_mismatches"] + 0.01 * counts["checked"]


def test_single_stream_decode_on_two_gpus_matches_transformers():
    """Requests decoding alone at TP=2 (the one-shot all-reduce): the same rule as above."""
    model_dir = ensure_checkpoint("qwen3-0.6b")
    prompts = prompts_for(151936, [7, 333, 1000], seed=1)
    outputs = generate_in_a_process("generate_alone", model_dir, prompts, 64, "one-shot")
    counts = check_against_reference(model_dir, prompts, outputs)
    print(f"qwen3-0.6b TP=2 alone: {counts}")
    assert counts["exempt"] <= 0.05 * counts["checked"]
    assert counts["engine_mismatches"] <= 1.5 * counts["transformers_bf16_mismatches"] + 0.01 * counts["checked"]


KILL_MID_GENERATION = """
import multiprocessing, os, signal, socket, sys, threading, time
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from engine.tensor_parallel import WorkerError

if __name__ == "__main__":
    began = time.perf_counter()
    llm = LLM(sys.argv[1], tensor_parallel_size=2, gpu_memory_utilization=0.3,
              disable_custom_all_reduce=sys.argv[2] == "nccl")
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.model_runner.graphs
    print("all_reduce", llm.model_runner.describe()["all_reduce"], flush=True)
    print(f"engine ready after {time.perf_counter() - began:.2f}s", flush=True)
    (pid,) = llm.tp_group.worker_pids
    port = llm.tp_group._workers.store.port
    killed = []
    def kill():
        killed.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL)
    threading.Timer(1.0, kill).start()
    try:
        llm.generate([[1, 2, 3]] * 8, params, use_tqdm=False)
        print("no error")
    except WorkerError as exc:
        print(f"WorkerError after {time.perf_counter() - killed[0]:.2f}s: {str(exc).splitlines()[0]}", flush=True)
    start = time.perf_counter()
    llm.close()
    print(f"closed in {time.perf_counter() - start:.2f}s", flush=True)
    print("children left", multiprocessing.active_children(), flush=True)
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        print("port free", flush=True)
    print(f"script done after {time.perf_counter() - began:.2f}s", flush=True)
"""


@pytest.mark.parametrize("all_reduce", ["one-shot", "nccl"])
def test_a_worker_killed_mid_collective_fails_the_engine_promptly(tmp_path, all_reduce):
    # NCCL collectives, and the one-shot all-reduce's barriers, wait forever for a dead peer; the
    # engine must stop them, not hang, and leave no process or port behind.
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(KILL_MID_GENERATION))
    began = time.perf_counter()
    result = subprocess.run([sys.executable, str(script), str(ensure_checkpoint("tiny")), all_reduce],
                            capture_output=True, text=True, timeout=240, cwd=tmp_path, env=python_with_repo(os.environ))
    # Where a slow run spends its time: the engine's start, the failure, the close, the exit.
    print(result.stdout, f"process exited after {time.perf_counter() - began:.2f}s", result.stderr[-3000:])
    assert f"all_reduce {all_reduce}" in result.stdout, result.stderr[-3000:]
    assert "was killed by SIGKILL" in result.stdout and "closed in" in result.stdout, result.stderr[-3000:]
    assert "children left []" in result.stdout and "port free" in result.stdout
    seconds = float(result.stdout.split("WorkerError after ")[1].split("s:")[0])
    assert seconds < 30  # a hang guard; the note reports the time measured


def process_table() -> dict[int, tuple[str, int]]:
    """Every process's state and parent, read from /proc."""
    table: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # gone meanwhile
            table[int(entry.name)] = (state, int(parent))
    return table


def descendants(pid: int) -> set[int]:
    """The processes below ``pid``."""
    parents = {child: parent for child, (_, parent) in process_table().items()}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def generated_tokens(url: str) -> float:
    """``vllm:generation_tokens_total`` once it stops changing (the engine's events reach the
    exporter just after the responses)."""
    last = None
    for _ in range(50):
        metrics = httpx.get(url + "/metrics", timeout=30).text
        value = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("vllm:generation_tokens_total"))
        if value == last:
            return value
        last = value
        time.sleep(0.2)
    return last


def test_the_server_on_two_gpus_answers_openai_clients_and_stops_clean():
    model_dir = ensure_checkpoint("tiny")
    with serve_process("--model", str(model_dir), "--tensor-parallel-size", "2", "--block-size", "16",
                       "--max-model-len", "1024", timeout=300) as server:
        below = descendants(server.process.pid)
        assert len(below) >= 2  # the engine core and the rank-1 worker
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        greedy = dict(model=client.models.list().data[0].id, prompt="the quick brown fox", max_tokens=24,
                      temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**greedy)
        assert whole.usage.completion_tokens == 24 and whole.choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**greedy, stream=True)
                           if chunk.choices)
        assert streamed == whole.choices[0].text
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(**{**greedy, "max_tokens": -1})
        answers: list[int] = []

        def ask(i: int) -> None:
            answer = client.completions.create(**{**greedy, "prompt": f"request {i} of many", "temperature": 0.8,
                                                  "max_tokens": 40 + i})
            answers.append(answer.usage.completion_tokens - i)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert answers == [40] * 32
        assert client.completions.create(**greedy).choices[0].text == whole.choices[0].text
        assert generated_tokens(server.url) == 24 * 3 + sum(range(40, 72))
        server.process.send_signal(signal.SIGINT)
        output = server.process.communicate(timeout=60)[0]
    assert server.process.returncode == 0, output
    # The workers leave with their parents (an orphan may linger as a zombie where no init reaps it).
    deadline = time.monotonic() + 10
    while (alive := {pid for pid, (state, _) in process_table().items() if pid in below and state != "Z"}) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, output
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


TWO_ENGINES = """
import gc, sys
import torch
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams

def engine_once():
    with LLM(sys.argv[1], tensor_parallel_size=2, gpu_memory_utilization=0.3, kvcache_block_size=16) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
        print(llm.model_runner.describe()["all_reduce"], out[0]["token_ids"], flush=True)

if __name__ == "__main__":
    for _ in range(2):
        engine_once()
        # Rank 0's KV cache goes with the engine object, as in vLLM: the next engine sizes its pool from
        # what is free.
        gc.collect()
        torch.cuda.empty_cache()
"""


def test_a_second_engine_in_one_process_sums_with_nccl(tmp_path):
    # torch's symmetric memory cannot rendezvous again in a process (models.all_reduce): without the
    # fallback the second engine hangs in its rendezvous.
    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent(TWO_ENGINES))
    result = subprocess.run([sys.executable, str(script), str(ensure_checkpoint("tiny"))], capture_output=True,
                            text=True, timeout=180, cwd=tmp_path, env=python_with_repo(os.environ))
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 2, result.stderr[-3000:]
    (first, tokens), (second, again) = (line.split(" ", 1) for line in lines)
    assert (first, second) == ("one-shot", "nccl") and "sums with NCCL" in result.stderr
    assert tokens == again  # two ranks' bf16 sum rounds once either way
