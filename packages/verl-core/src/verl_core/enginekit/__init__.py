"""The engine kit: what backend authors share (the rollout engine facade, sampling, precision,
retokenizing, bring-your-own model adapters). Imports only the kernel; see docs/architecture.md.
"""
