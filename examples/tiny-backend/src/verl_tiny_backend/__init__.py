"""A small pure-torch verl backend (``tiny``), written by following docs/writing-a-backend.md.

Llama, Qwen2 and Qwen3 folders (and a value head for the critic) in plain torch; training, and a
rollout without a KV cache (the suite's models are tiny). It passes every check of the suite that
its capabilities enable; ``examples/third-party-backend`` is the fuller example.
"""
