.PHONY: setup test lint demo bench
# Set up a fresh machine and run every check and test (what CI runs).
test:
	bash scripts/test.sh
setup:
	bash scripts/setup.sh
lint:
	bash scripts/test.sh lint
# The main job: set up, then the demo recipe on the built-in tiny model with the transformers
# backend: a short SFT warm start (runs/demo/sft), its held-out exact match, then GRPO with the
# exact reward (runs/demo/grpo). Re-runnable: overwrite=true moves a previous run's folder aside
# to runs/demo/<stage>.old-<time> (nothing is deleted).
demo: setup
	.venv/bin/verl sft examples/configs/sft_demo.toml overwrite=true
	.venv/bin/python examples/demo/evaluate.py runs/demo/sft/model-sft
	.venv/bin/verl train examples/configs/grpo_demo.toml overwrite=true
