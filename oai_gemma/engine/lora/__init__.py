"""LoRA adapters per request: PEFT adapters read and checked (`adapter.py`), the resident set with its LRU slots
(`registry.py`), and the per-row low-rank update beside the base linears in a step (`apply.py`)."""
