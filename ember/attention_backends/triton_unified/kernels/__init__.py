"""ember.attention_backends.triton_unified.kernels"""
