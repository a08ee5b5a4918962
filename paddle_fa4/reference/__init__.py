"""Pure-Paddle fp32 reference backend of every op (CPU and GPU places; bf16/fp16 upcast)."""
