"""Prefect flows: heartbeat, recover (and, as they land, invalidate, drain, verify, migrate)."""
