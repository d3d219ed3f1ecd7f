"""`python -m console.recipes`: every generated file is parsed back by what consumes it, and the shell scripts are
run against stub programs (python, srun, scontrol, hostname) that record what they receive, so quoting is
tested by execution, not by reading: hostile values (spaces, quotes, $(...), backticks) must arrive intact.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

from procs import PYTHON, ROOT, engine_env

from console.launch import engine_argv
from console.engine_config import data_shard
from console.engine_config import engine_env as console_engine_env
from console.profile import load_profile
from engine.config import load_config
from console.recipes import main, parse_hostfile

HOSTILE = "it's $(touch PWNED) `touch PWNED2` \"q\" a;b"
SECRET = "hf_do_not_write_me"


def setup_cli(procs, *args: str) -> subprocess.CompletedProcess:
    return procs.run([PYTHON, "-m", "console.recipes", *args], timeout=60)


@pytest.fixture
def lab(tmp_path) -> dict:
    """A profile with local hosts whose venv is a stub python that logs its argv, env and cwd as JSON lines."""
    work = tmp_path / "work dir $(x)"
    (work / "configs").mkdir(parents=True)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.jsonl"
    _stub(venv / "bin" / "python", log)
    profile = tmp_path / "lab.toml"
    profile.write_text(textwrap.dedent(f"""\
        [run]
        name = "t-run"
        dir = "runs/with space"

        [store]
        port = 29611

        [engine]
        config = "configs/debug.toml"

        [engine.overrides]
        "train.max_steps" = 7
        "data.path" = {json.dumps(HOSTILE)}

        [defaults]
        transport = "local"
        venv = {json.dumps(str(venv))}
        workdir = {json.dumps(str(work))}

        [defaults.env]
        ODD = {json.dumps(HOSTILE)}
        HF_TOKEN = "{SECRET}"

        [hosts.alpha]
        workers = 2

        [hosts.beta]
        identity_file = "~/.ssh/very_private_key"

        [hosts.gamma]
        standby = true
        """))
    return {"profile": profile, "work": work, "log": log, "tmp": tmp_path}


def _stub(path: Path, log: Path) -> None:
    """A program that appends {argv, env, cwd} to log and exits 0."""
    code = ("import json, os, sys; keep = ('GLOBAL_', 'NCCL_', 'TORCH_NCCL', 'ODD', 'HF_TOKEN', 'SLURM_'); "
            f"open({str(log)!r}, 'a').write(json.dumps({{'argv': sys.argv[1:], 'cwd': os.getcwd(), "
            "'env': {k: v for k, v in os.environ.items() if k.startswith(keep)}}) + '\\n')")
    path.write_text(f"#!/bin/sh\nexec {PYTHON} -c {_sh(code)} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _sh(text: str) -> str:
    import shlex
    return shlex.quote(text)


def _calls(log: Path, module: str) -> list[dict]:
    if not log.exists():
        return []
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [c for c in calls if c["argv"][:2] == ["-m", module]]


def _bash_n(path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr


# -- deepspeed / fsdp / hostfile ---------------------------------------------------------------------------

def test_deepspeed_config_is_what_deepspeed_reads(procs, tmp_path):
    out = tmp_path / "ds.json"
    done = setup_cli(procs, "deepspeed", "--zero-stage", "3", "--offload-optimizer", "--offload-params", "--bf16",
                     "--config", "configs/debug.toml", "--workers", "1", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"wrote {out}"  # and nothing else: no library warnings to a user
    cfg = json.loads(out.read_text())
    # debug.toml: micro batch 8, batch 8, one worker -> no accumulation, clip 1.0: as engine/inner/zero.py builds it
    from engine.inner.deepspeed_config import deepspeed_config
    assert cfg == deepspeed_config(3, micro_batch_size=8, grad_accum=1, precision="bf16-mixed", clip_norm=1.0,
                                   offload_optimizer=True, offload_params=True, hidden_size=192)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 192 * 192  # the debug preset's hidden size
    check = (
        "from deepspeed.runtime.config import DeepSpeedConfig; import sys; c = DeepSpeedConfig(sys.argv[1]); "
        "print(c.zero_optimization_stage, c.zero_config.offload_optimizer.device, "
        "c.zero_config.offload_param.device, c.bfloat16_config.enabled, float(c.gradient_clipping))")
    parsed = procs.run([PYTHON, "-c", check, str(out)], timeout=60, env=engine_env(DS_ACCELERATOR="cpu"))
    assert parsed.returncode == 0, parsed.stderr[-2000:]
    assert parsed.stdout.split()[-5:] == ["3", "cpu", "cpu", "True", "1.0"]


def test_deepspeed_uses_grad_accum_of_the_engine(tmp_path):
    out = tmp_path / "ds.json"
    # the engine defaults: micro batch 8, batch 8 -> 2 workers cannot split it: the engine's own error
    assert main(["deepspeed", "--zero-stage", "1", "--workers", "2", "--output", str(out)]) == 2
    assert not out.exists()
    cfg_file = tmp_path / "e.toml"
    cfg_file.write_text("[data]\nfake = true\n[train]\nmicro_batch_size = 2\nbatch_size = 16\n"
                        "[optim]\nclip_norm = 0.5\n")
    assert main(["deepspeed", "--zero-stage", "1", "--config", str(cfg_file), "--workers", "2",
                 "--output", str(out)]) == 0
    cfg = json.loads(out.read_text())
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)
    assert cfg["gradient_clipping"] == 0.5 and "bf16" not in cfg and "fp16" not in cfg


def test_deepspeed_buckets_follow_the_models_hidden_size_as_transformers_reads_it(tmp_path):
    """The console reads the width without transformers (engine/presets.py); transformers must agree with it."""
    from transformers import LlamaConfig

    from engine.config import ModelConfig
    from engine.model import model_config
    from engine.presets import PRESETS, hidden_size
    for preset in PRESETS:
        assert hidden_size(ModelConfig(preset=preset)) == model_config(ModelConfig(preset=preset), 258, 64).hidden_size
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=300).save_pretrained(tmp_path / "model")
    folder = ModelConfig(path=str(tmp_path / "model"))
    assert hidden_size(folder) == model_config(folder, 258, 64).hidden_size == 64
    cfg_file = tmp_path / "e.toml"
    cfg_file.write_text(f"[model]\npath = {json.dumps(str(tmp_path / 'model'))}\n")
    out = tmp_path / "ds.json"
    assert main(["deepspeed", "--zero-stage", "3", "--config", str(cfg_file), "--output", str(out)]) == 0
    zero = json.loads(out.read_text())["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64 and zero["stage3_param_persistence_threshold"] == 640
    (tmp_path / "model" / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        hidden_size(folder)


def test_deepspeed_rejects_param_offload_below_stage3(tmp_path, capsys):
    assert main(["deepspeed", "--zero-stage", "2", "--offload-params", "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "inner.offload_params: parameter offload needs ZeRO stage 3" in err


@pytest.mark.parametrize("sharding,strategy,reshard", [("FULL_SHARD", "fsdp", True),
                                                       ("SHARD_GRAD_OP", "fsdp", False),
                                                       ("NO_SHARD", "ddp", None)])
def test_fsdp_config_round_trips_into_the_engine(tmp_path, sharding, strategy, reshard):
    out = tmp_path / "fsdp.json"
    assert main(["fsdp", "--sharding", sharding, "--mixed-precision", "bf16", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["fsdp_config"]["fsdp_sharding_strategy"] == sharding and doc["mixed_precision"] == "bf16"
    assert doc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    cfg = load_config(None, {**doc["engine_overrides"], "data.fake": True})  # the engine accepts every key
    assert cfg.inner.strategy == strategy and cfg.train.precision == "bf16-mixed"
    if reshard is not None:
        assert cfg.inner.reshard_after_forward is reshard


def test_hostfile_read_by_deepspeed(procs, lab, tmp_path):
    out = tmp_path / "hostfile"
    assert main(["hostfile", str(lab["profile"]), "--output", str(out)]) == 0
    assert parse_hostfile(out.read_text()) == {"alpha": 2, "beta": 1}  # gamma is standby
    check = "from deepspeed.launcher.runner import fetch_hostfile; import sys; print(dict(fetch_hostfile(sys.argv[1])))"
    done = procs.run([PYTHON, "-c", check, str(out)], timeout=60, env=engine_env(DS_ACCELERATOR="cpu"))
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "{'alpha': 2, 'beta': 1}"


# -- launcher ----------------------------------------------------------------------------------------------

def test_launcher_runs_exactly_what_the_console_runs(lab, tmp_path):
    profile = load_profile(lab["profile"])
    for rank, name in enumerate(["alpha", "beta"]):
        script = tmp_path / f"run_{name}.sh"
        assert main(["launcher", str(lab["profile"]), "--node-rank", str(rank), "--output", str(script)]) == 0
        _bash_n(script)
        text = script.read_text()
        assert SECRET not in text and "very_private_key" not in text
        assert ("engine.store" in text) is (name == "alpha")  # the store runs where the profile puts it
        env = {**os.environ, "HF_TOKEN": "from-the-shell"}
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env=env)
        assert done.returncode == 0, done.stderr
        host = profile.hosts[name]
        engine = [c for c in _calls(lab["log"], "torch.distributed.run") + _calls(lab["log"], "engine.train")
                  if c["env"]["GLOBAL_UNIQUE_ID"] == name]
        assert len(engine) == 1
        assert engine[0]["argv"] == engine_argv(profile, host)[1:]  # hostile values arrived intact
        # the data shard the console gives the host: its place among all the profile's hosts (gamma is standby)
        assert (engine[0]["env"]["GLOBAL_RANK"], engine[0]["env"]["GLOBAL_WORLD_SIZE"]) == (str(rank), "3")
        expected_env = {k: v for k, v in console_engine_env(profile, host, *data_shard(profile, name)).items()
                        if k.startswith(("GLOBAL_", "ODD"))}
        assert {k: v for k, v in engine[0]["env"].items() if k in expected_env} == expected_env
        assert engine[0]["env"]["HF_TOKEN"] == "from-the-shell"  # a secret comes from the shell only
        assert Path(engine[0]["cwd"]) == lab["work"]
    assert not list(lab["work"].glob("PWNED*")) and not list(tmp_path.glob("PWNED*"))


def test_launcher_needs_secrets_from_the_environment(lab, tmp_path):
    script = tmp_path / "run.sh"
    assert main(["launcher", str(lab["profile"]), "--node-rank", "1", "--output", str(script)]) == 0
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode != 0 and "HF_TOKEN must be set in the environment" in done.stderr
    assert _calls(lab["log"], "torch.distributed.run") == _calls(lab["log"], "engine.train") == []


def test_launcher_bad_node_rank_is_one_line(lab, tmp_path, capsys):
    assert main(["launcher", str(lab["profile"]), "--node-rank", "2", "--output", str(tmp_path / "x.sh")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --node-rank: 2 is not a node of {lab['profile']} (0=alpha, 1=beta)"


def test_bad_profile_is_the_profile_error(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nconfig = 'c.toml'\n[hosts.a]\nworkers = 0\n")
    assert main(["hostfile", str(bad), "--output", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}:4: hosts.a.workers") and "\n" not in err


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "fsdp.json"
    out.write_text("keep me")
    assert main(["fsdp", "--sharding", "FULL_SHARD", "--output", str(out)]) == 2
    assert out.read_text() == "keep me"
    assert "refusing to overwrite; add --force" in capsys.readouterr().err
    assert main(["fsdp", "--sharding", "FULL_SHARD", "--output", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["engine_overrides"]["inner.strategy"] == "fsdp"


# -- slurm -------------------------------------------------------------------------------------------------

def _slurm_stubs(bin_dir: Path, nodes: list[str], me: str) -> None:
    """scontrol prints the allocation, hostname says which node this is, srun runs its command as node 1."""
    bin_dir.mkdir()
    stubs = {
        "scontrol": f'[ "$1 $2" = "show hostnames" ] && printf "%s\\n" {" ".join(nodes)}',
        "hostname": f'echo {me}',
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; '
                'SLURM_NODEID=1 SLURM_NNODES=%d SLURM_JOB_ID=77 exec "$@"' % len(nodes),
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("layout", ["diloco", "global"])
def test_slurm_script_runs_torchrun_per_node(lab, tmp_path, layout):
    script = tmp_path / "job.sbatch"
    assert main(["slurm", str(lab["profile"]), "--nodes", "2", "--gpus-per-node", "8", "--time", "48:00:00",
                 "--layout", layout, "--partition", "gpu", "--output", str(script)]) == 0
    _bash_n(script)
    text = script.read_text()
    for line in ["#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --time=48:00:00",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu", "#SBATCH --job-name=t-run"]:
        assert line in text.splitlines()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text and SECRET not in text
    _slurm_stubs(tmp_path / "bin", ["n1", "n2"], me="n2")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-2]",
           "HF_TOKEN": "x", "NCCL_DEBUG": "INFO"}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    (call,) = _calls(lab["log"], "torch.distributed.run")
    argv, got = call["argv"], call["env"]
    assert argv[:2] == ["-m", "torch.distributed.run"] and "--nproc_per_node=8" in argv
    assert argv[argv.index("engine.train") + 1] == "configs/debug.toml"
    assert "--run.dir=runs/with space/n2" in argv and "--mesh.drain_file=runs/with space/n2/drain" in argv
    assert got["GLOBAL_ADDR"] == "n1" and got["GLOBAL_PORT"] == "29611" and got["ODD"] == HOSTILE
    assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and got["NCCL_DEBUG"] == "INFO"  # the user's wins
    if layout == "diloco":
        assert "--standalone" in argv and "--diloco.min_nodes=2" in argv
        assert (got["GLOBAL_UNIQUE_ID"], got["GLOBAL_RANK"], got["GLOBAL_WORLD_SIZE"]) == ("n2-77", "1", "2")
    else:
        assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=n1:29500",
                "--rdzv-id=77"} <= set(argv)
        assert (got["GLOBAL_UNIQUE_ID"], got["GLOBAL_RANK"], got["GLOBAL_WORLD_SIZE"]) == ("job-77", "0", "1")
    # the engine accepts the command line it is given
    overrides = argv[argv.index("engine.train") + 2:]
    cfg = load_config(ROOT / "configs" / "debug.toml", overrides)  # its words, as engine/train.py reads them
    assert cfg.train.max_steps == 7 and cfg.data.path == HOSTILE and cfg.run.dir == "runs/with space/n2"
    assert not list(lab["work"].glob("PWNED*"))


@pytest.mark.parametrize("args,fragment", [
    (["--time", "two days"], "--time: 'two days' is not a SLURM time"),
    (["--time", "1:00:00", "--partition", "gpu;rm"], "--partition: 'gpu;rm' must be letters"),
])
def test_slurm_bad_values_are_one_line(lab, tmp_path, capsys, args, fragment):
    base = ["slurm", str(lab["profile"]), "--nodes", "2", "--gpus-per-node", "8", "--output", str(tmp_path / "j")]
    assert main(base + args) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err
    assert not (tmp_path / "j").exists()
