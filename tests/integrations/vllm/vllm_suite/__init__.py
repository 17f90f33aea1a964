"""Running vLLM's own offload tests against aiokvo (see plugin.py)."""
