"""Attention forward kernels (SM90 and SM100) with fused block_logit."""
