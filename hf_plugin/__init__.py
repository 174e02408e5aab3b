"""HuggingFace Trainer / Accelerate integration (filled in by the HF plugin issue)."""
