"""Running a loaded model: the KV cache and its tiers (kv_cache.py, tiered_kv.py), generation (engine.py) and
decode from CUDA graphs that replay the model's own forward steps (decode_graphs.py)."""
