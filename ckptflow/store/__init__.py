"""Checkpoint images and manifests. No Prefect here."""
