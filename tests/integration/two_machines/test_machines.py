"""The harness beyond two nodes, against traffic made by hand: three namespaces on a bridge
reach each other, and the counter on node 0's port sees the store requests a client on node 2
made (tests/support/two_machines.py's Machines)."""

import sys

import pytest
from two_machines import Machines, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

PORT = 29871
SERVER = ("import sys, time, datetime, torch.distributed as d; "
          f"s = d.TCPStore('192.0.2.1', {PORT}, is_master=True, wait_for_workers=False, "
          "timeout=datetime.timedelta(seconds=60)); print('ready', flush=True); time.sleep(60)")
CLIENT = ("import datetime, torch.distributed as d; "
          f"c = d.TCPStore('192.0.2.1', {PORT}, is_master=False, wait_for_workers=False, "
          "timeout=datetime.timedelta(seconds=60)); [c.add('k', 1) for _ in range(20)]; "
          "print(c.add('k', 0))")


def test_three_nodes_on_a_bridge_and_the_requests_counted_at_node_0(tmp_path):
    with Machines(tmp_path, nodes=3) as net:
        assert net.bridge and net.addrs == ("192.0.2.1", "192.0.2.2", "192.0.2.3")
        net.count_to(0, PORT)
        server = net.start(0, [sys.executable, "-c", SERVER], {})
        assert server.stdout.readline().strip() == "ready", server.stderr.read()
        before = net.counted()
        client = net.start(2, [sys.executable, "-c", CLIENT], {})
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0 and out.strip() == "20", err
        seen = net.counted() - before
        # 21 adds and the client's handshake, one connection, nothing else at that port
        assert seen.connections == 1, seen
        assert 21 <= seen.requests <= 25, seen
        assert seen.packets >= seen.requests + seen.connections
