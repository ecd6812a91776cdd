"""Makes a stalled collective visible: which ranks this one waits for, every 30 seconds.

gloo and NCCL wait in silence until the collective's timeout. A thread of each worker leaves
a heartbeat (its step, and a beat count) in the job's store every :data:`BEAT` seconds, over a
connection of its own with a short timeout, and reads the others'. When this rank's step has
not moved for :data:`~.join.SAY_EVERY` seconds and some rank is behind or silent, the node's
first worker says so, every :data:`~.join.SAY_EVERY` seconds::

    rank 0 (node 0, 192.0.2.1): step 12 has waited 30 s for rank 1 (node 1, 192.0.2.2),
    silent for 31 s (last at step 11)

A slow step that every rank is in together says nothing. The silent ranks are what a timeout
then names (:func:`silent`).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from . import join
from .env import DistEnv

__all__ = ["Watchdog", "silent", "BEAT"]

#: seconds between two heartbeats
BEAT = 5.0
_silent: list[int] = []  # ranks silent past SAY_EVERY, as the last look saw them


def silent() -> list[int]:
    """The ranks whose heartbeat stopped for :data:`~.join.SAY_EVERY` s or more."""
    return list(_silent)


class Watchdog:
    """Heartbeats under the store prefix of this process group; :meth:`step` after each
    optimizer step; :meth:`close` stops it."""

    def __init__(self, env: DistEnv, prefix: str, talk: bool):
        self.env, self.prefix, self.talk = env, prefix, talk
        self.at_step, self.moved = 0, time.monotonic()
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._said = 0.0
        self._done = threading.Event()
        # its own connection, made now while the store answers: made again after a failure,
        # a client's connect attempts fill stderr with torch's warnings. Without one (a store
        # that did not answer in time), no heartbeats: the collectives' timeout still holds.
        try:
            self._store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                        timeout=timedelta(seconds=BEAT), wait_for_workers=False)
        except Exception:
            return
        self._thread = threading.Thread(target=self._run, name="tandem-watchdog", daemon=True)
        self._thread.start()

    def step(self, step: int) -> None:
        self.at_step, self.moved = step, time.monotonic()

    def close(self) -> None:
        self._done.set()
        _silent.clear()

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        beats = 0
        others = [r for r in range(self.env.world_size) if r != self.env.rank]
        where = (self.env.master_addr, self.env.master_port)
        while not self._done.wait(BEAT):
            beats += 1
            try:
                # a plain connect first: a store operation that times out makes torch print
                # two warnings each time, and a partition would make one every beat
                socket.create_connection(where, timeout=BEAT).close()
                self._store.set(f"{self.prefix}/beat/{self.env.rank}", f"{self.at_step} {beats}")
                keys = [f"{self.prefix}/beat/{r}" for r in others]
                here = [r for r, key in zip(others, keys) if self._store.check([key])]
                values = self._store.multi_get([keys[others.index(r)] for r in here])
            except Exception:  # the store is out of reach (a partition): say that
                self._say(f"the other ranks: the job's store at {where[0]}:{where[1]} does not "
                          "answer (node 0 out of reach?)")
                continue
            beat = dict(zip(here, values))
            self._look({r: beat.get(r, b"") for r in others})

    def _look(self, beats: dict[int, bytes]) -> None:
        now = time.monotonic()
        behind = []
        _silent.clear()
        for rank, value in beats.items():
            last, since = self._seen.get(rank, (b"", now))
            if value != last:
                self._seen[rank] = (value, now)
                since = now
            step = int(value.split()[0]) if value else 0
            quiet_for = now - since
            if quiet_for >= join.SAY_EVERY:
                _silent.append(rank)
                behind.append(f"{join.peer_name(rank)}, silent for {quiet_for:.0f} s"
                              + (f" (last at step {step})" if value else ""))
            elif not value:
                behind.append(f"{join.peer_name(rank)}, not heard from yet")
            elif step < self.at_step:
                behind.append(f"{join.peer_name(rank)}, at step {step}")
        if behind:
            self._say(", ".join(behind))

    def _say(self, what: str) -> None:
        now = time.monotonic()
        waited = now - self.moved
        if not self.talk or waited < join.SAY_EVERY or now - self._said < join.SAY_EVERY:
            return
        self._said = now
        print(f"{join.peer_name(self.env.rank)}: step {self.at_step + 1} has waited "
              f"{waited:.0f} s for {what}", file=sys.stderr, flush=True)
