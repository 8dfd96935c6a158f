"""ckptflow's methods inside each vLLM worker process (vLLM's ``--worker-extension-cls``): a
template's weights written as ckptflow's chunks before the engine sleeps, and streamed back
from them into the same parameters after it wakes, instead of ``reload_weights`` reading the
model directory again.

Loaded by vLLM into every worker (the class is mixed into the worker class) and called by the
middleware (engines/vllm_protocol.py) through the engine client's ``collective_rpc``, so each
tensor-parallel rank writes and loads its own shard::

    python -m vllm.entrypoints.openai.api_server ... \\
      --worker-extension-cls ckptflow.engines.vllm_worker.CkptflowWorkerExtension

Why the parameters alone: sleep level 2 discards the memory tagged "weights" (every parameter
and buffer made while the model loaded); vLLM keeps the buffers (rotary tables and the like) on
the host across a level-2 sleep and puts them back on wake, and ``reload_weights`` itself only
loads parameters. So the parameters' bytes after loading (post-processing included) are what
``reload_weights`` would have rebuilt, and copying them back is the same engine.

Measured on the H200 (bench/vllm_gpu.py row p) against ``reload_weights`` (15 GiB at ~4.7
GiB/s from page cache): see docs/engines/vllm.md. Imports only the standard library, torch and
engines/weight_chunks.py: it runs in vLLM's processes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ckptflow.engines.weight_chunks import export_tensors, import_tensors

EXTENSION = "ckptflow.engines.vllm_worker.CkptflowWorkerExtension"


class CkptflowWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (its ``model_runner`` holds the model)."""

    def _ckptflow_rank(self) -> int:
        return int(getattr(self, "rank", 0) or 0)

    def _ckptflow_params(self) -> dict[str, Any]:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        rank = self._ckptflow_rank()
        return {f"{rank}:{name}": p.data for name, p in model.named_parameters()}

    def ckptflow_export_weights(self, out_dir: str, known: list[str]) -> dict:
        """This rank's parameters as chunks in ``out_dir`` (those in ``known`` not written): their
        records (named ``<rank>:<parameter>``), bytes written and in all, seconds."""
        t0 = time.perf_counter()
        params = self._ckptflow_params()
        recs, written = export_tensors(params.items(), Path(out_dir), set(known))
        return {"rank": self._ckptflow_rank(), "tensors": recs, "written_bytes": written,
                "total_bytes": sum(r["nbytes"] for r in recs), "seconds": round(time.perf_counter() - t0, 4)}

    def ckptflow_import_weights(self, root: str, tensors: list[dict]) -> dict:
        """This rank's records of ``tensors`` loaded from the chunks under ``root`` into its
        parameters (matched by name, dtype and shape first; every chunk checked); bytes, seconds.

        Raises:
            ValueError: a record of this rank names no parameter of it, or a chunk is missing or torn.
        """
        t0 = time.perf_counter()
        prefix = f"{self._ckptflow_rank()}:"
        mine = [r for r in tensors if r["name"].startswith(prefix)]
        params = self._ckptflow_params()
        if not mine:
            raise ValueError(f"no weights of rank {self._ckptflow_rank()} in the template's records")
        missing = sorted(set(params) - {r["name"] for r in mine})
        if missing:
            raise ValueError(f"the template's records lack {len(missing)} parameter(s) of this engine, "
                             f"e.g. {missing[0]}")
        loaded = import_tensors(mine, params, Path(root))
        return {"rank": self._ckptflow_rank(), "loaded_bytes": loaded, "seconds": round(time.perf_counter() - t0, 4)}
