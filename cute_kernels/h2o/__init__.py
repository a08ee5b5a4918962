"""H2O heavy-hitter decode ops on Paddle's paged KV layout (see docs/api.md, ``paddle_fa4.h2o``)."""
