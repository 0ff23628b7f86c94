"""Deliberately broken backends: the example backend with one fault each (for the suite's meta-tests)."""
