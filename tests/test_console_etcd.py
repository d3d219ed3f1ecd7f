"""The console on the etcd backend: a profile's [store] asks for a 3-member etcd on three of its hosts; the console
makes the run's CA, starts the members detached (data under the run dir), hands each engine its client certificate
(0600), the engines train on etcd, the header shows the members up and the leader, and `stop` ends the members.
Real etcd, real engines, LocalTransport."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from console.cluster import Cluster, StartRefused
from console.etcd import engine_store_overrides, member_argv, plan_members
from console.fleet import Fleet, HostState, NodeState
from console.profile import ProfileError, load_profile, parse_profile
from console.transport import TransportError
from console.widgets.cells import summary_text
from procs import free_port, kill_recorded_groups
from test_cluster import kill_everything, states, until

ROOT = Path(__file__).resolve().parent.parent

PROFILE = """\
[run]
name = "etcd-e2e"
dir = "{run_dir}"

[store]
backend = "etcd"
etcd_hosts = ["node-a", "node-b", "node-c"]
etcd_client_port = {client}
etcd_peer_port = {peer}

[engine]
config = "configs/debug-diloco.toml"

[engine.overrides]
"data.path" = "corpus/stdlib_docstrings.jsonl"
"inner.device" = "cpu"
"train.max_steps" = 400
"train.micro_batch_size" = 2
"train.batch_size" = 2
"data.seq_len" = 32
"train.log_interval" = 1
"diloco.inner_steps" = 3
"diloco.min_nodes" = 2
"mesh.heartbeat_interval" = 0.5
"mesh.heartbeat_timeout" = 3.0

[console]
poll_interval = 0.5
stop_timeout = 30

[defaults]
transport = "local"
python = "{python}"
workdir = "{root}"
env = {{ OMP_NUM_THREADS = "1" }}

[hosts.node-a]

[hosts.node-b]

