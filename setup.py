"""paddle_fa4: CuTe-DSL attention kernels (FA4-class) for PaddlePaddle, with fused block_logit.

Paddle itself is not a hard requirement: users with ``paddlepaddle-gpu`` keep theirs; ``pip install
.[cpu]`` pulls the CPU wheel for machines without one.
"""

from setuptools import find_packages, setup

setup(
    name="paddle_fa4",
    version="0.1.0",
    description="FlashAttention-4-class CuTe-DSL attention kernels for PaddlePaddle (block_logit, "
                "indexed attention, H2O)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["paddle_fa4", "paddle_fa4.*", "cute_kernels", "cute_kernels.*"]),
    install_requires=[
        "nvidia-cutlass-dsl==4.8.1",
        "apache-tvm-ffi>=0.1.11,<0.2",
        "numpy",
    ],
    extras_require={
        "cpu": ["paddlepaddle==3.3.1"],
        "test": ["pytest", "matplotlib"],
        "demo": ["matplotlib"],
    },
)
