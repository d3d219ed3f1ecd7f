"""Profiles: the shipped ones validate, errors name file:line: key, add_host keeps comments and layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from console.engine_config import check_engine_config
from console.profile import (ProfileError, add_host, remove_host, engine_overrides, key_lines,
                             load_profile, parse_profile, split_key)

ROOT = Path(__file__).resolve().parent.parent

MINIMAL = """\
# a comment at the top
[run]
name = "t"   # trailing comment
dir = "runs/t"

[engine]
config = "configs/debug-diloco.toml"
overrides = { "train.max_steps" = 20 }

[defaults]
transport = "local"
env = { A = "1" }

[hosts.node-a]
env = { B = "2" }

[hosts."node b"]
standby = true
"""


def test_shipped_local_profile():
    profile = load_profile(ROOT / "profiles" / "local.toml")
    assert [h.name for h in profile.active_hosts()] == ["node-a", "node-b", "node-c"]
    assert [h.name for h in profile.standby_hosts()] == ["node-d"]
    assert all(h.transport == "local" and h.python_path == ".venv/bin/python" for h in profile.hosts.values())
    assert profile.store_address == "127.0.0.1" and profile.store.port == 29610
    assert profile.engine.config == "configs/debug-diloco.toml"


def test_shipped_lab_profile_documents_every_option():
    profile = load_profile(ROOT / "profiles" / "lab.toml")
    b, c, d = profile.hosts["node-b"], profile.hosts["node-c"], profile.hosts["node-d"]
    assert (b.port, b.user, b.workers) == (2222, "alice", 8)  # from [defaults]
    assert b.env == {"NCCL_SOCKET_IFNAME": "eth0", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}  # defaults merged
    assert c.jump_host == "ops@bastion.example.org:22" and c.python_path == "/usr/bin/python3"
    assert d.ssh_alias == "gpu-d" and d.target == "gpu-d"
    assert engine_overrides(profile, d)["inner.device"] == "cuda"
    assert profile.hosts["node-e"].standby and profile.store_address == "10.0.0.1"
    text = (ROOT / "profiles" / "lab.toml").read_text()
    # every host option appears in the documented example
    for option in ("transport", "address", "port", "user", "identity_file", "jump_host", "ssh_alias", "ssh_config",
                   "known_hosts", "accept_new_host_key", "connect_timeout", "python", "venv", "workdir", "env",
                   "workers", "rdzv_port", "standby", "overrides"):
        assert f"\n{option} = " in text or f"\n{option}=" in text or f"{option} = " in text, option


def test_defaults_merge_and_inherit():
    profile = parse_profile(MINIMAL, "p.toml")
    assert profile.hosts["node-a"].env == {"A": "1", "B": "2"}
    assert profile.hosts["node b"].env == {"A": "1"} and profile.hosts["node b"].standby
    assert profile.store_host.name == "node-a"


@pytest.mark.parametrize("edit, expected", [
    (('[hosts."node b"]\nstandby = true', '[hosts."node b"]\nstandby = true\nport = "x"'),
     'p.toml:19: hosts.node b.port: Input should be a valid integer'),
    (("[hosts.node-a]\n", "[hosts.node-a]\nwrkdir = 'x'\n"), "p.toml:15: hosts.node-a.wrkdir: unknown key"),
    (('transport = "local"', 'transport = "telnet"'), "p.toml:11: hosts.node-a.transport: Input should be"),
    (('name = "t"', 'name = ""'), "p.toml:3: run.name: String should have at least 1 character"),
    (('overrides = { "train.max_steps" = 20 }', 'overrides = { "steps" = 20 }'),
     "p.toml:8: engine.overrides: override 'steps' is not of the form section.key"),
    (('config = "configs/debug-diloco.toml"', 'config = "configs/debug'), "p.toml:7: not valid TOML"),
    (('[run]', '[store]\nhost = "node-z"\n[run]'), "p.toml:3: store.host: 'node-z' is not a host of this profile"),
    (("standby = true", "standby = true\n[hosts.node-a.x]"), "p.toml:19: hosts.node-a.x: unknown key"),
    (("[hosts.node-a]\nenv", "[hosts.node-a]\nstandby = true\nenv"), "p.toml:14: hosts: every host is standby"),
    (('[engine]\nconfig = "configs/debug-diloco.toml"', '[engine]'), "p.toml:6: engine.config: Field required"),
    # a bad variable name failed at start, after the other hosts had started
    (('env = { B = "2" }', 'env = { "B C" = "2" }'), "p.toml:15: hosts.node-a.env: 'B C' is not an environment "
                                                     "variable name"),
    (("[hosts.node-a]", "[hosts._store]"), "p.toml:14: hosts._store.name: a host name must not begin with _"),
    # a key the console sets was dropped (run.dir) or beat the console's (mesh.store_port: no store listened there)
    (('overrides = { "train.max_steps" = 20 }', 'overrides = { "run.dir" = "/x" }'),
     "p.toml:8: engine.overrides: override 'run.dir': the console sets it from [run] dir"),
    (('env = { B = "2" }', 'overrides = { "mesh.store_port" = 29999 }'),
     "p.toml:15: hosts.node-a.overrides: override 'mesh.store_port': the console sets it from [store] port"),
    # "latest" failed every fresh start (its folder archived), "auto" beat the fresh start's none
    (('overrides = { "train.max_steps" = 20 }', 'overrides = { "ckpt.resume" = "latest" }'),
     "p.toml:8: engine.overrides: override 'ckpt.resume': the console sets it from a start (a fresh run) or --resume"),
])
def test_errors_name_file_line_and_key(edit, expected):
    old, new = edit
    assert old in MINIMAL
    with pytest.raises(ProfileError) as info:
        parse_profile(MINIMAL.replace(old, new, 1), "p.toml")
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)


def test_inherited_bad_value_points_at_defaults():
    text = MINIMAL.replace('transport = "local"', 'transport = "local"\nworkers = 0')
    with pytest.raises(ProfileError, match=r"^p\.toml:12: hosts\.node-a\.workers: Input should be greater than 0"):
        parse_profile(text, "p.toml")


def test_missing_file_and_bad_engine_config(tmp_path):
    with pytest.raises(ProfileError, match="nope.toml: profile not found"):
        load_profile(tmp_path / "nope.toml")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "e.toml").write_text("[train]\nmax_steps = 5\n[data]\nfake = true\n")
    text = MINIMAL.replace("configs/debug-diloco.toml", "configs/e.toml").replace(
        '[defaults]\n', f'[defaults]\nworkdir = "{tmp_path}"\n')
    path = tmp_path / "p.toml"
    path.write_text(text)
    check_engine_config(load_profile(path))  # good config + overrides: no error
    # a workdir under ~ (as the transports read it): the config is found there
    home = tmp_path / "home"
    (home / "w" / "configs").mkdir(parents=True)
    (home / "w" / "configs" / "e.toml").write_text((tmp_path / "configs" / "e.toml").read_text())
    tilde = tmp_path / "tilde.toml"
    tilde.write_text(text.replace(f'workdir = "{tmp_path}"', 'workdir = "~/w"'))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        check_engine_config(load_profile(tilde))
    path.write_text(text.replace('"train.max_steps" = 20', '"train.max_steps" = -1'))
    with pytest.raises(ProfileError, match=r"p\.toml:8: engine\.overrides\.train\.max_steps: Input should be greater "
                                           r"than 0$"):
        check_engine_config(load_profile(path))
    path.write_text(text.replace("configs/e.toml", "configs/missing.toml"))
    with pytest.raises(ProfileError, match=r"p\.toml:7: engine\.config: .*missing\.toml: config file not found"):
        check_engine_config(load_profile(path))


def test_every_hosts_overrides_are_checked_before_start_and_named_where_written(tmp_path):
    """A remote host's overrides were not checked (its engine failed alone, after the store and the other nodes had
    started); an override inherited from [defaults] was named at line 0 under a table nobody wrote; a host named 1
    (the engine's node id "1") was refused by the engine as not text."""
    config = ROOT / "configs" / "debug-diloco.toml"
    text = MINIMAL.replace("configs/debug-diloco.toml", str(config)).replace(
        '[defaults]\ntransport = "local"\n', f'[defaults]\ntransport = "local"\nworkdir = "{ROOT}"\n') + \
        '\n[hosts.1]\n\n[hosts.remote]\ntransport = "ssh"\noverrides = { "optim.lrr" = 1 }\n'
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as e:
        check_engine_config(load_profile(path))
    line = text.splitlines().index('overrides = { "optim.lrr" = 1 }') + 1
    assert str(e.value) == f"{path}:{line}: hosts.remote.overrides.optim.lrr: unknown key (did you mean optim.lr?)"
    path.write_text(text.replace('\noverrides = { "optim.lrr" = 1 }\n', "\n").replace(
        '[defaults]\n', '[defaults]\noverrides = { "train.max_stepz" = 3 }\n'))
    with pytest.raises(ProfileError) as e:
        check_engine_config(load_profile(path))
    assert str(e.value).startswith(f"{path}:11: defaults.overrides.train.max_stepz: unknown key"), str(e.value)
    path.write_text(text.replace('\noverrides = { "optim.lrr" = 1 }\n', "\n"))
    check_engine_config(load_profile(path))  # and the numeric host name is a node id like any other


def test_add_host_round_trip_keeps_comments_and_layout(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(MINIMAL)
    profile = add_host(path, "node-$(x) 'q'", transport="ssh", address="10.0.0.9", port=2222, standby=True,
                       env={"K": "v w"})
    text = path.read_text()
    assert text.startswith(MINIMAL)  # every byte of the old file, comments and blank lines included, kept
    assert "# trailing comment" in text
    host = profile.hosts["node-$(x) 'q'"]
    assert (host.address, host.port, host.standby, host.env) == ("10.0.0.9", 2222, True, {"A": "1", "K": "v w"})
    assert load_profile(path).hosts["node-$(x) 'q'"].port == 2222  # what was written reads back the same
    with pytest.raises(ProfileError, match="already exists"):
        add_host(path, "node-a")
    with pytest.raises(ProfileError, match=r"hosts\.bad\.port: Input should be less than 65536"):
        add_host(path, "bad", port=70000)
    assert "bad" not in load_profile(path).hosts  # a bad host never reaches the file
    assert "node-$(x) 'q'" not in remove_host(path, "node-$(x) 'q'").hosts  # an add that failed, undone
    assert path.read_text() == MINIMAL


def test_add_host_to_the_shipped_profile_keeps_it(tmp_path):
    path = tmp_path / "lab.toml"
    original = (ROOT / "profiles" / "lab.toml").read_text()
    path.write_text(original)
    add_host(path, "node-f", address="10.0.0.6")
    assert path.read_text().startswith(original.rstrip("\n"))
    assert load_profile(path).hosts["node-f"].user == "trainer"  # inherits [defaults]


def test_key_lines_and_split_key():
    assert split_key('a."b.c".\'d\' ') == ["a", "b.c", "d"]
    lines = key_lines(MINIMAL)
    assert lines[("run", "name")] == 3 and lines[("hosts", "node b")] == 17
    assert lines[("engine", "overrides")] == 8 and lines[("hosts", "node-a", "env")] == 15


def test_hosts_with_different_worker_counts_are_refused_at_the_host_line():
    text = (ROOT / "profiles" / "local.toml").read_text().replace("[hosts.node-b]\n", "[hosts.node-b]\nworkers = 2\n")
    lines = text.splitlines()
    path = ROOT / "profiles" / "_workers_test.toml"  # beside local.toml: its workdir "." is the checkout
    path.write_text(text)
    try:
        with pytest.raises(ProfileError) as err:
            check_engine_config(load_profile(path))  # configs/debug-diloco.toml: DiLoCo on
    finally:
        path.unlink()
    line = lines.index("workers = 2") + 1
    assert str(err.value).startswith(f"{path}:{line}: hosts.node-b.workers: 2 differs from node-a's 1")
    # without DiLoCo each host trains on its own (e.g. a DeepSpeed hostfile): different counts are fine
    plain = parse_profile(text.replace("configs/debug-diloco.toml", "configs/debug.toml"), "local.toml")
    check_engine_config(plain)  # does not raise
    assert plain.hosts["node-b"].workers == 2


def test_store_on_an_ssh_alias_host_is_dialled_at_its_hostname(tmp_path):
    """Defect: with the store on an ssh_alias host, engines dialled the alias ("cannot bind on zbl-1:29650:
    Temporary failure in name resolution"); the alias exists only in this machine's ssh_config."""
    from console.profile import parse_profile

    config = tmp_path / "ssh_config"
    config.write_text("Host zbl-*\n  User trainer\nHost zbl-1\n  HostName 10.1.2.3\n  Port 2201\n"
                      "Host zbl-2\n  HostName gpu-2.lab.example\n")
    text = (f'[engine]\nconfig = "configs/debug-diloco.toml"\n[store]\nhost = "h1"\n'
            f'[defaults]\nssh_config = "{config}"\n'
            f'[hosts.h1]\nssh_alias = "zbl-1"\n[hosts.h2]\nssh_alias = "zbl-2"\n')
    profile = parse_profile(text, "p.toml")
    assert (profile.store_address, profile.store_bind) == ("10.1.2.3", "10.1.2.3")
    on_h2 = parse_profile(text.replace('host = "h1"', 'host = "h2"'), "p.toml")
    assert on_h2.store_address == "gpu-2.lab.example"
    pinned = parse_profile(text.replace('host = "h1"', 'host = "h1"\naddress = "10.9.9.9"'), "p.toml")
    assert (pinned.store_address, pinned.store_bind) == ("10.9.9.9", "10.9.9.9")  # what the profile says wins
    no_config = parse_profile(text.replace(f'ssh_config = "{config}"', f'ssh_config = "{tmp_path}/none"'), "p.toml")
    assert no_config.store_address == "zbl-1"  # nothing to resolve it with: the name as given


def test_a_key_written_twice_is_one_line_naming_the_second_writing():
    """tomlkit raises KeyAlreadyPresent (not a ParseError, and without a line): it was a traceback."""
    from console.profile import ProfileError, parse_profile
    text = '[hosts.a]\naddress = "10.0.0.1"\nenv = { A = "1" }\nworkers = 1\nenv = { B = "2" }\n'
    with pytest.raises(ProfileError) as err:
        parse_profile(text, "p.toml")
    assert str(err.value) == 'p.toml:5: not valid TOML: Key "env" already exists.'


def test_a_host_override_of_a_setting_every_node_must_share_is_refused_at_its_line():
    """The mesh would refuse that node at start-up (its digest differs), after the others had started: a
    half-cluster. The profile check says so first, at the override that makes the difference."""
    base = (ROOT / "profiles" / "local.toml").read_text()
    path = ROOT / "profiles" / f"_shared_test_{os.getpid()}.toml"  # beside local.toml: its workdir is the checkout
    cases = [('"diloco.fragments" = 5', "diloco.fragments", "5", "1"),
             ('"diloco.inner_steps" = 10', "diloco.inner_steps", "10", "5"),
             ('"data.seq_len" = 64', "data.seq_len", "64", "128")]
    try:
        for override, key, mine, theirs in cases:
            text = base.replace("[hosts.node-b]\n", f"[hosts.node-b]\noverrides = {{ {override} }}\n")
            path.write_text(text)
            with pytest.raises(ProfileError) as err:
                check_engine_config(load_profile(path))
            line = text.splitlines().index(f"overrides = {{ {override} }}") + 1
            assert str(err.value).startswith(f"{path}:{line}: hosts.node-b.overrides.{key}: {mine} differs from "
                                             f"node-a's {theirs}; every node of a DiLoCo run must share"), err.value
        # a value every host takes from [defaults], and one host's own: that host's line is the one to fix
        text = base.replace("[hosts.node-a]\n", '[hosts.node-a]\noverrides = { "diloco.inner_steps" = 10 }\n')
        text = text.replace("[defaults]\n", '[defaults]\noverrides = { "diloco.inner_steps" = 4 }\n', 1)
        path.write_text(text)
        with pytest.raises(ProfileError) as err:
            check_engine_config(load_profile(path))
        line = text.splitlines().index('overrides = { "diloco.inner_steps" = 10 }') + 1
        assert str(err.value).startswith(f"{path}:{line}: hosts.node-a.overrides.diloco.inner_steps: 10 differs "
                                         f"from node-b's 4"), err.value
        # what each node may choose for itself passes: its device, its own landing of an overlapped round
        own = '[hosts.node-b]\noverrides = { "diloco.overlap_delay" = 2 }\n'
        path.write_text(base.replace("[hosts.node-b]\n", own))
        check_engine_config(load_profile(path))
    finally:
        path.unlink()
