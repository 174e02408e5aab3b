"""fairseq integration: `--optimizer bagua_fused` (filled in by the fairseq plugin issue)."""
