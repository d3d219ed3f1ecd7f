"""The CUDA/NCCL paths of features whose CPU/gloo paths are tested elsewhere (test_train, test_checkpoint,
test_diloco_e2e, test_telemetry). Skipped only where the hardware is absent: these need one or two GPUs."""

from __future__ import annotations

import pytest
import torch

from procs import PYTHON, free_port
from test_train import PARITY_TOL, Result, parse_events, run_engine

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (the CPU path is tested in test_train.py)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs (the gloo path is tested in test_train.py)")

pytestmark = pytest.mark.gpu


@one_gpu
def test_single_gpu_bf16_trains_and_reports_nvml(procs, tmp_path):
    r = run_engine(procs, tmp_path / "gpu", "--train.max_steps=12", "--inner.device=cuda",
                   "--train.precision=bf16-mixed", "--telemetry.resource_interval=0.2")
    assert r.rc == 0, r.stderr[-3000:]
    losses = r.losses()
    assert losses[12] < losses[1] - 0.5, losses
    gpu = [e for e in r.of("resource") if e["device"] == "gpu"]
    assert gpu and gpu[0]["mem_total"] > 0 and "temp_c" in gpu[0] and "power_w" in gpu[0]


@one_gpu
def test_gpu_and_cpu_fp32_losses_agree(procs, tmp_path):
    """Same seed, data and fp32 math on CUDA and CPU: the first steps agree within a loose bound (kernels differ)."""
    steps = ["--train.max_steps=4"]
    gpu = run_engine(procs, tmp_path / "g", *steps, "--inner.device=cuda")
    cpu = run_engine(procs, tmp_path / "c", *steps, "--inner.device=cpu")
    assert gpu.rc == cpu.rc == 0, gpu.stderr[-2000:] + cpu.stderr[-2000:]
    assert all(abs(gpu.losses()[s] - cpu.losses()[s]) < 1e-2 for s in range(1, 5))


@two_gpus
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_two_gpus_match_one_gpu(procs, tmp_path, strategy):
    steps = ["--train.max_steps=6", "--inner.device=cuda"]
    one = run_engine(procs, tmp_path / "one", *steps)
    two = run_engine(procs, tmp_path / strategy, *steps, f"--inner.strategy={strategy}", nproc=2)
    assert one.rc == two.rc == 0, two.stderr[-3000:]
    a, b = one.losses(), two.losses()
    # NCCL reductions in another order than one process: looser than the gloo PARITY_TOL
    assert all(abs(a[s] - b[s]) < 100 * PARITY_TOL for s in a), (a, b)


@one_gpu
@pytest.mark.parametrize("second,codec", [("cuda", "int8"), ("cpu", "int8"), ("cpu", "none")])
def test_diloco_on_the_gpu_keeps_every_node_identical(procs, tmp_path, second, codec):
    """Two DiLoCo nodes, the first on the GPU and the second on the GPU too or on the CPU (mixed hardware), with
    the outer step's CUDA paths on: buffers beside the parameters, the codec, Nesterov with momentum (its memory
    reserved at start on the device), the overlapped outer step on its background thread. Every outer step's
    checksum agrees across the nodes and moves, and the run finishes. With "none", a GPU node once ran other
    collectives than a CPU node (the all-reduce was the host's alone) and a mixed run hung."""
    from test_diloco_e2e import assert_identical, finish, start_node, start_store

    port = free_port()
    start_store(procs, port)
    steps = ["--train.max_steps=12", "--diloco.min_nodes=2", "--diloco.overlap=true", "--diloco.outer_lr=0.7",
             "--diloco.outer_momentum=0.9", f"--diloco.compression={codec}"]
    nodes = [start_node(procs, port, "gpu", tmp_path, *steps, "--inner.device=cuda"),
             start_node(procs, port, second, tmp_path, *steps, f"--inner.device={second}")]
    for n in nodes:
        assert finish(n, 240, nodes) == 0, n.report()
    assert_identical(nodes)
    assert sorted(nodes[0].outer()) == [1, 2, 3, 4]


@one_gpu
@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "zero1", "zero2", "zero3"])
def test_the_150m_preset_resumes_and_exports_on_the_gpu(procs, tmp_path, strategy):
    """configs/150m.toml as shipped (bf16-mixed, seq 1024, eval on) with each inner strategy, its batch cut to 16
    sequences: 8 steps with a checkpoint at 4, then a new process that resumes from step 4 and exports. The resumed
    steps match the first run's (bf16 kernels with atomics: loosely), and the export generates on the GPU."""
    def engine(run_dir, *extra):
        done = procs.run([PYTHON, "-m", "engine.train", "configs/150m.toml", "--inner.device=cuda",
                          f"--inner.strategy={strategy}", "--train.batch_size=16", "--train.micro_batch_size=8",
                          "--train.max_steps=8", "--train.log_interval=1", "--train.eval_interval=4",
                          "--train.eval_batches=2", "--data.eval_percent=20", "--optim.warmup_steps=2",
                          "--telemetry.human=false", f"--run.dir={run_dir}", *extra], timeout=240)
        return Result(done.returncode, parse_events(done.stdout), done.stderr)

    full = engine(tmp_path / "full", "--ckpt.interval=4", "--ckpt.keep=3")
    assert full.rc == 0, full.stderr[-3000:]
    assert [e["step"] for e in full.of("checkpoint")] == [4, 8] and [e["step"] for e in full.of("eval")] == [4, 8]
    step4 = tmp_path / "full" / "checkpoints" / "step-00000004"
    export = tmp_path / "export"
    resumed = engine(tmp_path / "resumed", f"--ckpt.resume={step4}", f"--ckpt.export_dir={export}")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    a, b = full.losses(), resumed.losses()
    assert sorted(b) == [5, 6, 7, 8] and a[8] < a[1] - 1.0, (a, b)
    assert all(abs(a[s] - b[s]) < 2e-2 for s in b), (a, b)

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(export).cuda().eval()
    prompt = torch.tensor([[1, 2, 3, 4]], device="cuda")
    out = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], prompt)
