"""Block-sparse attention over per-query selected key blocks (HySparse sparse layers)."""
