"""Windowed indexed (QSA) attention: plan, forward, deterministic backward (CuTe DSL, SM90/SM100)."""
