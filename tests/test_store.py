"""`python -m engine.store` as a process, and the clear errors around the store: port in use, unreachable, lost."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from engine.mesh import MeshError, connect_store
from engine.telemetry import parse_line
from test_mesh_live import start_node, start_store, wait_for


def _ready(proc: subprocess.Popen, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            return parse_line(line)
    raise AssertionError("store printed no ready line")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_store_serves_then_exits_cleanly_on_signal(procs, port, sig):
    proc = procs.start([sys.executable, "-m", "engine.store", "--host", "127.0.0.1", "--port", str(port)])
    ready = _ready(proc)
    assert ready["type"] == "state" and ready["state"] == "ready" and ready["port"] == port and ready["rank"] == -1
    client = connect_store("127.0.0.1", port, 5.0)
    client.set("zb/x", "1")
    assert client.add("zb/n", 2) == 2 and client.get("zb/x") == b"1"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["state"] == "stopped"


def test_port_in_use_is_one_clear_line_and_exit_2(procs, port):
    first = procs.start([sys.executable, "-m", "engine.store", "--port", str(port)])
    _ready(first)
    t0 = time.monotonic()
    second = procs.run([sys.executable, "-m", "engine.store", "--port", str(port)], timeout=30)
    assert second.returncode == 2 and time.monotonic() - t0 < 30
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in lines[0]
    assert first.poll() is None  # the running store is untouched


def _listening(pid: int, port: int) -> set[str]:
    import psutil

    return {c.laddr.ip for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_store_binds_loopback_by_default_and_warns_when_asked_for_every_interface(procs, port):
    """Whoever reaches the store can steer the run: by default it listens where nobody else can reach it."""
    default = procs.start([sys.executable, "-m", "engine.store", "--port", str(port)])
    _ready(default)
    assert _listening(default.pid, port) == {"127.0.0.1"}
    default.send_signal(signal.SIGTERM)
    assert default.wait(timeout=10) == 0 and "warning" not in default.stderr.read()
    every = procs.start([sys.executable, "-m", "engine.store", "--host", "0.0.0.0", "--port", str(port)])
    _ready(every)
    assert _listening(every.pid, port) <= {"0.0.0.0", "::"}
    every.send_signal(signal.SIGTERM)
    assert every.wait(timeout=10) == 0
    assert "warning: listening on every interface" in every.stderr.read()


def test_an_ipv6_store_serves_and_its_engines_find_their_route_to_it(procs, port):
    """--host ::1 was "not a known host name" (an IPv4 socket), and the gloo groups' address was picked over IPv4.
    (Two engines over ::1 trained and averaged by hand with this: the gloo links take the route's address.)"""
    from engine.mesh.group import _local_address

    proc = procs.start([sys.executable, "-m", "engine.store", "--host", "::1", "--port", str(port)])
    assert _ready(proc)["state"] == "ready"
    assert _listening(proc.pid, port) == {"::1"}
    client = connect_store("::1", port, 5.0)
    client.set("zb/x", "1")
    assert client.get("zb/x") == b"1"
    assert _local_address(client) == "::1"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_unreachable_store_fails_within_its_timeout(port):
    import torch.distributed  # noqa: F401 -- connect_store imports it; a cold import is not the timeout's
    t0 = time.monotonic()
    # the hint starts a store the engines can reach: on their address (a bare --port bound 127.0.0.1 only)
    with pytest.raises(MeshError, match=rf"membership store 127.0.0.1:{port} unreachable within 1.5s .*start it "
                                        rf"with `python -m engine.store --host 127.0.0.1 --port {port}`"):
        connect_store("127.0.0.1", port, 1.5)
    assert time.monotonic() - t0 < 2.5


def test_each_store_backend_is_one_implementation_chosen_by_the_config(port):
    """mesh.store_backend's values and the engine's implementations are the same set (a value added to the config
    without its StoreBackend fails here, not at a node's start), and open_store goes through the one the config
    names: the tcp one dials store_addr:store_port."""
    from typing import get_args

    from engine.config import MeshConfig
    from engine.mesh.connect import BACKENDS, EtcdBackend, TcpBackend, open_store, store_backend

    assert sorted(get_args(MeshConfig.model_fields["store_backend"].annotation)) == sorted(BACKENDS)
    tcp = MeshConfig(store_addr="127.0.0.1", store_port=port, store_timeout=1.0)
    etcd = MeshConfig(store_backend="etcd", etcd_endpoints=["127.0.0.1:1"], etcd_insecure=True)
    assert type(store_backend(tcp)) is TcpBackend and type(store_backend(etcd)) is EtcdBackend
    with pytest.raises(MeshError, match=rf"membership store 127.0.0.1:{port} unreachable within 1s"):
        open_store(tcp)


def test_unreachable_store_node_exits_with_one_error_line(procs, port):
    node = start_node(procs, port, "a")
    assert node.proc.wait(timeout=60) == 3
    assert "ERROR membership store 127.0.0.1" in node.err and "unreachable" in node.err


def test_lost_store_mid_run_is_a_clear_error_within_bounded_time(procs, port):
    store = start_store(procs, port)
    node = start_node(procs, port, "a", "--steps", "500", "--step-s", "0.1")
    wait_for(lambda: len(node.committed()) >= 2, 60, "a running", [node, store])
    store.proc.kill()
    t0 = time.monotonic()
    # the heartbeat thread notices within a beat; the error line comes at the node's next store call
    wait_for(lambda: "ERROR node a: " in node.err, 30, "the node's error line", [node])
    assert time.monotonic() - t0 < 30
    assert "lost the membership store" in node.err, node.err[-2000:]
    assert node.proc.wait(timeout=60) == 3


def _contract(store) -> list:
    """Every store operation the mesh uses, in the forms it uses them (engine/store/memory.py lists them)."""
    out = [store.add("c", 1), store.add("c", 0), store.add("c", -2)]
    store.set("k", "v")
    out += [store.get("k"), store.check(["k"]), store.check(["k", "absent"])]
    out += [store.compare_set("new", "", "x"), store.get("new")]  # absent, expected "": set
    out += [store.compare_set("absent2", "y", "z"), store.check(["absent2"])]  # absent, expected set: nothing
    out += [store.compare_set("k", "v", "w"), store.compare_set("k", "nope", "u"), store.get("k")]
    out += [store.compare_set("read", "", ""), store.check(["read"]), store.compare_set("k", "", "")]  # the read
    store.multi_set(["m1", "m2"], ["1", "2"])
    out += [store.multi_get(["m1", "m2", "k"])]
    store.wait(["m1", "m2"])
    before = store.num_keys()
    out += [store.delete_key("m1"), store.delete_key("m1"), store.num_keys() - before]
    return out


def test_memory_store_answers_every_op_of_the_mesh_like_tcpstore(port):
    """MemoryStore stands in for TCPStore in the protocol tests and the scale benchmark; any other backend (etcd)
    must answer these the same way."""
    from datetime import timedelta

    import torch.distributed as dist

    from engine.mesh import MemoryStore
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False)
    assert _contract(MemoryStore()) == _contract(client)
    del client, server
