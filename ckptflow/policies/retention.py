"""Which checkpoints to delete. The newest valid checkpoint is never among them.

Example (fleet file)::

    retention: {keep: 3, max_age_h: 72, invalidated_grace_h: 24}
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field

from ckptflow.models import CheckpointState, Manifest


class Retention(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key would silently keep the defaults

    keep: int = Field(3, ge=1, description="Keep this many newest restorable checkpoints.")
    max_age_h: float = Field(72, gt=0, description="Delete restorable checkpoints older than this "
                             "(never the newest valid one).")
    invalidated_grace_h: float = Field(24, ge=0, description="Keep invalidated / failed ones this long "
                                       "(for post-mortems), then delete.")


def to_delete(manifests: list[Manifest], now: datetime, rule: Retention | None = None) -> list[tuple[Manifest, str]]:
    """Checkpoints to delete, each with the reason.

    Always kept: the newest verified valid checkpoint and the newest restorable one.

    Example:
        >>> from datetime import timezone
        >>> now = datetime(2026, 11, 29, 12, tzinfo=timezone.utc)
        >>> hourly = [Manifest(id=f"20261129T0{h}0000Z-0000000{h}", workload="chat", node="n1",
        ...                    created=now - timedelta(hours=10 - h)) for h in range(1, 5)]
        >>> [(m.id, why) for m, why in to_delete(hourly, now, Retention(keep=2))]
        [('20261129T020000Z-00000002', 'beyond the 2 newest'), ('20261129T010000Z-00000001', 'beyond the 2 newest')]
    """
    rule = rule or Retention()
    newest_first = sorted(manifests, key=lambda m: (m.created, m.id), reverse=True)
    restorable = [m for m in newest_first if m.state.restorable]
    protected = {m.id for m in restorable[:1]}
    verified = [m for m in restorable if m.state == CheckpointState.verified]
    if verified:
        protected.add(verified[0].id)
    out = []
    max_age = timedelta(hours=rule.max_age_h)
    grace = timedelta(hours=rule.invalidated_grace_h)
    for i, m in enumerate(restorable):
        if m.id in protected:
            continue
        if i >= rule.keep:
            out.append((m, f"beyond the {rule.keep} newest"))
        elif now - m.created > max_age:
            out.append((m, f"older than {rule.max_age_h:g} h"))
    for m in newest_first:
        if not m.state.restorable and now - m.created > grace:
            out.append((m, f"{m.state.value} for more than {rule.invalidated_grace_h:g} h"))
    return out


def templates_to_delete(templates: list[Manifest], bound: set[str], now: datetime,
                        rule: Retention | None = None) -> list[tuple[Manifest, str]]:
    """Two-tier templates of one name (several source workloads may share it) to delete, each
    with the reason. A template is kept while it is the newest restorable one of its source
    workload (``probe.source.workload``) or a restorable session checkpoint is bound to it
    (``bound``: template ids); invalidated or failed ones go after the grace period like any
    checkpoint. The keep-N and age rules do not apply: they would take a template another
    workload's sessions still need.

    Example:
        >>> from datetime import timezone
        >>> now = datetime(2026, 11, 30, 12, tzinfo=timezone.utc)
        >>> def t(h, source, state=CheckpointState.complete):
        ...     return Manifest(id=f"20261130T0{h}0000Z-0000000{h}", workload="template-ab12", node="n1",
        ...                     created=now - timedelta(hours=10 - h), state=state, kind="engine_template",
        ...                     probe={"source": {"workload": source}})
        >>> ts = [t(1, "chat"), t(2, "chat"), t(3, "api"), t(4, "chat", CheckpointState.invalidated)]
        >>> [(m.id[-2:], why) for m, why in templates_to_delete(ts, bound={ts[0].id}, now=now,
        ...                                                     rule=Retention(invalidated_grace_h=1))]
        [('04', 'invalidated for more than 1 h')]
        >>> [(m.id[-2:], why) for m, why in templates_to_delete(ts, bound=set(), now=now,
        ...                                                     rule=Retention(invalidated_grace_h=24))]
        [('01', 'replaced by a newer template of chat and no session checkpoint is bound to it')]
    """
    rule = rule or Retention()
    grace = timedelta(hours=rule.invalidated_grace_h)
    newest_first = sorted(templates, key=lambda m: (m.created, m.id), reverse=True)
    newest_of: dict[str, str] = {}
    for m in newest_first:
        if m.state.restorable:
            newest_of.setdefault(_source(m), m.id)
    out = []
    for m in newest_first:
        if not m.state.restorable:
            if now - m.created > grace:
                out.append((m, f"{m.state.value} for more than {rule.invalidated_grace_h:g} h"))
        elif m.id not in bound and newest_of.get(_source(m)) != m.id:
            out.append((m, f"replaced by a newer template of {_source(m)} "
                           "and no session checkpoint is bound to it"))
    return out


def _source(template: Manifest) -> str:
    """The workload a template was captured from ("None" for one that does not say)."""
    return str(template.probe.source.workload if template.probe.source else None)
