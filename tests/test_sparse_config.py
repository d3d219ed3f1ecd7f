"""diloco.compression = "sparse" and its keys (issue 43, item 1): each key's rule on both sides of its threshold,
one line naming the key and the value; the keys in the settings every node of a run shares (with sparse only);
the wire protocol that an engine without sparse is refused by. Pure and fast: the config, the digests and the mesh on an in-memory store."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mesh_sim import Sim

from engine.config import Config, ConfigError, DilocoConfig, load_config
from engine.digests import DILOCO_SPARSE, digest, mesh_settings, run_digest, shared_settings
from engine.mesh import MeshError
from engine.outer import allreduce
from engine.outer.sparse import SparseSpec

SPARSE = ["--data.fake=true", "--diloco.enabled=true", "--diloco.compression=sparse"]


def _load(*overrides: str) -> Config:
    return load_config(None, [*SPARSE, *overrides])


# ---- each key, both sides of each threshold ----

@pytest.mark.parametrize("key, good, bad", [
    ("sparse_chunk", "16", "8"),  # the smallest chunk, and half of it
    ("sparse_chunk", "65536", "131072"),  # the largest, and twice it
    ("sparse_chunk", "4096", "4095"),  # a power of two, and one less
    ("sparse_chunk", "4096", "-4096"),
    ("density", "1e-9", "0"),  # (0, 1]: anything above 0 (k is at least 1) ...
    ("density", "1.0", "1.0001"),  # ... up to all of the chunk
    ("sparse_bits", "2", "3"),
    ("sparse_bits", "4", "1"),
    ("sparse_bits", "8", "16"),
    ("sparse_beta", "0.0", "-0.01"),  # [0, 1]
    ("sparse_beta", "1.0", "1.01"),
])
def test_each_sparse_key_on_both_sides_of_its_threshold(key, good, bad):
    assert getattr(_load(f"--diloco.{key}={good}").diloco, key) == float(good)
    with pytest.raises(ConfigError) as e:
        _load(f"--diloco.{key}={bad}")
    line = str(e.value)
    # one line, the key and the value as given, and where it came from
    assert "\n" not in line and line.startswith(f"command line: diloco.{key}: "), line
    assert f"(--diloco.{key}={bad})" in line and (repr(float(bad)) in line or bad in line.split(": ", 2)[2]), line


def test_a_sparse_key_in_a_file_names_the_file_and_the_value(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[data]\nfake = true\n[diloco]\ncompression = "sparse"\nsparse_bits = 3\n')
    with pytest.raises(ConfigError, match=r"^.*run\.toml: diloco\.sparse_bits: 3 is not one of 2, 4, 8 \(the bits "):
        load_config(path)
    path.write_text('[data]\nfake = true\n[diloco]\ncompression = "sparse"\ndensity = 0.02\nsparse_chunk = 1024\n')
    d = load_config(path).diloco
    assert SparseSpec.of(d) == SparseSpec(chunk=1024, density=0.02, bits=2, beta=0.9)


def test_types_are_strict_as_for_every_key():
    with pytest.raises(ConfigError, match=r"diloco\.sparse_chunk: Input should be a valid integer"):
        _load("--diloco.sparse_chunk=4096.0")
    with pytest.raises(ConfigError, match=r"diloco\.sparse_bits: Input should be a valid integer"):
        _load('--diloco.sparse_bits="2"')
    assert _load("--diloco.density=1").diloco.density == 1  # a float takes an integer, as everywhere


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_sparse_key_beside_another_compression_is_refused_not_ignored(compression):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--data.fake=true", f"--diloco.compression={compression}", "--diloco.density=0.02"])
    assert str(e.value) == (f'command line: diloco.density: 0.02 is a setting of diloco.compression = "sparse", but '
                            f'diloco.compression is "{compression}" (set it to "sparse", or leave diloco.density '
                            f'out) (--diloco.density=0.02)')
    # the defaults are no setting: a config without the keys reads as before
    assert load_config(None, ["--data.fake=true", f"--diloco.compression={compression}"]).diloco.density == 0.0156


def test_the_configs_defaults_are_the_codecs():
    d = DilocoConfig(compression="sparse")
    assert SparseSpec.of(d) == SparseSpec()
    # the paper's outer step (no outer momentum: the accumulator is the momentum) is the default one
    assert (d.outer_optimizer, d.outer_momentum, d.outer_lr) == ("nesterov", 0.0, 1.0)
    # and Nesterov stays selectable
    assert DilocoConfig(compression="sparse", outer_momentum=0.9).outer_momentum == 0.9


# ---- shared by every node of a run ----

def test_the_sparse_keys_are_shared_with_sparse_and_absent_otherwise():
    sparse = _load()
    assert all(k in shared_settings(sparse)["diloco"] for k in DILOCO_SPARSE)
    assert all(f"diloco.{k}" in mesh_settings(sparse) for k in DILOCO_SPARSE)
    # with another compression they are not in the digest: every other run's digest and checkpoints stay as they were
    dense = load_config(None, ["--data.fake=true", "--diloco.enabled=true", "--diloco.compression=int8"])
    assert not any(k in shared_settings(dense)["diloco"] for k in DILOCO_SPARSE)
    for key, other in (("sparse_chunk", "1024"), ("density", "0.02"), ("sparse_bits", "4"), ("sparse_beta", "0.95")):
        moved = _load(f"--diloco.{key}={other}")
        assert run_digest(moved) != run_digest(sparse) and digest(moved) != digest(sparse), key


def _value(cfg: Config, wire: int) -> str:
    """The digest key's value an engine of wire protocol `wire` writes (engine/outer/diloco.py)."""
    return f"{run_digest(cfg)}/w1/sddp/p{wire} {json.dumps(mesh_settings(cfg), sort_keys=True)}"