[hosts.node-c]
standby = true
"""


def _port_block(n: int) -> int:
    """A base port whose next n-1 ports are free too (member i uses base + 2i)."""
    for _ in range(50):
        base = free_port()
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise AssertionError("no free block of ports")


def end_everything(tmp_path: Path, run: Path) -> None:
    """Whatever a test left: its engines and store, and the etcd members (detached: their own process groups)."""
    kill_everything(tmp_path)
    kill_recorded_groups(run.glob("_etcd/*/pid"))


def _profile(tmp_path: Path):
    base = _port_block(6)
    path = tmp_path / "etcd.toml"
    path.write_text(PROFILE.format(run_dir=tmp_path / "run", client=base, peer=base + 1, python=sys.executable,
                                   root=ROOT))
    return load_profile(path)


def test_profile_rules_and_engine_overrides(tmp_path):
    profile = _profile(tmp_path)
    members = plan_members(profile)
    assert [(m.name, m.address) for m in members] == [("node-a", "127.0.0.1"), ("node-b", "127.0.0.1"),
                                                      ("node-c", "127.0.0.1")]
    assert members[1].client_port == members[0].client_port + 2 and members[0].peer_port == members[0].client_port + 1
    over = engine_store_overrides(profile, "node-b")
    assert over["mesh.store_backend"] == "etcd" and over["mesh.etcd_prefix"] == "zeroband/etcd-e2e/"
    assert over["mesh.etcd_endpoints"] == ",".join(m.endpoint for m in members)
    assert over["mesh.etcd_cert"] == f"{tmp_path / 'run'}/node-b/pki/client.crt"
    argv = member_argv("etcd", members[0], members, data_dir="d", pki_dir="p", token="t")
    assert "--client-cert-auth" in argv and "--peer-client-cert-auth" in argv
    assert argv[argv.index("--listen-client-urls") + 1] == f"https://127.0.0.1:{members[0].client_port}"
    text = (tmp_path / "etcd.toml").read_text()
    with pytest.raises(ProfileError, match=r"etcd.toml:\d+: store.etcd_hosts: an odd number"):
        parse_profile(text.replace('"node-b", "node-c"]', '"node-b"]'), str(tmp_path / "etcd.toml"))
    with pytest.raises(ProfileError, match=r"store.etcd_hosts: 'node-z' is not a host"):
        parse_profile(text.replace('"node-c"]', '"node-z"]'), "etcd.toml")
    with pytest.raises(ProfileError, match="etcd_endpoints needs etcd_ca, etcd_cert and etcd_key"):
        parse_profile(text.replace('etcd_hosts = ["node-a", "node-b", "node-c"]',
                                        'etcd_endpoints = ["10.0.0.1:2379"]'), "etcd.toml")
    lab = (ROOT / "profiles" / "lab.toml").read_text()  # the shipped example, its etcd lines uncommented
    on = parse_profile(lab.replace('# backend = "etcd"', 'backend = "etcd"').replace("# etcd_hosts", "etcd_hosts"),
                       "lab.toml")
    assert on.store.backend == "etcd" and [m.endpoint for m in plan_members(on)] == [
        "10.0.0.1:2379", "10.0.0.2:2381", "10.0.1.3:2383"]
    with pytest.raises(ProfileError, match="not both"):
        parse_profile(text.replace("[engine]\n", 'etcd_endpoints = ["a:1"]\n\n[engine]\n'), "etcd.toml")
    # hosts named only by ~/.ssh/config aliases: the members bind and are dialled at each alias's HostName (etcd
    # refused the alias: "expected IP in URL for binding", and only this machine could resolve it)
    config = tmp_path / "ssh_config"
    config.write_text("".join(f"Host zb-{i}\n  HostName 10.9.0.{i}\n" for i in (1, 2, 3)))
    aliased = parse_profile(
        f'[run]\nname = "al"\n[store]\nbackend = "etcd"\netcd_hosts = ["h1", "h2", "h3"]\n[engine]\n'
        f'config = "{ROOT}/configs/debug-diloco.toml"\n[defaults]\nssh_config = "{config}"\n'
        + "".join(f'[hosts.h{i}]\nssh_alias = "zb-{i}"\n' for i in (1, 2, 3)), str(tmp_path / "al.toml"))
    assert [m.client_url for m in plan_members(aliased)] == [
        f"https://10.9.0.{i}:{2379 + 2 * (i - 1)}" for i in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_console_starts_etcd_hands_certificates_trains_and_stops(tmp_path):
    profile = _profile(tmp_path)
    fleet = Fleet(run="etcd-e2e")
    cluster = Cluster(profile, fleet)
    run = tmp_path / "run"
    try:
        await cluster.start()
        await until(lambda: all(fleet.nodes[n].state is NodeState.TRAINING and (fleet.nodes[n].outer_step or 0) >= 1
                                for n in ("node-a", "node-b")), timeout=240,
                    what=f"training on etcd: {states(fleet)} {[fleet.nodes[n].reason for n in fleet.nodes]}")
        await until(lambda: (fleet.store_status or "").startswith("etcd 3/3 up, leader node-"), timeout=30,
                    what=f"the header's store health: {fleet.store_status}")
        assert " | etcd 3/3 up, leader node-" in summary_text(fleet.summary())
        for node in ("node-a", "node-b"):  # the client certificate: in the node's folder, owner-only
            pki = run / node / "pki"
            assert stat.S_IMODE(pki.stat().st_mode) == 0o700
            assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in pki.iterdir()} == dict.fromkeys(
                ("ca.crt", "client.crt", "client.key"), 0o600)
        for member in ("node-a", "node-b", "node-c"):
            assert (run / "_etcd" / member / "data" / "member").is_dir()  # the Raft data under the run dir
            assert stat.S_IMODE((run / "_etcd" / member / "pki" / "member.key").stat().st_mode) == 0o600
        key = (tmp_path / ".zeroband-pki" / "etcd-e2e" / "client.key").read_bytes()
        for entry in Path("/proc").iterdir():  # no key material in any command line
            if entry.name.isdigit():
                try:
                    assert key.splitlines()[1] not in (entry / "cmdline").read_bytes()
                except OSError:
                    continue
        # a second console attaches (status, --attach): the run's store is etcd, not a TCP store found dead (it
        # said "STORE DOWN: not running while engines are", and a steering console started a stray TCP store)
        for steer in (False, True):
            other = Fleet(run="etcd-e2e")
            watcher = Cluster(profile, other)
            try:
                await watcher.attach(steer_store=steer)
                await until(lambda: (other.store_status or "").startswith("etcd 3/3 up"), timeout=30,
                            what=f"the attached console's store health: {other.store_status}")
                assert other.store.state not in ("down", "restarting"), (steer, other.store.state, other.store.reason)
                assert not (run / "_store" / "pid").exists()
            finally:
                await watcher.close()
        pids = [int((run / "_etcd" / m / "pid").read_text()) for m in ("node-a", "node-b", "node-c")]
        assert (await cluster.stop()).ok
        for pid in pids:  # stop ends the members too
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}"):
                    break
                await asyncio.sleep(0.1)
            assert not os.path.exists(f"/proc/{pid}"), f"etcd member {pid} outlived stop"
    finally:
        await cluster.close()
        end_everything(tmp_path, run)


async def test_an_etcd_that_cannot_start_fails_every_node_with_its_reason(tmp_path):
    path = tmp_path / "etcd.toml"
    profile = _profile(tmp_path)
    path.write_text(path.read_text().replace("[engine]\n", 'etcd_binary = "/nonexistent/etcd"\n\n[engine]\n', 1))
    profile = load_profile(path)
    fleet = Fleet(run="etcd-e2e")
    cluster = Cluster(profile, fleet)
    try:
        with pytest.raises(StartRefused) as refused:  # at once, before anything starts (issue 41)
            await asyncio.wait_for(cluster.start(), 30)
        said = f"{path}:11: store.etcd_binary: /nonexistent/etcd is not found on node-a"
        assert refused.value.lines[0].startswith(said) and len(refused.value.lines) == 3  # one per member host
        for node in ("node-a", "node-b"):
            assert fleet.nodes[node].state is HostState.FAILED
            assert fleet.nodes[node].reason == refused.value.lines[0]
        assert not (tmp_path / "run").exists()  # nothing started, nothing written
    finally:
        await cluster.close()
        kill_everything(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(200)
async def test_members_left_running_by_an_earlier_console_do_not_block_the_next_start(tmp_path):
    """Defect: a run ended with "leave running" keeps its etcd members. The next start's preflight found their
    ports taken ("cannot listen ... EADDRINUSE") before the start could end them, and nothing started. A start ends
    members left by an earlier console first, as it ends a stale TCP store."""
    from console import etcd as E
    profile = _profile(tmp_path)
    earlier = Cluster(profile, Fleet(run="etcd-e2e"))
    run = tmp_path / "run"
    try:
        assert await E.prepare(profile, earlier._store.etcd) is None  # the members of an earlier session, running
        pids = [int((run / "_etcd" / m / "pid").read_text()) for m in ("node-a", "node-b", "node-c")]
        later = Cluster(profile, Fleet(run="etcd-e2e"), preflight=True)
        try:
            await later._store.end_stale()
            await later._check_before("start")  # raised PreflightFailed: the members' ports were taken
        finally:
            await later.close()
        assert not any(os.path.exists(f"/proc/{pid}") and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                       for pid in pids)
    finally:
        await earlier.close()
        end_everything(tmp_path, run)


def test_the_runs_certificates_are_kept_while_they_serve_and_made_anew_by_a_start_when_they_do_not(tmp_path):
    """Defect: the run's CA and certificates were made for 30 days and kept forever: a run on etcd that lasted
    longer, or a run name used again a month later, lost its quorum to TLS errors; a member moved to another
    address kept a certificate that did not name it. They last ten years now, and a start makes them anew when
    they would expire within 30 days or do not name every member's address.
    Defect: every console made a CA where it found none, an attach or a `status` included: a second console with a
    copy of the profile made a CA of its own, the running members refused it, and its header said "etcd 0/3 up"
    without a reason. Only a start makes one; a console without it says so."""
    from console import etcd as E
    from console.etcd_pki import Pki, fits, make_pki
    from cryptography import x509
    pki = make_pki(tmp_path / "a", ["10.0.0.1", "10.0.0.2"])
    cert = x509.load_pem_x509_certificate(pki.path("member.crt").read_bytes())
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days >= 3649
    assert fits(pki, ["10.0.0.1", "10.0.0.2"]) and fits(pki, ["10.0.0.2"])
    assert not fits(pki, ["10.0.0.1", "10.0.0.3"])  # a member at an address the certificate does not name
    assert not fits(make_pki(tmp_path / "b", ["10.0.0.1"], days=1), ["10.0.0.1"])  # about to expire
    assert not fits(Pki(tmp_path / "none"), ["10.0.0.1"])
    profile = _profile(tmp_path)  # members on 127.0.0.1
    root = tmp_path / "pki"
    looking = E.cluster_of(profile, lambda h: None, root)
    assert not (root / profile.run.name).exists()  # an attach, a status, another console: no CA of its own
    assert "no CA for run" in E.no_ca(looking.pki) and asyncio.run(E.health_label(profile)).startswith(
        "etcd: no CA for run")
    with pytest.raises(TransportError, match="no CA for run"):  # a node it adds or restarts: one line
        asyncio.run(looking.hand_client_certs("h", str(tmp_path / "x")))
    looking.renew(profile.run.name)  # a start makes it
    first = looking.pki.path("ca.crt").read_bytes()
    assert E.no_ca(looking.pki) is None
    assert E.cluster_of(profile, lambda h: None, root).pki.path("ca.crt").read_bytes() == first  # kept
    # a start renews what would expire within 30 days (an attach keeps it: running members trust it)
    month = make_pki(root / profile.run.name, ["127.0.0.1"], run=profile.run.name, days=20)
    month_ca = month.path("ca.crt").read_bytes()
    etcd = E.cluster_of(profile, lambda h: None, root)
    assert etcd.pki.path("ca.crt").read_bytes() == month_ca  # kept by every console that only looks
    etcd.renew(profile.run.name)
    assert etcd.pki.path("ca.crt").read_bytes() != month_ca and fits(etcd.pki, ["127.0.0.1"], margin_days=3000)
