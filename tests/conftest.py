"""Fixtures shared by every test module: free ports, and processes that always end (by process group)."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from procs import ProcessTracker, free_port  # noqa: E402


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def sshd():
    """A real OpenSSH sshd on loopback whose host key is trusted (tests/sshd.py), closed after the test."""
    from sshd import Sshd

    server = Sshd.start_new()
    server.trust()
    yield server
    server.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)  # the procs fixture reads whether its test failed


@pytest.fixture
def procs(request):
    """Start processes through this; every one still running at teardown is killed with its process group. A
    failed test first prints those processes, with their state and what each waits on."""
    tracker = ProcessTracker()
    yield tracker
    try:
        call = getattr(request.node, "report_call", None)
        if call is not None and call.failed:
            running = tracker.describe()
            if running:
                print(f"processes of this test still running:\n{running}")
    finally:
        tracker.kill_all()


def pytest_collection_modifyitems(items):
    for item in items:  # every async test closes the console clusters it made (below)
        if inspect.iscoroutinefunction(getattr(item, "function", None)):
            item.fixturenames.append("_close_clusters")


@pytest.fixture
async def _close_clusters(monkeypatch):
    """Every console Cluster an async test makes is closed when the test ends, also when it fails halfway. Left
    open, its watchers are still running when the test's event loop is torn down, and asyncio's teardown cancels
    every task at once: a watcher cancelled while it spawns a command then waits forever for that command's exit
    (CPython gh-103847, gh-125502), and the suite hangs instead of reporting the failure. Cluster.close cancels
    only its own tasks, and what hangs is the teardown's cancelling of the subprocess transport's own task."""
    from console.cluster import Cluster

    made: list[Cluster] = []
    init = Cluster.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Cluster, "__init__", tracked)
    yield
    for cluster in made:
        if not cluster._hosts.closed:
            await cluster.close()


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    # tiny models on 2 cores: more intra-op threads only add contention between test processes
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory):
    """One real 3-member etcd cluster (TLS, client certificates) for the whole session; tests use their own key
    prefix. A test that kills members starts its own cluster instead."""
    import shutil
    import tempfile

    from etcd_cluster import EtcdTestCluster

    # the Raft log on tmpfs: etcd fsyncs every write, and the protocol scenarios make thousands
    folder = Path(tempfile.mkdtemp(prefix="zb-etcd-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    cluster = EtcdTestCluster(folder).start()
    yield cluster
    cluster.stop()
    shutil.rmtree(folder, ignore_errors=True)
