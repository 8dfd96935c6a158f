"""The one comparison of a restored worker's session digests with those its checkpoint recorded.

A restore in place (runners/node.py, runners/container.py), a sandbox copy beside the original
(runners/verify.py) and a two-tier import (runners/template_sessions.py) all ask the same question; each
turns the answer into its own outcome (RestoreFailed, verify_failed, unverified).

Example:
    >>> from ckptflow.models import EngineProbe, Manifest, VerifyOutcome, Workload
    >>> c = compare_sessions(EngineProbe(sessions={"a": "1", "b": "2"}), EngineProbe(sessions={"a": "1", "b": "9"}))
    >>> c.outcome.value, c.differing, c.named()
    ('differ', ('b',), 'b')
    >>> compare_sessions(EngineProbe(error="probe failed: HTTP 500"), None).why
    'probe failed: HTTP 500'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, Field

from ckptflow.models import EngineProbe, Manifest, VerifyOutcome, Workload

NAMED = 5  # sessions a message names; the rest are counted in the typed result only


class SessionMatch(StrEnum):
    """How the restored worker's sessions compare with the checkpoint's."""

    equal = "equal"                 # every recorded session holds its digest, and no other session is there
    differ = "differ"               # a session differs, is missing or is new (``differing``), or the copy's probe failed
    unverifiable = "unverifiable"   # nothing to compare: ``why``


class SessionComparison(BaseModel):
    """The typed answer of ``compare_sessions``."""

    model_config = {"frozen": True}

    outcome: SessionMatch = Field(..., description="equal, differ or unverifiable.")
    differing: tuple[str, ...] = Field((), description="Sorted ids of the sessions whose digest differs or "
                                       "that only one side holds.")
    compared: int = Field(0, ge=0, description="Sessions found equal (outcome equal).")
    why: str = Field("", description="Why nothing could be compared (unverifiable), or why the copy's probe "
                     "gave no sessions (differ without differing sessions).")

    @property
    def equal(self) -> bool:
        return self.outcome is SessionMatch.equal

    def named(self, n: int = NAMED) -> str:
        """The first ``n`` differing sessions for a message, else ``why``."""
        return ", ".join(self.differing[:n]) or self.why


def compare_sessions(recorded: EngineProbe, got: EngineProbe | None,
                     copy: str = "the sandbox copy") -> SessionComparison:
    """The sessions ``got`` (the restored worker's probe; None: not read) against ``recorded``
    (the checkpoint's probe). ``copy`` names the restored worker in ``why``.

    Unverifiable when the checkpoint recorded no digests (its probe's error says why) or the copy's
    probe returned none without an error; a copy whose probe failed differs in every session.
    """
    want = recorded.sessions
    if want is None:
        return SessionComparison(outcome=SessionMatch.unverifiable,
                                 why=recorded.error or "the checkpoint recorded no session digests")
    have = got.sessions if got is not None else None
    if have is None:
        if got is not None and got.error:
            return SessionComparison(outcome=SessionMatch.differ, differing=tuple(sorted(want)), why=got.error)
        return SessionComparison(outcome=SessionMatch.unverifiable, why=f"{copy}'s probe returned no sessions")
    if have == want:
        return SessionComparison(outcome=SessionMatch.equal, compared=len(have))
    return SessionComparison(outcome=SessionMatch.differ,
                             differing=tuple(sorted(k for k in set(want) | set(have) if have.get(k) != want.get(k))))


# --- the verdict of a verify: a copy's answers against its checkpoint ---------------------------
@dataclass
class VerifyResult:
    state: VerifyOutcome
    reason: str
    timings: dict[str, float] = field(default_factory=dict)
    log_tail: str = ""


def compare(w: Workload, m: Manifest, got: EngineProbe, t: dict) -> VerifyResult:
    """A healthy copy's probe against what the checkpoint recorded: its golden digest, then its
    session digests (``runners.digests``). Verified only when something declared was compared."""
    checked = []
    if w.golden:
        want, have = m.probe.golden, got.golden
        if want is None:
            return VerifyResult(VerifyOutcome.skipped, "the checkpoint recorded no golden digest (golden request failed "
                                "or was declared later)", t)
        if have != want:
            return VerifyResult(VerifyOutcome.verify_failed, f"golden output digest differs: {str(have)[:12]}... "
                                f"restored vs {want[:12]}... at checkpoint", t)
        checked.append("golden digest")
    if w.probe_url or m.probe.sessions is not None:
        c = compare_sessions(m.probe, got)
        if c.outcome is SessionMatch.differ:
            return VerifyResult(VerifyOutcome.verify_failed, f"session state differs from the checkpoint: {c.named()}", t)
        if c.equal:
            checked.append(f"{c.compared} session digest(s)")
        elif w.probe_url:  # declared, but there is nothing to compare: not proven
            return VerifyResult(VerifyOutcome.unverified, f"healthy, but sessions not compared: {c.why}"
                                + (f" ({' and '.join(checked)} equal)" if checked else ""), t)
    if not checked:  # a healthy copy proves only that it starts, not that it computes like the original
        return VerifyResult(VerifyOutcome.unverified, "healthy only: no golden request or probe declared, so nothing "
                            "compared the copy's state with the checkpoint (declare golden: or probe_url:)", t)
    return VerifyResult(VerifyOutcome.verified, " and ".join(checked) + " equal", t)
