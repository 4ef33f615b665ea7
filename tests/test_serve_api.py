"""The OpenAI-compatible API, through the real ``openai`` SDK and raw HTTP, against the server's own
``Server`` on a thread (so the tests also reach the engine behind it, through its client)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from tests.servers import ENGINE, threaded_server

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with threaded_server(tiny_checkpoint) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """An engine of the test's own on the same checkpoint and settings: what generate() gives."""
    with LLM(str(tiny_checkpoint), **ENGINE) as llm:
        yield llm


def greedy_ids(reference, prompt: str, n: int) -> list[int]:
    return reference.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                              use_tqdm=False)[0]["token_ids"]


def test_completion_equals_generate_and_reports_usage(server, client, reference):
    ids = greedy_ids(reference, PROMPT, 12)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == ids
    assert choice.text == reference.tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.finish_reason == "length" and out.id.startswith("cmpl-") and out.model == "tiny"
    prompt_tokens = len(reference.tokenizer.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 12)
    assert out.usage.total_tokens == prompt_tokens + 12
    # The same prompt again is served from the prefix cache, as OpenAI's cached_tokens says.
    long = "a fresh start: " + PROMPT * 4
    again = client.completions.create(model="tiny", prompt=long, max_tokens=2, temperature=0)
    cached = client.completions.create(model="tiny", prompt=long, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert cached.usage.prompt_tokens_details.cached_tokens == 16 * ((again.usage.prompt_tokens - 1) // 16)


def test_streaming_completion_matches_the_whole_answer(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *content, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    # Without include_usage there is no usage chunk (SGLang's bench_serving reads choices[0] of every chunk).
    plain = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True))
    assert all(c.choices for c in plain)


def test_several_prompts_are_several_choices(client, reference):
    prompts = ["one two three", "four five six seven"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(prompts, out.choices):
        assert choice.model_extra["token_ids"] == greedy_ids(reference, prompt, 6)
    assert out.usage.completion_tokens == 12


def test_chat_renders_the_template(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rendered = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = reference.tokenizer.encode(rendered, add_special_tokens=False)
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["prompt_token_ids"] == prompt_ids
    assert out.choices[0].model_extra["token_ids"] == greedy_ids(reference, rendered, 8)
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(prompt_ids)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant" and stream[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in stream[1:-1]) == out.choices[0].message.content
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 8
    # Content as a list of text parts, as vLLM's bench serve sends it.
    parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                                {"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert parts.choices[0].message.content == out.choices[0].message.content


def test_a_requests_prompts_arrive_together_when_the_server_received_it(server):
    arrivals = []
    unsubscribe = server.events.subscribe(
        lambda e: arrivals.append(e.arrival) if e.kind == "request_arrived" else None)
    try:
        sent = time.perf_counter()
        response = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        done = time.perf_counter()
    finally:
        unsubscribe()
    assert response.status_code == 200 and len(response.json()["choices"]) == 3
    # vLLM's arrival time (TTFT and e2e count from it), not the engine's step boundary that read each.
    assert len(arrivals) == 3 and len(set(arrivals)) == 1 and sent <= arrivals[0] <= done


def test_stop_string_ends_the_text_before_it(client, reference):
    ids = greedy_ids(reference, PROMPT, 24)
    pieces = [reference.tokenizer.decode([t], skip_special_tokens=True) for t in ids]
    k = next(i for i in range(4, len(ids)) if len(pieces[i]) >= 3 and pieces[i] not in "".join(pieces[:i]))
    stop = pieces[k]
    expected = "".join(pieces[:k])
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)
    assert choice.model_extra["token_ids"] == ids[:k + 1] and out.usage.completion_tokens == k + 1
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == expected  # no half of the stop string was sent
    assert streamed[-1].choices[0].finish_reason == "stop"
    # Kept with include_stop_str_in_output; LLM.generate honours stop strings the same way.
    kept = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop
    generated = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                                   use_tqdm=False)[0]
    assert (generated["text"], generated["token_ids"]) == (expected, ids[:k + 1])


def test_stop_token_ids_and_min_tokens(client, reference):
    ids = greedy_ids(reference, PROMPT, 16)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"stop_token_ids": [ids[k]], "return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == ids[k]
    assert choice.model_extra["token_ids"] == ids[:k + 1]
    assert choice.text == reference.tokenizer.decode(ids[:k], skip_special_tokens=True)  # the stop token's text is left out
    # min_tokens past k: the stop token cannot be sampled at k, so the answer differs there and runs on.
    later = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"stop_token_ids": [ids[k]], "min_tokens": k + 3,
                                                  "return_token_ids": True})
    later_ids = later.choices[0].model_extra["token_ids"]
    assert later_ids[:k] == ids[:k] and later_ids[k] != ids[k] and len(later_ids) >= k + 3


