"""Two profiles on one [run] dir: a start of the second leaves the first one's running store alone.

The console ends a store it finds running in its run dir when none of its own engines runs (a stale store of an
earlier run, holding the port). A second profile with the same run dir (a copy edited for another experiment)
found the first one's store that way: it ended it under the first run's engines and archived its folder.
"""

from __future__ import annotations

import os

from console.cluster import Cluster
from console.fleet import Fleet, NodeState
from console.profile import load_profile
from console.store.tcp import OWNER
from test_cluster import cleanup, make_profile, states, until, workdir  # noqa: F401 (fixtures)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


async def test_a_second_profile_on_the_same_run_dir_leaves_the_first_ones_store_alone(workdir, cleanup):
    first = Cluster(make_profile(workdir), Fleet(run="t"))
    assert await first._store.start() is None
    store_dir = workdir / "runs" / "t" / "_store"
    await until(lambda: (store_dir / "pid").exists() and (store_dir / OWNER).exists(), what="the first store")
    pid = int((store_dir / "pid").read_text())
    assert (store_dir / OWNER).read_text().endswith(f":{os.path.realpath(workdir / 'p.toml')}")

    (workdir / "q.toml").write_text((workdir / "p.toml").read_text())  # the copy: same run dir, same port
    fleet = Fleet(run="t")
    second = Cluster(load_profile(workdir / "q.toml"), fleet)
    await second.start()
    assert states(fleet) == {"node-a": "failed", "node-b": "failed", "node-c": "spare"}
    reason = fleet.nodes["node-a"].reason or ""
    assert "holds a running store started from another profile or machine" in reason and "p.toml" in reason, reason
    assert _alive(pid) and int((store_dir / "pid").read_text()) == pid  # not ended, not archived
    assert not (workdir / "runs" / "t" / "_archive").exists()
    await second.close()
    await first.close()  # its console quits (its watch would restart the store the next start ends)

    # the first profile's own stale store, the profile reached through a symlink: ended, as before
    (workdir / "link.toml").symlink_to(workdir / "p.toml")
    again = Cluster(load_profile(workdir / "link.toml"), fleet := Fleet(run="t"))
    await again.start()
    await until(lambda: fleet.nodes["node-a"].state is NodeState.TRAINING, what="the first profile's start")
    assert int((store_dir / "pid").read_text()) != pid
    await again.stop()
    await again.close()
