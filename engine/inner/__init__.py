"""Inside a node: the inner strategies applied to a plain model (DDP and FSDP2 in ddp_fsdp.py, DeepSpeed ZeRO 1/2/3
in zero.py, whose config builder deepspeed_config.py needs no torch: the console's recipes use it), the inner
optimizer and its schedule (optim.py), and the model transformations (transforms.py)."""
