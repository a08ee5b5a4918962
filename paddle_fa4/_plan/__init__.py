"""Planners: plan types and the host rules / Paddle-op builders of the op families that reuse a plan.

``paddle_fa4/_plan/<family>.py`` imports neither the CuTe glue (``paddle_fa4._cute``) nor the reference
backend (``paddle_fa4.reference``); the public op module of the family validates and dispatches
(the layout rule of ``docs/design.md``).
"""
