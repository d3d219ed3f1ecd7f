"""Config units: unknown keys, wrong types, batch arithmetic, command-line overrides, ZERO_BAND_* variables."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from engine.config import ConfigError, grad_accum_steps, load_config, parse_overrides

from engine.digests import digest, run_digest
from engine.toml_text import toml_value


def write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_shipped_configs_load(repo_root):
    for name in ("debug", "debug-diloco", "15m", "150m", "150m-diloco", "1b", "1b-diloco"):
        cfg = load_config(repo_root / "configs" / f"{name}.toml")
        assert cfg.model.preset == name.removesuffix("-diloco")
    diloco = load_config(repo_root / "configs" / "debug-diloco.toml")
    assert diloco.diloco.enabled and diloco.diloco.inner_steps == 5


def test_unknown_key_names_file_and_key(tmp_path):
    path = write(tmp_path, "[optim]\nlrr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"c\.toml: optim\.lrr: unknown key"):
        load_config(path, ["--data.fake=true"])


def test_wrong_type_is_rejected(tmp_path):
    path = write(tmp_path, '[data]\nfake = true\n[train]\nmax_steps = "many"\n')
    with pytest.raises(ConfigError, match=r"train\.max_steps"):
        load_config(path)


def test_batch_arithmetic(tmp_path):
    path = write(tmp_path, "[data]\nfake = true\n[train]\nmicro_batch_size = 4\nbatch_size = 16\n")
    cfg = load_config(path)
    assert grad_accum_steps(cfg.train, 1) == 4
    assert grad_accum_steps(cfg.train, 2) == 2
    assert grad_accum_steps(cfg.train, 4) == 1
    with pytest.raises(ConfigError, match="not divisible"):
        grad_accum_steps(cfg.train, 3)
    with pytest.raises(ConfigError, match="not a multiple"):
        load_config(path, ["--train.batch_size=6"])


def test_overrides_win_and_are_typed(tmp_path):
    path = write(tmp_path, "[data]\nfake = true\n[optim]\nlr = 1e-2\n")
    cfg = load_config(path, ["--optim.lr=1e-3", "--train.max_steps", "7", "--train.compile"])
    assert cfg.optim.lr == pytest.approx(1e-3) and cfg.train.max_steps == 7 and cfg.train.compile is True
    assert parse_overrides(["--a.b=c=d"]) == {"a.b": "c=d"}
    with pytest.raises(ConfigError, match="expected --section.key=value"):
        parse_overrides(["lr=3"])


@pytest.mark.parametrize("override, key, text", [
    ("--mesh.node_id=42", "mesh.node_id", "42"),
    ("--run.name=2024-06-01", "run.name", "2024-06-01"),
    ("--run.dir=true", "run.dir", "true"),
    ("--data.path=2024", "data.path", "2024"),
    ('--run.name="007"', "run.name", "007"),  # quoted, as the console writes every string: the same text
    ("--mesh.node_id='x'", "mesh.node_id", "x"),
])
def test_a_text_key_takes_text_that_toml_would_read_as_a_number_a_date_or_a_boolean(tmp_path, override, key, text):
    """Defect: `--mesh.node_id=42`, `--run.name=2024-06-01` and `GLOBAL_UNIQUE_ID=0` were `Input should be a valid
    string`: every value was read as TOML, whatever the key's type."""
    cfg = load_config(write(tmp_path, "[data]\nfake = true\n"), [override])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == text


def test_a_node_id_from_the_environment_is_text(tmp_path):
    cfg = load_config(write(tmp_path, "[data]\nfake = true\n"), [], environ={"GLOBAL_UNIQUE_ID": "0"})
    assert cfg.mesh.node_id == "0"


