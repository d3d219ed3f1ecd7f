"""Inside a node: the inner strategies (DDP, FSDP2 in ddp_fsdp.py; DeepSpeed ZeRO 1/2/3 in zero.py) applied to a
plain model, the inner optimizer and schedule (optim.py) and the model transformations (transforms.py)."""

from engine.inner.ddp_fsdp import Inner, build_inner, resolve_device, setup_distributed
from engine.inner.optim import lr_factor, make_optimizer

__all__ = ["Inner", "build_inner", "lr_factor", "make_optimizer", "resolve_device", "setup_distributed"]
