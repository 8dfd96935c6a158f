"""Can a multi-GPU (tensor-parallel) worker be checkpointed at all? Pure.

The CUDA checkpoint API saves and restores each process's device memory; it does not carry
NCCL's peer-to-peer mappings, shared-memory rings between ranks, or NVLink multicast (NVLS)
objects. A TP worker is checkpointable only when NCCL was started without those transports,
so every rank talks through host sockets — which CRIU restores with the process tree:
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0``. And ``USE_LIBUV=0``:
torch.distributed's TCPStore otherwise runs on libuv, which maps an io_uring ring that CRIU
cannot dump (measured on the H200 with torch 2.11; ``UV_USE_IO_URING=0`` did not stop it).
The environment is read once at init, so a
worker started otherwise must be restarted, not reconfigured.

Example:
    >>> tp_problems(2, [dict(NCCL_REQUIRED)] * 2)
    []
    >>> tp_problems(2, [{}, {}])[0]
    'rank process 0: NCCL_P2P_DISABLE is unset, needs 1'
"""

from __future__ import annotations

NCCL_REQUIRED = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "USE_LIBUV": "0"}
FIX = ("restart the worker with " + " ".join(f"{k}={v}" for k, v in NCCL_REQUIRED.items())
       + " in every rank's environment (read once, at init)")


def tp_problems(world_size: int, rank_envs: list[dict[str, str]]) -> list[str]:
    """Why a worker of ``world_size`` GPU processes with these environments cannot be
    checkpointed (empty: it can). ``rank_envs``: one environment per process holding a GPU."""
    if world_size <= 1:
        return []
    out = []
    if len(rank_envs) != world_size:
        out.append(f"found {len(rank_envs)} GPU process(es), the workload declares tensor_parallel: {world_size} "
                   "(a rank missing or not started yet; all ranks are checkpointed together or none)")
    for i, env in enumerate(rank_envs):
        for k, want in NCCL_REQUIRED.items():
            got = env.get(k)
            if got != want:
                out.append(f"rank process {i}: {k} is {'unset' if got is None else repr(got)}, needs {want}")
    return out
