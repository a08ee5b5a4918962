"""Independent float64 numpy oracles (never import ``paddle_fa4.reference``)."""
