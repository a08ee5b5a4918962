"""Paddle glue of the CuTe backend: allocate with ``paddle.empty``, call ``cute_kernels`` launchers.

One module per op family, imported lazily by the public op modules only when the resolved backend
is ``"cute"``. Each exposes ``unsupported_reason(arch, ...) -> str | None`` and out-parameter calls.
"""
