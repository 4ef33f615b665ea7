"""The event schema (kinds, the recorded form) and the bus (plain and batch subscribers, failures)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

import msgspec

from engine.events import (
    EVENT_TYPES,
    EngineStarted,
    EventBus,
    PrefixHit,
    Step,
    event_from_dict,
    event_to_dict,
    pack_events,
    unpack_events,
)
from tests.control_plane import HOST_TIER, FakeEngine, mid_run_snapshot, workload_events

BS = 16


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 17 + salt * 101 + 3) % 997 for i in range(n)]


# --- the schema -----------------------------------------------------------------------------------

def test_each_kind_is_named_once_as_a_class_attribute():
    for kind, cls in EVENT_TYPES.items():
        assert cls.kind == kind
        names = [f.name for f in fields(cls)]
        assert names[:2] == ["t", "step"] and "kind" not in names, kind


@pytest.fixture(scope="module")
def ring_events(tiny_checkpoint) -> list:
    """A real engine in CPU-offload mode: its ring_transfer and ring_step events."""
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_checkpoint), device="cpu", kvcache_block_size=16, num_kvcache_blocks=3,
              num_host_kvcache_blocks=16, max_model_len=256, enable_cpu_offload=True)
    events = []
    llm.events.subscribe(events.append)
    llm.generate(prompt(40), SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    return [e for e in events if e.kind.startswith("ring_")]


def test_every_kind_of_a_real_run_survives_json_and_back(ring_events):
    # Without a tier and with one: host hits after recompute, swap-outs and swap-ins after a swap;
    # and CPU-offload mode's ring.
    events = (workload_events(overlap=False) + workload_events(overlap=True, **HOST_TIER)
              + workload_events(preemption_mode="swap", **HOST_TIER) + [mid_run_snapshot(**HOST_TIER)]
              + ring_events)
    assert {e.kind for e in events} == set(EVENT_TYPES)  # the round trip below covers every kind
    for event in events:
        data = json.loads(json.dumps(event_to_dict(event)))
        assert data["kind"] == event.kind and event_from_dict(data) == event


def test_every_kind_of_a_real_run_crosses_the_wire_unchanged(ring_events):
    """The wire form an engine in another process sends (engine/core.py): msgpack of the packed list."""
    events = (workload_events(overlap=True, **HOST_TIER) + workload_events(preemption_mode="swap", **HOST_TIER)
              + [mid_run_snapshot(**HOST_TIER)] + ring_events)
    assert {e.kind for e in events} == set(EVENT_TYPES)
    received = unpack_events(msgspec.msgpack.decode(msgspec.msgpack.encode(pack_events(events))))
    assert received == events
    assert all(type(a) is type(b) for a, b in zip(received, events))
    assert all(isinstance(getattr(e, f.name), tuple) for e in received for f in fields(e)
               if isinstance(getattr(e, f.name), (list, tuple)))  # immutable, as emitted


def test_a_relay_delivers_what_the_engines_bus_delivered():
    """A bus fed by ``relay`` (the server's, fed from the engine's process) gives plain and batch
    subscribers what the engine's own bus gave them, and replays the relayed announcements."""
    engine = FakeEngine(overlap=True)
    plain, batches = [], []
    engine.bus.subscribe(plain.append)
    engine.bus.subscribe(batches.append, batched=True)
    relay = EventBus()
    relayed_plain, relayed_batches = [], []
    relay.subscribe(relayed_plain.append)
    relay.subscribe(relayed_batches.append, batched=True)
    relay.relay(engine.bus.announcements, announced=True)
    for i in range(4):
        engine.add(prompt(40, i), max_tokens=6)
    while not engine.is_finished():
        engine.step()
    for batch in batches[1:]:  # the first is the announcements, relayed above
        relay.relay(batch)
    assert relayed_plain == plain and relayed_batches == batches
    late = []
    relay.subscribe(late.append, batched=True)
    assert [e.kind for e in late[0]] == [e.kind for e in batches[0]] and isinstance(late[0][0], EngineStarted)
    quiet = []
    relay.subscribe(quiet.append, batched=True, replay=False)
    assert quiet == []


def test_rebuilding_names_an_unknown_kind_or_the_missing_fields():
    step = next(e for e in workload_events() if isinstance(e, Step))
    data = event_to_dict(step)
    assert event_from_dict({**data, "added_later": 1}) == step  # unknown keys are ignored
    with pytest.raises(ValueError, match="unknown event kind 'warp_drive'"):
        event_from_dict({**data, "kind": "warp_drive"})
    with pytest.raises(ValueError, match="unknown event kind None"):
        event_from_dict({k: v for k, v in data.items() if k != "kind"})
    old = {k: v for k, v in data.items() if k not in ("launch_s", "wait_s")}
    with pytest.raises(ValueError, match=r"event 'step' lacks field\(s\) \['launch_s', 'wait_s'\]"):
        event_from_dict(old)


