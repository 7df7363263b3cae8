"""ember.graphs: piecewise torch.compile and CUDA graphs. Nothing is imported here, so `import ember` stays light.

How a runner uses it (each module documents its API at the top):

    resolved = dispatcher.resolve_modes(config.compile, device, backends_of_each_kv_cache_group)
    sizes = buckets.resolve_capture_sizes(config.compile.cudagraph_capture_sizes, max_num_batched_tokens)
    manager = cuda_graph.CUDAGraphManager(device)
    forward = compile.compile_model(model, resolved.compile_mode, cache_key=compile.compile_cache_key(hf_config, dtype),
                                    graph_manager=manager if resolved.cudagraph_mode.has_piecewise else None)
    if resolved.cudagraph_mode.has_full:
        forward = manager.wrap_full(forward)
    steps = dispatcher.CudaGraphDispatcher(resolved.cudagraph_mode, sizes, max_num_seqs, resolved.support)
    forward(input_ids[:max_num_batched_tokens], positions[:max_num_batched_tokens])  # first call compiles
    manager.capture_all(run_dummy_step, steps.capture_list())    # run_dummy_step(mode, desc): one padded step

    # each step
    mode, desc = steps.dispatch(num_tokens, num_reqs, uniform_decode)
    # pad tokens to desc.num_tokens and requests to desc.padded_num_reqs(num_reqs), build metadata, then
    with forward_context(ForwardContext(layers, metadata, batch_descriptor=desc, cudagraph_runtime_mode=mode)):
        hidden = forward(input_ids[:desc.num_tokens], positions[:desc.num_tokens])
"""
