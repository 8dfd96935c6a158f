"""Every ``CKPTFLOW_*`` environment variable, in one model, read in one place.

Node-side behaviour that does not belong in a fleet file (it differs per machine or per
deployment) comes from the environment. Each variable is a field here with its meaning and
default; code asks ``settings()`` instead of ``os.environ``, so a value that cannot be used is
refused naming the variable, instead of being read as "unset" somewhere else.

Example:
    >>> s = settings({"CKPTFLOW_NODE": "gpu-node-01", "CKPTFLOW_NODE_LIMITS": "1"})
    >>> s.node, s.node_limits
    ('gpu-node-01', True)
    >>> settings({}).criu_ghost_limit
    '256M'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptflow.errors import ConfigError


class NetworkLock(StrEnum):
    """How CRIU keeps TCP peers quiet around a dump (criu --network-lock)."""

    nftables = "nftables"
    iptables = "iptables"
    skip = "skip"   # safe only when every peer is inside the dumped tree (a TP worker's ranks)


class Settings(BaseModel):
    """The ``CKPTFLOW_*`` environment of this process, one field per variable (its alias).

    Other ``CKPTFLOW_*`` names are ignored: a fleet file may name its own variables (a webhook
    URL, a chunk key), and scripts/ and bench/ have build-time ones of their own.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    node: str | None = Field(
        None, validation_alias="CKPTFLOW_NODE",
        description="Which fleet node this process runs on (default: the fleet's only node, else the "
        "hostname's first label).", examples=["gpu-node-01"])
    node_limits: bool = Field(
        False, validation_alias="CKPTFLOW_NODE_LIMITS",
        description="Serialise node steps through the Prefect global concurrency limit "
        "ckptflow-node-<node> (1 slot). `ckptflow deploy` sets it to 1 on every deployment; local runs "
        "(demo, tests in one process) go without.", examples=["1"])
    criu: str | None = Field(
        None, validation_alias="CKPTFLOW_CRIU",
        description="The criu binary (default: criu on PATH, else a bundle from scripts/criu-bundle.sh at "
        ".carry/criu or /opt/ckptflow/criu: runners.criu.find_criu).",
        examples=["/opt/criu/bin/criu"])
    criu_network_lock: NetworkLock = Field(
        NetworkLock.nftables, validation_alias="CKPTFLOW_CRIU_NETWORK_LOCK",
        description="How CRIU keeps TCP peers quiet around a dump: nftables, iptables, or skip (safe only "
        "when every peer is inside the dumped tree, e.g. a TP worker's ranks).", examples=["skip"])
    criu_ghost_limit: str = Field(
        "256M", validation_alias="CKPTFLOW_CRIU_GHOST_LIMIT",
        description="Largest unlinked-but-mapped file CRIU copies into an image (NCCL maps a deleted "
        "33 MiB /dev/shm segment per rank).", examples=["512M"])
    require_criu: str | None = Field(
        None, validation_alias="CKPTFLOW_REQUIRE_CRIU",
        description="1: the test suite fails instead of skipping when CRIU is unusable (`.ci/run` sets it).",
        examples=["1"])
    llamacpp_prefix: str | None = Field(
        None, validation_alias="CKPTFLOW_LLAMACPP_PREFIX",
        description="Install directory of llama.cpp's llama-server (default: the one "
        "scripts/install-llamacpp.sh made).")
    vllm_prefix: str | None = Field(
        None, validation_alias="CKPTFLOW_VLLM_PREFIX",
        description="A virtualenv with vLLM (default: the one scripts/install-vllm.sh made).")
    tp_stacks: str | None = Field(
        None, validation_alias="CKPTFLOW_TP_STACKS",
        description="Demo TP worker only: a directory where `kill -USR1 <rank>` writes that rank's Python "
        "stacks.")


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings from ``environ`` (default: this process's environment, read now).

    Read on every call, not cached: a deployment or a test may change the environment of a
    running process, and reading costs about 0.1 ms.

    Raises:
        ConfigError: a variable holds a value its field cannot take, naming the variable.
    """
    env = os.environ if environ is None else environ
    try:
        return Settings.model_validate({k: v for k, v in env.items() if k.startswith("CKPTFLOW_") and v != ""})
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, err['loc']))}={err.get('input')!r}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"environment: {bad}",
                          fix="correct or unset the variable (see ckptflow/settings.py for each one)") from None
