"""``python -m paddle_fa4 demo [options]``: the HySparse walk-through (``paddle_fa4/demo.py``);
``python -m paddle_fa4 train-demo [options]``: train a tiny HySparse layer pair (``paddle_fa4/train_demo.py``);
``python -m paddle_fa4 decode-demo [options]``: a paged-cache decode loop, dense / HySparse / H2O (``paddle_fa4/decode_demo.py``)."""

from __future__ import annotations

import sys

USAGE = ("usage: python -m paddle_fa4 demo [--seq N] [--heads H] [--kv-heads G] [--seed S] [--out PNG] ...\n"
         "       python -m paddle_fa4 train-demo [--steps N] [--seq N] [--backend B] ...\n"
         "       python -m paddle_fa4 decode-demo [--batch N] [--prompt N] [--page-size P] [--backend B] ...\n")
COMMANDS = ("commands:\n  demo         the HySparse layer-pair walk-through (--help for options)\n"
            "  train-demo   train a tiny HySparse layer pair through the attention backward (--help for options)\n"
            "  decode-demo  a paged-cache decode loop: dense + block_logit, HySparse and H2O sparse decode (--help)\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE + COMMANDS)
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv[0] == "train-demo":
        from .train_demo import main as train_main

        return train_main(argv[1:])
    if argv[0] == "decode-demo":
        from .decode_demo import main as decode_main

        return decode_main(argv[1:])
    sys.stderr.write(f"unknown command {argv[0]!r}\n" + USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
