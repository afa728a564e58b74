"""pdjax.models: the Llama-family model (pure forward over pytree params) and its weights.

    llama.init_params(spec, seed, dtype) -> LlamaParams       llama.init_kv_cache(spec, num_pages, ...) -> KVCache
    llama.forward_hidden(params, kv_cache, batch, *, spec, attention_fn) -> (hidden [T, H], kv_cache)
                                                             (batch: a pdjax.runtime.batch.RaggedBatch)
    checkpoint.load_model(checkpoint) -> (spec, params)       (HF dir | orbax dir | registry spec name)
    params.param_table(spec) -> LlamaParams of WeightInfo   (the one per-weight table: shape, logical axes,
                                                             dtype and init rule, pipeline placement)
"""
from pdjax.models.llama import KVCache, init_kv_cache, init_params
from pdjax.models.params import LayerParams, LlamaParams, WeightInfo, param_table

__all__ = ["KVCache", "LayerParams", "LlamaParams", "WeightInfo", "init_kv_cache", "init_params", "param_table"]
