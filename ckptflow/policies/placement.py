"""Where a restored or migrated workload should go.

Example:
    >>> place(80, "H200-141GB", [NodeState(name="a", gpu_class="H200-141GB", free_gib=100)]).node
    'a'
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class NodeState:
    name: str
    gpu_class: str
    free_gib: float                  # largest free GPU memory on one GPU of the node
    in_maintenance: bool = False     # in a window, or one starts within the move's horizon
    load: float = 0.0                # e.g. workloads already placed there, for spreading
    fingerprint_class: str | None = None


# A node whose window opens within this long after a move would make the workload move again
# right away: its own heartbeat decides "drain" from 15 min before the window (cadence's lead),
# and a move plus the checks after it take minutes.
MAINTENANCE_HORIZON_S = 3600.0


def in_maintenance(windows: list[tuple[float, float]], now: float, horizon_s: float = MAINTENANCE_HORIZON_S) -> bool:
    """Whether a node with these (start, end) windows (epoch seconds) is in one now, or one
    starts within ``horizon_s``: no place to move work to.

    Example:
        >>> in_maintenance([(1000.0, 2000.0)], now=500.0, horizon_s=600)
        True
    """
    return any(start - horizon_s <= now < end for start, end in windows)


@dataclass(slots=True)
class Placement:
    node: str | None
    reason: str


def place(footprint_gib: float, gpu_class: str, nodes: list[NodeState], *, exclude: tuple[str, ...] = (),
          margin_gib: float = 2.0, fingerprint_class: str | None = None) -> Placement:
    """Pick a node: same GPU (and fingerprint) class, not in maintenance, enough free memory
    for footprint + margin, least loaded first (spread), then most free memory, then name."""
    need = footprint_gib + margin_gib
    why: list[str] = []
    ok = []
    for n in nodes:
        if n.name in exclude:
            continue
        if n.gpu_class != gpu_class:
            why.append(f"{n.name}: GPU class {n.gpu_class} != {gpu_class}")
        elif fingerprint_class and n.fingerprint_class and n.fingerprint_class != fingerprint_class:
            why.append(f"{n.name}: fingerprint class differs")
        elif n.in_maintenance:
            why.append(f"{n.name}: in maintenance, or a window of its own starts within "
                       f"{MAINTENANCE_HORIZON_S / 3600:g} h")
        elif n.free_gib < need:
            why.append(f"{n.name}: {n.free_gib:.0f} GiB free < {need:.0f} GiB needed")
        else:
            ok.append(n)
    if not ok:
        return Placement(None, "no eligible node: " + ("; ".join(why) or "no candidates"))
    best = min(ok, key=lambda n: (n.load, -n.free_gib, n.name))
    return Placement(best.name, f"{best.name}: {best.free_gib:.0f} GiB free >= {need:.0f} GiB, load {best.load:g}")


class Spreader:
    """Places the workloads leaving one node on the others, one at a time, counting what it
    placed as load so they spread instead of piling onto the emptiest node.

    Example:
        >>> sp = Spreader("H200", [NodeState("b", "H200", 100), NodeState("c", "H200", 100)])
        >>> first = sp.place(10).node; sp.placed(first); (first, sp.place(10).node)
        ('b', 'c')
    """

    def __init__(self, gpu_class: str, nodes: list[NodeState]):
        self.gpu_class, self.nodes = gpu_class, nodes
        self.counts: dict[str, int] = {}

    def place(self, footprint_gib: float) -> Placement:
        for n in self.nodes:
            n.load = self.counts.get(n.name, 0)
        return place(footprint_gib, self.gpu_class, self.nodes)

    def placed(self, node: str) -> None:
        """Count a workload that did arrive on ``node``."""
        self.counts[node] = self.counts.get(node, 0) + 1
