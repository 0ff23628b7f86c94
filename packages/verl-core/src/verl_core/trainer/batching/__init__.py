"""How work is cut and stored: the micro-batch scheduler and its token budget, memory probes, the replay buffer and its batch files."""