def test_a_str_the_profile_gives_is_that_string(tmp_path):
    # console/profile.py checks a profile's overrides as typed values: a str is the text, whatever it looks like
    cfg = load_config(write(tmp_path, "[data]\nfake = true\n"),
                      {"run.name": "2024-06-01", "mesh.node_id": "0", "run.dir": "true", "optim.lr": 1e-3})
    assert (cfg.run.name, cfg.mesh.node_id, cfg.run.dir, cfg.optim.lr) == ("2024-06-01", "0", "true", 1e-3)
    # and where a number belongs it is refused, as a TOML string in a config file is: the console passes it on as
    # --optim.lr="1e-3", which the engine refuses too (a profile's check passed what every engine then refused)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[data]\nfake = true\n"), {"optim.lr": "1e-3"})
    assert str(e.value) == 'command line: optim.lr: Input should be a valid number (--optim.lr="1e-3")'


@pytest.mark.parametrize("args, key", [(["--train.max_steps"], "train.max_steps"),
                                       (["--optim.lr", "--train.compile"], "optim.lr"),
                                       (["--run.name"], "run.name")])
def test_a_bare_flag_is_true_for_a_boolean_key_only(tmp_path, args, key):
    """Defect: a bare `--train.max_steps` was true, which pydantic took for 1 step (`--optim.lr`: a rate of 1.0)."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[data]\nfake = true\n"), args)
    assert str(e.value) == f"command line: {key}: needs a value (--{key}=VALUE)"


@pytest.mark.parametrize("override, key", [
    ("--mesh.store_timeout=inf", "mesh.store_timeout"),
    ("--diloco.straggler_timeout=inf", "diloco.straggler_timeout"),
    ("--optim.lr=nan", "optim.lr"),
    ("--optim.clip_norm=-inf", "optim.clip_norm"),
])
def test_inf_and_nan_are_refused_naming_the_key(tmp_path, override, key):
    """Defect: `--mesh.store_timeout=inf` passed, and the run ended in an OverflowError from timedelta in the mesh."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[data]\nfake = true\n"), [override])
    assert str(e.value) == f"command line: {key}: Input should be a finite number ({override})"


