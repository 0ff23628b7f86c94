"""The `verl train`, `verl sft` and `verl export` subcommands."""
