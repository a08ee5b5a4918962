"""Device code shared by every kernel (``@cute.jit`` helpers only; no host logic, no paddle/torch)."""
