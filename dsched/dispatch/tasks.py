"""Chunks as Dask tasks: one task per chunk, or several chunks of a device in one task (a *pack*).

This is the transport for devices without a feed (:mod:`dsched.dispatch.feeds`):
remote devices, runs with a ``timeout`` (Dask cancels tasks one by one), and
clusters with feeds turned off. A chunk requests as much of its device's Dask
resource as it has items, which is how the worker bounds the items in flight.

Chunks of one device chosen in the same round travel as one pack
(:func:`~dsched.worker.chunk.run_pack`) when there are more of them than the
device has threads: the worker runs them one after another and publishes each
chunk's completion as it happens, on the run's event topic, so accounting,
progress, traces and failures stay per chunk while Dask's per-task cost is paid
once per pack.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import dask

from dsched.devices.device import device_resource
from dsched.names import ITEMS_ANNOTATION
from dsched.worker.chunk import run_chunk, run_pack

__all__ = ["TaskSender", "distinct"]


def distinct(futures) -> list:
    """``futures`` without repeats (the chunks of a pack share one) or ``None``s, in order."""
    return list({f.key: f for f in futures if f is not None}.values())


class TaskSender:
    """Sends one run's chunks to the cluster as tasks and packs, and reads their outcomes back.

    Parameters
    ----------
    client : distributed.Client
    program : ChunkProgram
        What runs on the worker for each chunk.
    run_id : str
        The run's key prefix: task keys are ``<run_id>-<first chunk>[-pack<n>][-retry<k>]``.
    watch : DeviceWatch
        Caps a task's resource request at what the device's workers hold.
    notify : callable
        ``notify((key, position, ok, start, stop))`` for each chunk event of a pack,
        called on the client's event loop.
    learns : bool
        Whether the policy learns from chunk timings: then even a single chunk goes
        as a pack, which publishes its time as it finishes.
    """

    def __init__(self, client, program, run_id, watch, notify, learns=False):
        self.client, self.program, self.run_id, self.watch, self.notify = client, program, run_id, watch, notify
        self.pack = bool(dask.config.get("dsched.batched-submission", True))
        self.learns = learns
        self.packs = set()  # keys of tasks that are packs
        self.topic = f"{run_id}-chunks"
        self.subscribed = False  # to the packs' events, at the first pack
        self.retries = itertools.count(1)

    def packs_chunks(self, n_chunks, lanes, packable) -> bool:
        """Whether ``n_chunks`` chunks for a device with ``lanes`` threads go as packs (one per lane)."""
        return self.pack and packable and n_chunks > lanes

    def send(self, device, records, works, slots, retry=False) -> list:
        """One task for the chunks ``records``: a pack if there are several (or the policy learns); a future per chunk."""
        suffix = f"-retry{next(self.retries)}" if retry else ""
        if len(records) > 1 or (self.pack and self.learns):
            return self._send_pack(device, records, works, slots, suffix)
        return self._send_each(device, records, works, slots, suffix)

    def _send_pack(self, device, records, works, slots, suffix) -> list:
        # The pack requests its items (the scheduler admitted them all), capped by what the
        # worker holds: its chunks run one after another.
        items = sum(r.size for r in records)
        self._subscribe()  # sent before the pack, on the same stream: no event can come before it
        with dask.annotate(**{ITEMS_ANNOTATION: items}):  # for observers: the request may be capped
            [future] = self.client.map(
                run_pack, [self.program], [device], [works], [slots], [self.topic],
                key=[f"{self.run_id}-{records[0].index}-pack{len(records)}{suffix}"],
                resources={device_resource(device): self.watch.request(device, items)}, pure=False)
        self.packs.add(future.key)
        return [future] * len(records)

    def _send_each(self, device, records, works, slots, suffix) -> list:
        # One client.map per chunk size: a chunk requests as much of its device's
        # resource as it has items, which is how the worker bounds items in flight.
        futures = [None] * len(records)
        by_size = defaultdict(list)
        for position, record in enumerate(records):
            by_size[record.size].append(position)
        for size, positions in by_size.items():
            request = self.watch.request(device, size)
            annotations = {ITEMS_ANNOTATION: size} if request != size else {}
            with dask.annotate(**annotations):
                mapped = self.client.map(
                    run_chunk, [self.program] * len(positions), [device] * len(positions),
                    [works[p] for p in positions], [slots[p] for p in positions],
                    key=[f"{self.run_id}-{records[p].index}{suffix}" for p in positions],
                    resources={device_resource(device): request}, pure=False)
            for p, future in zip(positions, mapped):
                futures[p] = future
        return futures

    def outcomes(self, future, value):
        """``(worker address, [(ok, value, start, stop)] per chunk)`` of a task's value."""
        if future.key in self.packs:
            return value
        result, address, start, stop = value
        return address, [(True, result, start, stop)]

    def _subscribe(self):
        """Hear the packs' per-chunk events. Not before a pack is sent: a run whose chunks all go to feeds
        sends no message before its feeds' tasks, which the client's batched stream would otherwise hold
        back for its interval (10 ms)."""
        if not self.subscribed:
            notify = self.notify  # the handler holds the callback only, never the run and its outputs
            self.client.subscribe_topic(self.topic, lambda event: notify(event[1]))  # on the client's event loop
            self.subscribed = True

    def close(self):
        if self.subscribed:
            self.client.unsubscribe_topic(self.topic)
            # distributed's unsubscribe_topic tells the scheduler but keeps the handler (2026.8): drop it, or
            # every run's handler would stay in the client for good.
            getattr(self.client, "_event_handlers", {}).pop(self.topic, None)
