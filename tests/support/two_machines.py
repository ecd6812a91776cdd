"""Two machines on this one: two Linux network namespaces joined by a veth pair (TEST-NET-1
addresses only, no route anywhere else), each node with its own working directory and the
host name resolving to 127.0.0.1, as on many container and cloud images.

``with TwoMachines() as net:`` makes them; ``net.start(node, argv)`` runs a command on a node
(in its namespace and directory); ``net.shape(rate)`` limits the link with ``tc ... tbf``;
``net.cut(node)``/``net.mend(node)`` take a node's link down and up. On leaving, every process
started is killed by its pid (its whole process group) and the namespaces are deleted, also
when the test failed; a harness killed before it could do so is swept by the next one
(:func:`sweep`). Needs root and iproute2: :func:`unavailable` says why not, for a skip.

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

__all__ = ["TwoMachines", "unavailable", "ADDRS"]

#: node 0's and node 1's address (TEST-NET-1, RFC 5737)
ADDRS = ("192.0.2.1", "192.0.2.2")


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


class TwoMachines:
    """Two network namespaces ``node 0`` and ``node 1``, with directories under ``root``."""

    def __init__(self, root):
        tag = uuid.uuid4().hex[:6]
        # the pid in the name lets a later harness delete what a killed one left (sweep)
        self.ns = (f"tdm{os.getpid()}-{tag}a", f"tdm{os.getpid()}-{tag}b")
        self.links = (f"tv{tag}a", f"tv{tag}b")
        self.dirs = tuple(os.path.join(str(root), f"node{i}") for i in range(2))
        self.procs: list[subprocess.Popen] = []

    # -- the network ------------------------------------------------------------------------
    def __enter__(self) -> "TwoMachines":
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
        _ip("link", "add", self.links[0], "netns", self.ns[0], "type", "veth",
            "peer", "name", self.links[1], "netns", self.ns[1])
        for i, ns in enumerate(self.ns):
            _ip("addr", "add", f"{ADDRS[i]}/24", "dev", self.links[i], ns=ns)
            _ip("link", "set", self.links[i], "up", ns=ns)

    def shape(self, rate: str | None) -> None:
        """Limit each direction of the link to ``rate`` (``"100mbit"``); None: unshaped."""
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
        for ns in self.ns:
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
