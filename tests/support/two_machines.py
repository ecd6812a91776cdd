"""Two (or more) machines on this one: Linux network namespaces, each node with its own
working directory and the host name resolving to 127.0.0.1, as on many container and cloud
images. Two nodes are joined by a veth pair; more (or ``bridge=True``) each by a veth to a
bridge in a namespace of its own, the switch (TEST-NET-1 addresses only, no route anywhere
else).

``with TwoMachines(root) as net:`` (or ``Machines(root, nodes=4)``) makes them;
``net.start(node, argv)`` runs a command on a node (in its namespace and directory);
``net.shape(rate)`` limits each node's link with ``tc ... tbf``; ``net.cut(node)``/
``net.mend(node)`` take a node's link down and up; on a bridge, ``net.count_to(node, port)``
counts what reaches ``node``'s TCP ``port`` (:meth:`Machines.counted`). On leaving, every
process started is killed by its pid (its whole process group) and the namespaces are
deleted, also when the test failed; a harness killed before it could do so is swept by the
next one (:func:`sweep`). Needs root and iproute2: :func:`unavailable` says why not, for a
skip.

Only 192.0.2.0/24 is used: the namespaces have no default route, so nothing leaves them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from typing import NamedTuple

__all__ = ["Machines", "TwoMachines", "Counted", "unavailable", "ADDRS", "MAX_NODES"]

MAX_NODES = 26  # one letter a namespace
#: node i's address (TEST-NET-1, RFC 5737): node 0 192.0.2.1, node 1 192.0.2.2, ...
ADDRS = tuple(f"192.0.2.{i + 1}" for i in range(MAX_NODES))


class Counted(NamedTuple):
    """What reached a node's port (:meth:`Machines.counted`), summed over its paths in.
    ``requests``: TCP segments that end a write (PSH), one per request of a store client;
    ``connections``: SYNs; ``packets``/``bytes``: everything to the port, ACKs included."""

    requests: int
    connections: int
    packets: int
    bytes: int

    def __sub__(self, other: "Counted") -> "Counted":
        return Counted(*(a - b for a, b in zip(self, other)))


def unavailable() -> str | None:
    """Why the harness cannot run here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = f"tdmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sweep() -> None:
    """Delete the namespaces (and end their processes) that a harness left when it was killed
    before it could clean up: those whose creating process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        match = re.fullmatch(r"tdm(\d+)-\w+", name)
        if not match or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _tc(ns: str, *args: str) -> str:
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


class Machines:
    """``nodes`` network namespaces ``node 0`` .. ``node N-1``, with directories under
    ``root``; a veth pair between two, a bridge for more (``bridge``: None decides so)."""

    def __init__(self, root, nodes: int = 2, bridge: bool | None = None):
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes}: expected 2 to {MAX_NODES}")
        self.bridge = nodes > 2 if bridge is None else bridge
        if not self.bridge and nodes != 2:
            raise ValueError(f"nodes={nodes} without a bridge: a veth pair joins 2")
        tag = uuid.uuid4().hex[:6]
        letters = [chr(ord("a") + i) for i in range(nodes)]
        # the pid in the name lets a later harness delete what a killed one left (sweep)
        self.ns = tuple(f"tdm{os.getpid()}-{tag}{c}" for c in letters)
        self.links = tuple(f"tv{tag}{c}" for c in letters)  # each node's own interface
        self.switch = f"tdm{os.getpid()}-{tag}sw" if self.bridge else None
        self._switch_ends = tuple(f"ts{tag}{c}" for c in letters)  # the far end of each link
        self.dirs = tuple(os.path.join(str(root), f"node{i}") for i in range(nodes))
        self.addrs = ADDRS[:nodes]
        self.procs: list[subprocess.Popen] = []
        self._counting: list[tuple[str, str]] = []  # (namespace, device) with counters

    # -- the network ------------------------------------------------------------------------
    def __enter__(self) -> "Machines":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        sweep()
        host = socket.gethostname()
        for i, ns in enumerate(self.ns):
            os.makedirs(self.dirs[i], exist_ok=True)
            _ip("netns", "add", ns)
            # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: the host name is
            # 127.0.0.1 inside, as on many container images
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost {host}\n")
            _ip("link", "set", "lo", "up", ns=ns)
        if self.bridge:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for link, end, ns in zip(self.links, self._switch_ends, self.ns):
                _ip("link", "add", link, "netns", ns, "type", "veth", "peer", "name", end,
                    "netns", self.switch)
                _ip("link", "set", end, "master", "br0", ns=self.switch)
                _ip("link", "set", end, "up", ns=self.switch)
        else:
            _ip("link", "add", self.links[0], "netns", self.ns[0], "type", "veth",
                "peer", "name", self.links[1], "netns", self.ns[1])
        for i, ns in enumerate(self.ns):
            _ip("addr", "add", f"{ADDRS[i]}/24", "dev", self.links[i], ns=ns)
            _ip("link", "set", self.links[i], "up", ns=ns)

    def shape(self, rate: str | None) -> None:
        """Limit what each node sends to ``rate`` (``"100mbit"``); None: unshaped."""
        for ns, link in zip(self.ns, self.links):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", link,
                            "root"], capture_output=True)
            if rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link,
                                "root", "tbf", "rate", rate, "burst", "256kb", "latency",
                                "400ms"], check=True, capture_output=True)

    def cut(self, node: int) -> None:
        """Take node ``node``'s link down (a partition: its packets go nowhere)."""
        _ip("link", "set", self.links[node], "down", ns=self.ns[node])

    def mend(self, node: int) -> None:
        _ip("link", "set", self.links[node], "up", ns=self.ns[node])

    # -- counting what reaches a port -------------------------------------------------------
    def count_to(self, node: int, port: int) -> None:
        """Count the TCP segments that reach ``node``'s ``port`` from now on, on both paths
        in: its loopback (its own processes) and the switch's end of its link (the other
        nodes); read them with :meth:`counted`. tc classes, as this kernel has no netfilter
        counters: an htb whose classes take, by u32 match, the segments to ``port`` that end
        a write (PSH: one per store request), those that open a connection (SYN) and the
        rest; everything else passes by a fourth class. Needs the bridge (on a veth pair the
        path in is the other node's link, which :meth:`shape` uses)."""
        if not self.bridge:
            raise RuntimeError("count_to needs Machines(..., bridge=True)")
        for ns, dev in ((self.ns[node], "lo"), (self.switch, self._switch_ends[node])):
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "4")
            for c in range(1, 5):
                _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{c}", "htb",
                    "rate", "100gbit", "quantum", "200000")
            to_port = ["match", "ip", "dport", str(port), "0xffff"]
            # byte 13 of the TCP header (at 33: no IP options here) holds the flags
            for prio, flag, cls in ((1, "0x08", 1), (2, "0x02", 2), (3, None, 3)):
                match = [*to_port, *(["match", "u8", flag, flag, "at", "33"] if flag else [])]
                _tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                    str(prio), "u32", *match, "flowid", f"1:{cls}")
            self._counting.append((ns, dev))

    def counted(self) -> Counted:
        """What reached the port of :meth:`count_to` so far (zeros before it)."""
        sums = {c: [0, 0] for c in ("1:1", "1:2", "1:3")}
        for ns, dev in self._counting:
            shown = _tc(ns, "-s", "class", "show", "dev", dev)
            for cls, sent, pkts in re.findall(r"class htb (1:\d).*?\n\s*Sent (\d+) bytes (\d+) "
                                              r"pkt", shown):
                if cls in sums:
                    sums[cls][0] += int(sent)
                    sums[cls][1] += int(pkts)
        return Counted(requests=sums["1:1"][1], connections=sums["1:2"][1],
                       packets=sum(p for _, p in sums.values()),
                       bytes=sum(b for b, _ in sums.values()))

    # -- processes --------------------------------------------------------------------------
    def start(self, node: int, argv: list[str], env: dict, **kw) -> subprocess.Popen:
        """Run ``argv`` on ``node`` in its directory; output captured as text (unless ``kw``
        says otherwise). Its own process group, so that :meth:`close` ends all it started."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[node], *argv], env=env,
                                cwd=self.dirs[node], text=True, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # torchrun's workers run in sessions of their own and hold their launcher's pipes:
        # they go first, or reading the pipes would wait for them
        self.kill_all()
        for proc in self.procs:
            try:
                proc.communicate(timeout=30)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for ns in (*self.ns, *([self.switch] if self.switch else [])):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def kill_all(self) -> None:
        """Every process inside the namespaces, by its pid (workers included)."""
        for _ in range(20):
            pids = []
            for ns in self.ns:
                out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                     text=True).stdout.split()
                pids += [int(p) for p in out]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)


class TwoMachines(Machines):
    """Two network namespaces ``node 0`` and ``node 1`` joined by a veth pair, with
    directories under ``root``."""

    def __init__(self, root):
        super().__init__(root, nodes=2)
