"""Framework-neutral CuTe-DSL kernels behind paddle_fa4.

Nothing here imports paddle or torch. Every kernel family has a ``launch.py`` whose functions take
out-parameters as any DLPack tensor (Paddle in production, torch on the GPU test machine) and run
on the caller's current stream (TVM-FFI env stream). Kernels are imported where used so that
``import cute_kernels`` stays cheap and GPU-free.
"""

__version__ = "0.1.0"

#: The exact nvidia-cutlass-dsl version the kernels are written against (minor releases break APIs).
CUTLASS_DSL_VERSION = "4.8.1"
