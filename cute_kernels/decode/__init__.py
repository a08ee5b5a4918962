"""Paged split-KV decode attention (issue 41): one warp-MMA kernel for SM90 and SM100, plus its combine."""
