import gc
import threading
import time

from engine.events import EventBus, FirstToken
from telemetry.event_queue import Consumer, EventQueue, queue_stats


def _event(i: int) -> FirstToken:
    return FirstToken(t=float(i), step=i, request_id=i)


def test_events_reach_the_handler_in_order_on_the_worker_thread():
    seen, threads = [], set()

    def handler(e):
        seen.append(e.request_id)
        threads.add(threading.get_ident())

    q = EventQueue(handler, "order")
    for i in range(100):
        q.put(_event(i))
    assert q.flush()
    assert seen == list(range(100))
    assert threads and threading.get_ident() not in threads
    q.close()


def test_a_full_queue_drops_and_counts_without_blocking():
    started, gate = threading.Event(), threading.Event()

    def handler(e):
        started.set()
        gate.wait()

    q = EventQueue(handler, "full", maxsize=4)
    q.put(_event(0))
    assert started.wait(5)  # the worker holds event 0, the queue is empty
    t0 = time.perf_counter()
    for i in range(1, 11):
        q.put(_event(i))
    assert time.perf_counter() - t0 < 0.05
    assert q.dropped == 6
    gate.set()
    q.close()
    assert queue_stats()["full"] == (6, 0)


def test_drop_counts_per_consumer_never_go_down_when_a_queue_is_closed_and_collected():
    # glassbox:dropped_events is a Prometheus counter: a fall reads as a reset.
    gate, held = threading.Event(), threading.Semaphore(0)

    def handler(e):
        held.release()
        gate.wait()

    queues = [EventQueue(handler, "comes-and-goes", maxsize=1) for _ in range(2)]
    for q in queues:
        q.put(_event(0))
        assert held.acquire(timeout=5)  # the worker holds it: the queue is empty
        q.put_batch([_event(1), _event(2)])  # fits (a batch may overshoot the bound)...
        q.put_batch([_event(3), _event(4)])  # ...and this one does not
    assert queue_stats()["comes-and-goes"] == (4, 0)
    gate.set()
    queues.pop().close()
    gc.collect()
    assert queue_stats()["comes-and-goes"] == (4, 0)
    queues.pop().close()


def test_the_bound_counts_events_and_a_batch_that_does_not_fit_is_dropped_whole():
    started, gate, seen = threading.Event(), threading.Event(), []

    def handler(e):
        started.set()
        gate.wait()
        seen.append(e.request_id)

    q = EventQueue(handler, "batches", maxsize=4)
    q.put(_event(0))
    assert started.wait(5)  # the worker holds event 0, the queue is empty
    q.put_batch([_event(1), _event(2), _event(3)])  # 3 events waiting
    q.put_batch([_event(4), _event(5)])  # 3 < 4: fits, overshooting to 5
    q.put_batch([_event(6)])  # 5 >= 4: dropped
    q.put_batch([])  # nothing to queue
    assert q.dropped == 1
    gate.set()
    assert q.flush()
    assert seen == [0, 1, 2, 3, 4, 5]
    q.close()


def test_handler_errors_are_counted_and_do_not_kill_the_worker(caplog):
    seen = []

    def handler(e):
        if e.request_id % 2:
            raise RuntimeError("boom")
        seen.append(e.request_id)

    q = EventQueue(handler, "errors")
    for i in range(6):
        q.put(_event(i))
    q.close()
    assert seen == [0, 2, 4]
    assert q.handler_errors == 3
    assert sum("handler raised" in r.getMessage() for r in caplog.records) == 1  # logged once, then counted


def test_close_drains_is_idempotent_and_ignores_later_events():
    seen = []
    q = EventQueue(lambda e: (time.sleep(0.001), seen.append(e.request_id)), "drain")
    for i in range(50):
        q.put(_event(i))
    q.close()
    assert seen == list(range(50))
    assert not q._worker.is_alive()
    q.close()
    q.put(_event(99))
    assert seen == list(range(50))


def test_close_gives_up_on_a_hung_handler_within_its_timeout():
    gate = threading.Event()
    q = EventQueue(lambda e: gate.wait(), "hung", maxsize=1)
    q.put(_event(0))
    q.put(_event(1))
    t0 = time.perf_counter()
    q.close(timeout=0.2)
    assert time.perf_counter() - t0 < 1.0
    gate.set()


def test_bus_attachment_and_detach_on_close():
    bus = EventBus()
    seen = []

    class Collect(Consumer):
        name = "collect"

        def handle(self, event):
            seen.append(event.kind)

    with Collect() as consumer:
        consumer.attach(bus)
        assert bus.active
        bus.emit(FirstToken, request_id=1)
        bus.emit(FirstToken, request_id=2)
    assert not bus.active
    assert seen == ["first_token", "first_token"]
    assert bus.failures(consumer._events.put_batch) == 0
