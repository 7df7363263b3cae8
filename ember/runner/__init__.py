"""The device side: the model runner, the persistent batch, the sampler, and the step-input contract."""
