"""What a run reads: datasets and prompts, reward functions, user code by "module:attr", built-in tasks, the tiny default model."""
