"""Is a checkpoint restorable here? Compare its fingerprint with the target's. Pure.

Gated fields (any difference refuses the restore before a CRIU or CUDA call):

| group    | fields                                    | why                                          |
|----------|-------------------------------------------|----------------------------------------------|
| host     | arch, kernel, glibc, criu                 | CRIU images and mapped libraries are tied to them |
| host     | cpu_features (a subset test: the target CPU has every feature the checkpoint's CPU had) | a restored process keeps running the code it dispatched at start-up (AVX-512, AMX kernels) |
| gpu      | gpu_model, gpu_count, driver, cuda_driver | the driver restores device state it wrote    |
| workload | engine, engine_version, model_id, model_revision | a restored engine would serve the old model |
| container | container_runtime, oci_runtime (container workloads) | the runtime writes and reads its own export format |
| gpu-<backend> | a GPU backend's own fields (its ``gated_fields``) | that vendor's driver or firmware restores what it wrote |

A GPU backend adds its group when it registers (runners/gpu ``register_backend`` calls
``gate_group``); the node runner gates the groups of the node's backend (``GpuBackend.gated``).

Not gated: GPU UUIDs (remapped on restore), python and ckptflow versions (recorded only).

A gated field the checkpoint did not record (an older manifest, a node without NVML) while this
node knows it is a difference, not a pass: nothing says the checkpoint was taken on the same
driver, so it is refused like any other difference (``None -> '580.1'``) unless overridden.

Example:
    >>> diff(Fingerprint(driver="580.1"), Fingerprint(driver="590.2")).differences
    {'driver': ('580.1', '590.2')}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptflow.models import Fingerprint, Manifest

# Gated as a subset, not an equality: a CPU with more features runs the restored process as well.
SUBSET = frozenset({"cpu_features"})

GATED = {
    "host": ("arch", "kernel", "glibc", "criu", "cpu_features"),
    "gpu": ("gpu_model", "gpu_count", "driver", "cuda_driver"),
    "workload": ("engine", "engine_version", "model_id", "model_revision"),
    "container": ("container_runtime", "oci_runtime"),
}


def gate_group(group: str, fields: tuple[str, ...]) -> str:
    """Gate ``fields`` as fingerprint group ``group`` from now on (a GPU backend's own fields);
    returns ``group``. A built-in group cannot be redefined.

    Example:
        >>> gate_group("gpu-toy", ("toy_firmware",))
        'gpu-toy'
        >>> diff(Fingerprint(toy_firmware="1.0"), Fingerprint(toy_firmware="1.1"), groups=("gpu-toy",)).differences
        {'toy_firmware': ('1.0', '1.1')}
        >>> _ = GATED.pop("gpu-toy")
    """
    if group in _BUILTIN and GATED[group] != tuple(fields):
        raise ValueError(f"fingerprint group {group!r} is built in ({', '.join(GATED[group])}); name the backend's own group")
    GATED[group] = tuple(fields)
    return group


_BUILTIN = frozenset(GATED)


@dataclass
class Compat:
    differences: dict[str, tuple[object, object]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)      # known on neither side: nothing to compare
    overridden: dict[str, tuple[object, object]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differences

    def reason(self) -> str:
        return "; ".join(_say(k, a, b) for k, (a, b) in self.differences.items())


def _say(field: str, a: object, b: object) -> str:
    if field in SUBSET and a is not None and b is not None:
        return f"{field}: this CPU lacks {', '.join(sorted(set(a) - set(b)))}"  # type: ignore[arg-type]
    return f"{field}: {a!r} -> {b!r}"


def diff(old: Fingerprint | None, new: Fingerprint, overrides: frozenset[str] | set[str] = frozenset(),
         groups: tuple[str, ...] = ("host", "gpu", "workload")) -> Compat:
    """Differences of the gated fields, old -> new.

    A field the old fingerprint lacks (an older manifest, or no fingerprint at all) while the new
    one has it is a difference (fail closed); a field neither knows is listed in ``skipped``; a
    field in ``overrides`` is reported as overridden instead of refused.

    Example:
        >>> diff(Fingerprint(), Fingerprint(driver="580.1"), groups=("gpu",)).differences
        {'driver': (None, '580.1')}
        >>> diff(Fingerprint(cpu_features=["avx2"]), Fingerprint(cpu_features=["amx_tile", "avx2"]), groups=("host",)).ok
        True
        >>> diff(Fingerprint(cpu_features=["amx_tile", "avx2"]), Fingerprint(cpu_features=["avx2"]), groups=("host",)).reason()
        'cpu_features: this CPU lacks amx_tile'
    """
    out = Compat()
    old = old if old is not None else Fingerprint()
    for g in groups:
        for f in GATED[g]:
            a, b = getattr(old, f, None), getattr(new, f, None)
            if a is None and b is None:
                out.skipped.append(f)
            elif f in SUBSET and a is not None and b is not None:
                if not set(a) <= set(b):
                    (out.overridden if f in overrides else out.differences)[f] = (a, b)
            elif a != b:
                (out.overridden if f in overrides else out.differences)[f] = (a, b)
    return out


def stale(manifests: list[Manifest], current: dict[str, Fingerprint], gpu: bool,
          runtime_groups: tuple[str, ...] = (), gpu_groups: tuple[str, ...] = ("gpu",)) -> list[tuple[Manifest, str]]:
    """Restorable checkpoints that no eligible node can restore any more, with the reason.

    ``current`` maps each eligible node (same GPU class as the workload's node) to its
    fingerprint now, with the workload's current engine and model filled in. A checkpoint
    stays valid while one of them still matches; with no node known, nothing is judged.
    ``gpu_groups``: the groups the nodes' GPU backend gates (``GpuBackend.gated``);
    ``runtime_groups``: those the workload's runtime adds (``WorkloadRuntime.gated``: a container's
    runtime versions).
    """
    if not current:
        return []
    groups = ("host", *gpu_groups, "workload") if gpu else ("host", "workload")
    groups += tuple(runtime_groups)  # a container workload: its runtime's versions too
    out = []
    for m in manifests:
        if not m.state.restorable:
            continue
        diffs = {node: diff(m.fingerprint, fp, groups=groups) for node, fp in current.items()}
        if all(not c.ok for c in diffs.values()):
            node = m.node if m.node in diffs else sorted(diffs)[0]
            out.append((m, f"no eligible node can restore it; on {node}: {diffs[node].reason()}"))
    return out