def test_seeded_sampling_is_the_same_alone_and_among_others(server):
    async def run() -> tuple[list[int], list[int], list[int]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(seed: int | None, n: int = 24) -> list[int]:
            out = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=1.0,
                                                  seed=seed, extra_body={"ignore_eos": True, "return_token_ids": True})
            return out.choices[0].model_extra["token_ids"]

        alone = await one(1234)
        crowd = await asyncio.gather(one(1234), *(one(s) for s in (None, 1, 2, 3, None, 5, 6, 7)))
        other_seed = await one(4321)
        await client.close()
        return alone, crowd[0], other_seed

    alone, among_eight, other_seed = asyncio.run(run())
    assert alone == among_eight
    assert other_seed != alone  # the seed, not greediness, fixes the draws


def test_64_concurrent_streams_and_a_client_that_leaves(server):
    async def run() -> tuple[list[int], str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async def stream(i: int) -> int:
                body = {"prompt": f"{PROMPT} {i}", "max_tokens": 16 + i % 8, "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True}
                usage = None
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            data = json.loads(line[6:])
                            usage = data.get("usage") or usage
                return usage["completion_tokens"]

            async def leaver() -> str:
                body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            return line  # leaves after its first chunk, closing the connection
                return ""

            counts = await asyncio.gather(*(stream(i) for i in range(64)), leaver())
            return counts[:-1], counts[-1]

    aborted_before = _metric(server, 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}')
    counts, first = asyncio.run(run())
    assert counts == [16 + i % 8 for i in range(64)] and first
    assert server.wait_idle(), "blocks still held after every client finished or left"
    deadline = time.monotonic() + 10
    while _metric(server, 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}') \
            < aborted_before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}') \
        == aborted_before + 1


def _metric(server, series: str) -> float:
    server.exporter.flush()
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} is not in /metrics")


BAD_REQUESTS = [
    # (what, path, body or raw bytes, status, the words the message must hold, param)
    ("malformed JSON", "/v1/completions", b'{"prompt": "x", ', 400, "not valid JSON", None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "JSON object", None),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9", "model"),
    ("prompt too long", "/v1/completions", {"prompt": list(range(1, 600))}, 400, "maximum context length",
     "input_tokens"),
    ("max_tokens past max_model_len", "/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400,
     "max_model_len=512", "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature",
     "temperature"),
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 3}, 400, "n=3 is not supported", "n"),
    ("logprobs", "/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs=2", "logprobs"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "tools"),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "lots"}, 400, "max_tokens", "max_tokens"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", "prompt"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 2, 99999]}, 400, "vocabulary", "prompt"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, "Not Found", None),
    ("priority without the priority policy", "/v1/completions", {"prompt": "x", "priority": 3}, 400,
     "--scheduling-policy priority", "priority"),
    ("priority not an integer", "/v1/completions", {"prompt": "x", "priority": "high"}, 400, "priority", "priority"),
    # Past the 64 bits of the engine's wire format: once an encoding error, a plain-text 500.
    ("top_k past 64 bits", "/v1/completions", {"prompt": "x", "top_k": 2**64}, 400, "top_k: Input should be less",
     "top_k"),
    ("stop token id past 64 bits", "/v1/completions", {"prompt": "x", "stop_token_ids": [2**64]}, 400,
     "stop_token_ids.0", "stop_token_ids.0"),
    ("priority past 64 bits", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "priority": -(2**64)}, 400, "priority", "priority"),
    ("tokenize no messages", "/tokenize", {"messages": []}, 400, "at least 1 item", "messages"),
    ("min_tokens past max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 100}, 400,
     "min_tokens=100", "min_tokens"),
    ("stop token id outside the vocabulary", "/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, 400,
     "outside the vocabulary", "stop_token_ids"),
    ("text part without its text", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, 400, "needs a 'text' string", "messages"),
]