def test_inf_from_the_environment_or_the_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[data]\nfake = true\n"), [],
                    environ={"ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS": "inf"})
    assert str(e.value) == ("environment: ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS='inf': mesh.store_timeout: "
                            "Input should be a finite number")
    path = write(tmp_path, "[data]\nfake = true\n[mesh]\nstore_timeout = inf\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: mesh.store_timeout: Input should be a finite number"


@pytest.mark.parametrize("seed, message", [("-5", "greater than or equal to 0"),
                                           (str(2**63), f"less than {2**63}")])
def test_the_seed_is_one_numpy_and_torch_both_take(tmp_path, seed, message):
    """Defect: `--train.seed=-5` passed the config, then numpy's default_rng refused it after training started."""
    path = write(tmp_path, "[data]\nfake = true\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, [f"--train.seed={seed}"])
    assert str(e.value) == f"command line: train.seed: Input should be {message} (--train.seed={seed})"
    assert load_config(path, ["--train.seed=0"]).train.seed == 0
    assert load_config(path, [f"--train.seed={2**63 - 1}"]).train.seed == 2**63 - 1


def test_data_path_required_unless_fake(tmp_path):
    with pytest.raises(ConfigError, match="data.path is required"):
        load_config(write(tmp_path, "[train]\nmax_steps = 3\n"))


def test_zero_band_environment(tmp_path):
    path = write(tmp_path, "[data]\nfake = true\n")
    env = {"ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS": "12", "GLOBAL_UNIQUE_ID": "node-a", "GLOBAL_PORT": "29700"}
    cfg = load_config(path, [], environ=env)
    assert cfg.mesh.store_timeout == 12 and cfg.mesh.node_id == "node-a" and cfg.mesh.store_port == 29700
    # the command line beats the environment
    assert load_config(path, ["--mesh.node_id=b"], environ=env).mesh.node_id == "b"
    with pytest.raises(ConfigError, match="unknown variable ZERO_BAND_TYPO"):
        load_config(path, [], environ={"ZERO_BAND_TYPO": "1"})


def test_digest_ignores_per_node_knobs(tmp_path):
    path = write(tmp_path, "[data]\nfake = true\n")
    base = digest(load_config(path))
    assert digest(load_config(path, ["--optim.lr=1e-2", "--diloco.min_nodes=3"])) == base
    assert digest(load_config(path, ["--data.seq_len=64"])) != base
    # -0.0 and 0 are the same setting: two nodes given them are admitted (the mesh could not name a difference)
    zero, minus_zero = (load_config(path, [f"--diloco.sentinel_min_cosine={v}"]) for v in ("0", "-0.0"))
    assert run_digest(zero) == run_digest(minus_zero) != run_digest(load_config(path))


@pytest.mark.parametrize("override", ["--diloco.fragments=2", "--diloco.round=time", "--diloco.round_seconds=30",
                                      "--diloco.sentinel_ratio=5", "--diloco.sentinel_min_cosine=0"])
def test_the_mesh_digest_carries_what_running_nodes_must_share_and_a_resume_may_change(tmp_path, override):
    # nodes that split the model into other fragments, end rounds otherwise or judge the sentinel otherwise would
    # run outer steps that disagree: the mesh refuses them. A resume of the whole run may change them.
    path = write(tmp_path, "[data]\nfake = true\n[diloco]\nenabled = true\nround_seconds = 10\n")
    base = load_config(path)
    other = load_config(path, [override])
    assert run_digest(other) != run_digest(base)
    assert digest(other) == digest(base)  # the checkpoint's digest
    # knobs of one node's own landing and mixing differ without harm
    for knob in ("--diloco.overlap_delay=2", "--diloco.fragment_alpha=0.5", "--diloco.overlap_update=eager",
                 "--diloco.min_nodes=3", "--diloco.straggler_grace=4"):
        assert run_digest(load_config(path, [knob])) == run_digest(base), knob
    # a run that leaves them at their defaults keeps the digest it had before they counted
    assert run_digest(load_config(write(tmp_path, "[data]\nfake = true\n"))) == \
        digest(load_config(write(tmp_path, "[data]\nfake = true\n")))


def test_overlap_after_is_shared_by_running_nodes_and_needs_overlap(tmp_path):
    """diloco.overlap_after: in the mesh's digest (nodes that overlap from another outer step are refused), not in
    the checkpoint's (a resume may change it), and 0 leaves the digest as it was before the key existed; refused in
    one line naming the key without overlap or below 0."""
    path = write(tmp_path, "[data]\nfake = true\n[diloco]\nenabled = true\noverlap = true\n")
    base, after = load_config(path), load_config(path, ["--diloco.overlap_after=3"])
    assert after.diloco.overlap_after == 3 and base.diloco.overlap_after == 0
    assert run_digest(after) != run_digest(base) and digest(after) == digest(base)
    assert run_digest(load_config(path, ["--diloco.overlap_after=0"])) == run_digest(base) == digest(base)
    with pytest.raises(ConfigError) as e:
        load_config(path, ["--diloco.overlap=false", "--diloco.overlap_after=2"])
    assert "diloco.overlap_after (2) needs diloco.overlap = true" in str(e.value) and "\n" not in str(e.value)
    load_config(path, ["--diloco.overlap=false", "--diloco.overlap_after=0"])  # 0 is every step overlapping: none
    with pytest.raises(ConfigError, match="diloco.overlap_after: Input should be greater than or equal to 0"):
        load_config(path, ["--diloco.overlap_after=-1"])


@pytest.mark.parametrize("override, strategy, message", [
    ("--inner.cpu_offload=true", "ddp", "inner.cpu_offload is FSDP2's offload"),
    ("--inner.offload_optimizer=true", "fsdp", "inner.offload_optimizer is DeepSpeed's"),
    ("--inner.offload_params=true", "zero2", "inner.offload_params needs inner.strategy zero3"),
])
def test_offload_knobs_belong_to_their_strategy(tmp_path, override, strategy, message):
    path = write(tmp_path, "[data]\nfake = true\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override, f"--inner.strategy={strategy}"])
    good = {"--inner.cpu_offload=true": "fsdp", "--inner.offload_optimizer=true": "zero1",
            "--inner.offload_params=true": "zero3"}[override]
    assert load_config(path, [override, f"--inner.strategy={good}"]).inner.strategy == good


def test_a_refused_node_names_each_setting_that_differs_from_the_runs():
    from engine.config import Config
    from engine.digests import mesh_settings
    from engine.mesh.registration import differences

    def value(diloco: dict, seq_len: int = 128, workers: int = 1, wire: int = 5, strategy: str = "ddp") -> str:
        cfg = Config.model_validate({"data": {"fake": True, "seq_len": seq_len},
                                     "diloco": {"enabled": True, **diloco}})
        settings = json.dumps(mesh_settings(cfg), sort_keys=True)
        return f"{run_digest(cfg)}/w{workers}/s{strategy}/p{wire} {settings}"

    run = value({"inner_steps": 8})
    assert differences(value({"inner_steps": 8}), run) == ""
    assert differences(value({"inner_steps": 4}), run) == "diloco.inner_steps = 4 here, 8 in the run"
    assert differences(value({"inner_steps": 8, "fragments": 2}), run) == "diloco.fragments = 2 here, 1 in the run"
    assert differences(value({"inner_steps": 8, "compression": "int8"}, seq_len=64, workers=2), run) == \
        'workers per node 2 here, 1 in the run; data.seq_len = 64 here, 128 in the run; ' \
        'diloco.compression = "int8" here, "none" in the run'
    # a node of another inner strategy: the same bytes laid out otherwise (a ZeRO node's partitions averaged into a
    # DDP node's parameters became noise under an agreed checksum, and DDP beside FSDP aborted gloo)
    assert differences(value({"inner_steps": 8}, strategy="zero2"), run) == \
        "inner.strategy zero2 here, ddp in the run (the outer step's buffers are laid out by it)"
    # an engine of another wire protocol, whose value carries no settings: what can be told, and no more
    assert differences(value({"inner_steps": 8}), run.split()[0].replace("/p5", "/p4")) == \
        "engine wire protocol /p5 here, /p4 in the run (one engine version on every node)"
    five = value({"inner_steps": 4, "outer_lr": 0.5, "compression": "bf16", "overlap": True, "sentinel_ratio": 2},
                 seq_len=64)
    assert differences(five, run).endswith("; and 2 more") and differences(five, run).count(";") == 4


def _reference_rows() -> dict[str, str]:
    """docs/config.md's rows: key -> its default cell."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    return {m[1]: m[2] for m in re.finditer(r"^\| `([a-z_]+\.[a-z0-9_]+)` \| (.+?) \| .* \|$", text, re.M)}


def _leaves(model, prefix=""):
    for name, field in model.model_fields.items():
        if hasattr(field.annotation, "model_fields"):
            yield from _leaves(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.default


def test_the_config_reference_lists_every_key_with_its_default():
    """docs/config.md has a row for every key of the config, with the default the code has, and none for a key
    the code does not have: a key added, renamed or given another default without the page fails here."""
    from engine.config import Config
    rows, leaves = _reference_rows(), dict(_leaves(Config))
    assert sorted(set(leaves) - set(rows)) == [] and sorted(set(rows) - set(leaves)) == []
    for key, default in leaves.items():
        cell = rows[key]
        if default is None:
            assert cell == "(unset)", (key, cell)
            continue
        assert cell.startswith("`") and cell.endswith("`"), (key, cell)
        written = tomllib.loads(f"v = {cell[1:-1]}")["v"]
        assert written == default and type(written) is type(default), (key, cell, default)


@pytest.mark.parametrize("value", [True, "int8", 'say "hi"\n\t\\', "é😀\x7f\x01", [1, 2], 1e-3, 1e20, -float("inf"),
                                   {"a b": 1, "c": [{"d": "x"}], "é": [1, False]}])
def test_a_refusal_writes_a_setting_as_toml_reads_it_back(value):
    """Refusals name settings as the user writes them (`diloco.overlap = true`); JSON wrote NaN and dicts as no TOML
    file can hold them."""
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value
    assert toml_value(None) == "unset" and toml_value(float("nan")) == "nan"
