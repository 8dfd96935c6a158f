"""ckptflow's vLLM KV connector with the two changes its first H200 run needed (bench/vllm_gpu.py row c).

vLLM 0.26.0 on the H200 runs the V2 model runner, FlashAttention 3 and FULL_AND_PIECEWISE CUDA
graphs. There ``CkptflowConnector`` (ckptflow/engines/vllm_connector.py, unchanged here):
- killed the engine on the first prompt: ``save_file`` refused a block view copied to the CPU
  (``ValueError: You are trying to save a non contiguous tensor: model.layers.0.self_attn.attn``;
  the K/V-first layout's ``kv[:, block]`` keeps its strides through ``.to("cpu").clone()``);
- would miss the blocks completed by decode steps: full CUDA graphs replay attention without
  calling ``save_kv_layer``; a connector that saves per layer must ask for PIECEWISE graphs
  (``requires_piecewise_for_cudagraph``), as vLLM's own layer-wise connectors do.
Loaded by vLLM with ``kv_connector_module_path: vllm_kv_bench`` (bench/ on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

from ckptflow.engines.vllm_connector import CkptflowConnector


class BenchCkptflowConnector(CkptflowConnector):
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata: Any, **kwargs: Any) -> None:
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        for layers in self._pending.values():
            t = layers.get(layer_name)
            if t is not None and not t.is_contiguous():
                layers[layer_name] = t.contiguous()
