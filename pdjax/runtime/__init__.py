"""pdjax.runtime: ragged batches, the jitted step, sampling, the ModelRunner, meshes and shardings.

    batch.build_ragged_batch(...) -> RaggedBatch (numpy)      batch.Buckets
    step.make_step(spec, attention_fn, max_seqs=M) -> jitted step(params, kv_cache, batch, prev_ids)
        -> (SampledTokens: ids int32[M] + logprobs where batch.want_logprobs, kv_cache)
    runner.ModelRunner(spec, params, num_pages=..., page_size=..., buckets=...).execute(SchedulerOutput)
    mesh.make_mesh(devices, dp, pp, tp)
    probe: calibration grid and step-context timings of a runner     ceilings: the machine's measured ceilings
"""
