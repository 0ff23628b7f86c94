"""Supervised fine-tuning on prompt/response pairs, with the RL trainer's engines, scheduler and run folder."""
