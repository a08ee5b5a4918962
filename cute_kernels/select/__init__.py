"""Block selection kernels: cross-head top-k key blocks and their token indices (HySparse)."""
