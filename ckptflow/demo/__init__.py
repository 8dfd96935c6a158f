"""Demo workers: real processes that behave like a serving engine, for demos and tests."""
