"""The kernel: the contracts every engine and the trainer share (protocols, TensorBatch and its
schema, errors, capabilities, the weight-stream format, the registry and its hook specs).

Imports nothing else of verl_core; see docs/architecture.md.
"""
