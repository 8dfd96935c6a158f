"""Prefect tasks: thin wrappers over runners/ and store/; one node-level step each."""
