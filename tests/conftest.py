"""Fixtures shared by every test module: free ports, and processes that always end (by process group)."""

from __future__ import annotations

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