def test_a_node_of_other_sparse_settings_is_refused_naming_them():
    sim = Sim()
    sim.start("a", digest=_value(_load(), allreduce.WIRE_PROTOCOL))
    with pytest.raises(MeshError, match=r"diloco\.density = 0\.02 here, 0\.0156 in the run \(the store keeps"):
        sim.node("b", digest=_value(_load("--diloco.density=0.02"), allreduce.WIRE_PROTOCOL)).start()


def test_an_engine_without_sparse_is_refused_as_of_another_wire_protocol():
    """A run of sparse engines refuses an engine of the protocol before sparse (7), and a run of those refuses a
    sparse engine, each saying why: the protocol and the compression."""
    assert allreduce.WIRE_PROTOCOL == 8
    old = load_config(None, ["--data.fake=true", "--diloco.enabled=true", "--diloco.compression=int8"])
    sim = Sim()
    sim.start("a", digest=_value(_load(), 8))
    with pytest.raises(MeshError) as e:
        sim.node("old", digest=_value(old, 7)).start()
    assert 'engine wire protocol /p7 here, /p8 in the run (one engine version on every node); diloco.compression = ' \
           '"int8" here, "sparse" in the run' in str(e.value)
    sim = Sim()
    sim.start("a", digest=_value(old, 7))
    with pytest.raises(MeshError) as e:
        sim.node("new", digest=_value(_load(), 8)).start()
    assert 'engine wire protocol /p8 here, /p7 in the run (one engine version on every node); diloco.compression = ' \
           '"sparse" here, "int8" in the run' in str(e.value)
    # an engine of 7 sends its value; a node of this engine with int8 differs from it by the protocol alone
    sim = Sim()
    sim.start("a", digest=_value(old, 7))
    with pytest.raises(MeshError, match=r"differs from the run's \S+: engine wire protocol /p8 here, /p7 in the run "
                                        r"\(one engine version on every node\) \(the store"):
        sim.node("new", digest=_value(old, 8)).start()


def test_the_outer_loops_factory_no_longer_refuses_sparse_and_without_diloco_builds_no_outer_loop():
    """Sparse is wired into the outer loop's parts (tests/test_sparse_outer.py trains two engines with it)."""
    from engine.outer.build import NoOuter, build_outer
    world = SimpleNamespace(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
    assert isinstance(build_outer(load_config(None, ["--data.fake=true", "--diloco.compression=sparse"]), world,
                                  None, None), NoOuter)
