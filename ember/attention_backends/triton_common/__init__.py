"""What the Triton attention backends (`triton_unified`, `flash`) share: device helpers (`tiles`), the KV-cache
write (`kv_write`), the device and dtype checks (`device`) and the choice of a compiled or an interpreted kernel
for the tensors' device (`interpreted`). It imports nothing from ember but `ember.kernels`."""
