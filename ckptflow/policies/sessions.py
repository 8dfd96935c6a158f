"""Which sessions a two-tier heartbeat protects, and which it moves: one decision per session.

The workload's cadence policy (cadence.py) decides *when* a heartbeat runs; this decides *what*
goes into it. Every session is protected, short ones too: a session left out of the checkpoint
is gone after a restore, and its client's next turn would silently start a fresh one (the
engine cannot tell a lost session from a new one), which no retry-cost saving is worth — a short
session's chunks are small. A session is exported when it changed since its last checkpoint
and otherwise kept as it was checkpointed (no bytes move). Pure: facts in, decisions with a
one-line reason out.

Example:
    >>> ds = decide_sessions([SessionFacts(id="chat", tokens=4000, tokens_at_ckpt=3500),
    ...                       SessionFacts(id="q", tokens=20),
    ...                       SessionFacts(id="idle", tokens=900, tokens_at_ckpt=900)])
    >>> [(d.id, d.protect, d.export) for d in ds]
    [('chat', True, True), ('q', True, True), ('idle', True, False)]
    >>> ds[0].reason, ds[1].reason
    ('grew by 500 tokens since its last checkpoint (4000 held)', 'new session (20 tokens)')
"""

from __future__ import annotations

from pydantic import BaseModel, Field

# Sessions shorter than this are left out of a checkpoint. 0: none is. A positive value loses
# those sessions in a restore without their clients being told (they restart fresh), so it is
# for an engine that answers a lost session with an error, not the default.
MIN_TOKENS = 0


class SessionFacts(BaseModel):
    """One session as the engine reports it, and as its last checkpoint holds it."""

    id: str = Field(..., description="The engine's session id.", examples=["chat-17"])
    tokens: int = Field(..., ge=0, description="Tokens the session holds now (its KV length).")
    tokens_at_ckpt: int | None = Field(None, ge=0, description="Tokens its last checkpoint holds "
                                       "(None: never checkpointed).")


class SessionDecision(BaseModel):
    id: str
    protect: bool = Field(..., description="Whether the checkpoint holds this session at all.")
    export: bool = Field(..., description="Whether its state moves now (else: kept as last checkpointed).")
    reason: str


def decide_sessions(sessions: list[SessionFacts], *, min_tokens: int = MIN_TOKENS) -> list[SessionDecision]:
    out = []
    for s in sessions:
        if s.tokens < min_tokens:
            out.append(SessionDecision(id=s.id, protect=False, export=False,
                                       reason=f"short ({s.tokens} tokens < min_tokens {min_tokens}): left out, "
                                              "lost in a restore"))
        elif s.tokens_at_ckpt is None:
            out.append(SessionDecision(id=s.id, protect=True, export=True,
                                       reason=f"new session ({s.tokens} tokens)"))
        elif s.tokens == s.tokens_at_ckpt:
            out.append(SessionDecision(id=s.id, protect=True, export=False,
                                       reason=f"unchanged since its last checkpoint ({s.tokens} tokens)"))
        elif s.tokens > s.tokens_at_ckpt:
            out.append(SessionDecision(id=s.id, protect=True, export=True,
                                       reason=f"grew by {s.tokens - s.tokens_at_ckpt} tokens since its last "
                                              f"checkpoint ({s.tokens} held)"))
        else:
            out.append(SessionDecision(id=s.id, protect=True, export=True,
                                       reason=f"rewritten ({s.tokens} tokens, its checkpoint holds {s.tokens_at_ckpt})"))
    return out