def test_event_stream_of_a_request_lifecycle_is_ordered():
    engine = FakeEngine()
    seq = engine.add(prompt(2 * BS + 3), max_tokens=3)
    engine.run()
    kinds = [e.kind for e in engine.events]
    assert kinds[:6] == ["engine_started", "request_arrived", "block_alloc", "prefix_hit", "schedule", "block_stored"]
    assert kinds.index("first_token") < kinds.index("request_finished")
    # Tokens before the finish they cause, blocks released before the finish is announced, and the
    # step's own event after everything its results caused.
    assert kinds[-4:] == ["tokens", "block_free", "request_finished", "step"]
    finished = engine.of_kind("request_finished")[0]
    assert (finished.request_id, finished.reason, finished.prompt_tokens, finished.output_tokens) == (
        seq.seq_id, "length", 2 * BS + 3, 3)
    assert finished.arrival <= finished.first_scheduled <= finished.first_token <= finished.last_token <= finished.finished
    free = engine.of_kind("block_free")[0]
    allocated = [b for e in engine.of_kind("block_alloc") for b in e.block_ids]
    assert all(r == 0 for r in free.refcounts) and sorted(free.block_ids) == sorted(allocated)
    assert [e.step for e in engine.events[:2]] == [0, 0]  # before the first step
    assert all(e.step >= 1 for e in engine.events[2:])


# --- the bus --------------------------------------------------------------------------------------

def test_no_subscriber_builds_no_events(monkeypatch):
    built = []
    original_init = PrefixHit.__init__

    def spy(self, *args, **kwargs):
        built.append(1)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(PrefixHit, "__init__", spy)
    engine = FakeEngine()
    engine.bus = EventBus()
    engine.scheduler.events = engine.bus
    engine.scheduler.block_manager.events = engine.bus
    engine.add(prompt(40), max_tokens=3)
    engine.run()
    assert built == []
    engine.bus.subscribe(lambda e: None)
    engine.add(prompt(40), max_tokens=3)
    engine.run()
    assert built == [1]


def test_a_raising_subscriber_does_not_break_the_engine():
    engine = FakeEngine()

    def broken(event):
        raise RuntimeError("consumer bug")

    engine.bus.subscribe(broken)  # the engine_started replay is its first failure
    seq = engine.add(prompt(30), max_tokens=4)
    engine.run()
    assert seq.num_completion_tokens == 4
    assert engine.bus.failures(broken) == len(engine.events)  # every delivery failed, none was skipped
    assert engine.of_kind("request_finished")  # other subscribers still got everything


def test_batch_subscribers_get_held_events_at_publish_points_in_emission_order():
    bus = EventBus()
    plain, batches = [], []
    bus.subscribe(plain.append)
    unsubscribe = bus.subscribe(batches.append, batched=True)

    def hit(request_id: int) -> None:
        bus.emit(PrefixHit, request_id=request_id, query_tokens=2, hit_tokens=0, hit_block_ids=())

    with bus.held():
        hit(1)
        hit(2)
        assert batches == [] and len(plain) == 2  # plain subscribers are not held
        bus.publish()
        hit(3)
    assert [[e.request_id for e in b] for b in batches] == [[1, 2]]  # leaving the block does not publish
    hit(4)  # not held: what was pending goes out first, with it
    assert [[e.request_id for e in b] for b in batches] == [[1, 2], [3, 4]]
    assert [e for b in batches for e in b] == plain
    bus.publish()  # nothing pending: no empty batch
    assert len(batches) == 2
    unsubscribe()
    assert bus.active  # the plain subscriber is still there
    hit(5)
    assert len(batches) == 2 and len(plain) == 5


def test_a_batch_subscriber_gets_the_announcements_as_one_batch_and_its_failures_are_counted():
    bus = EventBus()
    bus.announce(PrefixHit, request_id=0, query_tokens=1, hit_tokens=0, hit_block_ids=())
    bus.announce(PrefixHit, request_id=1, query_tokens=1, hit_tokens=0, hit_block_ids=())
    batches = []
    bus.subscribe(batches.append, batched=True)
    assert [[e.request_id for e in b] for b in batches] == [[0, 1]]

    def broken(batch):
        raise RuntimeError("consumer bug")

    bus.subscribe(broken, batched=True)  # the replay raises: one failed delivery
    with bus.held():
        bus.emit(PrefixHit, request_id=2, query_tokens=1, hit_tokens=0, hit_block_ids=())
        bus.emit(PrefixHit, request_id=3, query_tokens=1, hit_tokens=0, hit_block_ids=())
        bus.publish()
    assert bus.failures(broken) == 2  # per batch, not per event
    assert [[e.request_id for e in b] for b in batches] == [[0, 1], [2, 3]]


def test_unsubscribe_stops_delivery():
    bus = EventBus()
    got = []
    unsubscribe = bus.subscribe(got.append)
    bus.emit(PrefixHit, request_id=1, query_tokens=2, hit_tokens=0, hit_block_ids=())
    unsubscribe()
    assert not bus.active
    bus.emit(PrefixHit, request_id=1, query_tokens=2, hit_tokens=0, hit_block_ids=())
    assert len(got) == 1
