"""The RL trainer: one controller driving generation, rewards, forwards, advantages, the update and weight sync."""
