"""What every task shares: opening the fleet and the store, and the retry rule."""

from __future__ import annotations

from pathlib import Path

from ckptflow.errors import CkptflowError
from ckptflow.fleet import Fleet, load_fleet
from ckptflow.runners.composite import NodeRunner
from ckptflow.store import open_store


def open_fleet(fleet_file: str) -> Fleet:
    return load_fleet(Path(fleet_file))


def node_runner(fleet: Fleet) -> NodeRunner:
    return NodeRunner(open_store(fleet.storage))


def retry_if_retryable(task, task_run, state) -> bool:
    """Prefect retry_condition_fn: retry only errors that say a retry can help.

    An incompatible checkpoint or a corrupt image never gets better by retrying it.
    """
    try:
        state.result()
    except CkptflowError as e:
        return e.retryable
    except Exception:
        return True
    return False
