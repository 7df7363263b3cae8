"""What the Triton attention backends (`triton_unified`, `flash`) share: device helpers (`tiles`), the KV-cache
write (`kv_write`), the device and dtype checks (`device`) and the loader of interpreted kernel copies for CPU
tensors (`interpreted`).

It imports nothing from ember but `ember.kernels`. Kernel modules import `tiles` relatively
(`from ...triton_common.tiles import cdiv`): an interpreted copy of a kernel module (see `interpreted`) then gets
interpreted copies of the helpers too, which compiled helpers could not stand in for. This file imports nothing,
so such a copy of the package costs nothing."""
