"""A test plugin distribution for the verl registry."""