@pytest.mark.parametrize("what,path,body,status,words,param", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_input_is_a_4xx_naming_the_problem(server, what, path, body, status, words, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["code"] == status and error["param"] == param
    assert error["type"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
    assert ok.status_code == 200


def test_an_unexpected_error_is_a_500_in_the_apis_shape_and_serving_goes_on(server, monkeypatch):
    def broken(text: str, add_special_tokens: bool) -> list[int]:
        raise RuntimeError("a bug in tokenize")

    monkeypatch.setattr(server.server.state.serving, "tokenize", broken)
    response = httpx.post(server.url + "/tokenize", json={"prompt": "x"})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == 500 and "RuntimeError: a bug in tokenize" in error["message"]
    monkeypatch.undo()
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 200


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    """The bodies vLLM's bench serve and SGLang's bench_serving send (vllm/benchmarks/lib/
    endpoint_request_func.py; sglang/benchmark/serving.py)."""
    bodies = [
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 4,
                             "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                             "ignore_eos": True}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "text", "text": PROMPT}]}], "max_completion_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}),
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "best_of": 1, "max_tokens": 4, "stream": True,
                             "temperature": 0.0, "ignore_eos": True}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                                  "max_completion_tokens": 4, "stream": True, "temperature": 0.0, "ignore_eos": True}),
        ("/v1/completions", {"prompt": PROMPT, "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
                             "logit_bias": {}, "echo": False, "user": "someone", "max_tokens": 2}),
    ]
    for path, body in bodies:
        response = httpx.post(server.url + path, json=body, timeout=60)
        assert response.status_code == 200, (body, response.text)
        if body.get("stream"):
            lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            data = [json.loads(line[6:]) for line in lines[:-1]]
            if "stream_options" in body:
                assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 4
            else:
                assert all(d["choices"] for d in data)


def test_a_ten_megabyte_body_is_refused(server):
    body = json.dumps({"prompt": "x" * (10 * 1024**2)}).encode()
    response = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "at most" in response.json()["error"]["message"]


def test_other_endpoints(server, reference):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 512
    assert models["data"][0]["root"]  # vLLM's bench serve reads it
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == reference.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][0] == reference.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "abc-1"}).json()[
        "id"] == "cmpl-abc-1"


def test_full_queue_is_503_with_retry_after(tiny_checkpoint):
    with threaded_server(tiny_checkpoint, max_waiting_requests=2) as server:
        server.pause()
        results: list[httpx.Response] = []

        def post() -> None:
            results.append(httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3},
                                      timeout=60))

        waiting = [threading.Thread(target=post) for _ in range(2)]
        for thread in waiting:
            thread.start()
        deadline = time.monotonic() + 10
        while server.num_waiting() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert "max_waiting_requests=2" in refused.json()["error"]["message"]
        server.resume()
        for thread in waiting:
            thread.join(30)
        assert [r.status_code for r in results] == [200, 200]
        assert 'reason="max_num_queued_reqs"} 1.0' in (server.exporter.flush() and httpx.get(server.url + "/metrics").text)


def test_priority_field_orders_the_queue(tiny_checkpoint):
    """Under --scheduling-policy priority the HTTP ``priority`` field decides who is admitted next."""
    with threaded_server(tiny_checkpoint, scheduling_policy="priority", max_num_seqs=1) as server:
        server.pause()
        events = []
        server.events.subscribe(events.append)
        priorities = [5, 0, 9, -2, 0, 3]
        results: list[httpx.Response] = []

        def post(priority: int) -> None:
            results.append(httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": f"request with priority {priority}", "max_tokens": 2, "priority": priority}))

        threads = []
        for priority in priorities:  # queued one after the other, in this order
            threads.append(threading.Thread(target=post, args=(priority,)))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while server.num_waiting() < len(threads) and time.monotonic() < deadline:
                time.sleep(0.01)
        server.resume()
        for thread in threads:
            thread.join(30)
        assert [r.status_code for r in results] == [200] * len(priorities)
        given = {e.request_id: e.priority for e in events if e.kind == "request_arrived"}
        admitted = [given[e.request_id] for e in events if e.kind == "prefix_hit"]
        assert admitted == sorted(priorities)  # ties (the two 0s) by arrival
        assert server.wait_idle()


def test_api_key_guards_v1_only(tiny_checkpoint):
    with threaded_server(tiny_checkpoint, api_key="s3cret") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
            assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
        assert httpx.get(server.url + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
