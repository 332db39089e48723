"""LoRA adapters on the model side: their files read and checked against the model (files.py),
the device slots and every row's delta inside the wrapped projections (modules.py), and the
CUDA path's batched Triton kernels (kernel.py). The engine's side (served names, slots handed to
requests) is server/engine/adapters.py and lora_service.py."""
