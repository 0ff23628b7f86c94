.PHONY: setup test lint demo bench
# Set up a fresh machine and run every check and test (what CI runs).
test:
	bash scripts/test.sh
setup:
	bash scripts/setup.sh
lint:
	bash scripts/test.sh lint
# The main job: set up, then a GRPO run on the built-in task with the transformers backend.
demo: setup
	.venv/bin/verl train examples/configs/grpo_demo.toml
