"""The CPU path: pure-torch stand-ins for the Triton and CUDA kernels SGLang 0.5.23 needs for
speculative decoding, an attention backend that handles draft trees, and the hooks that route
SGLang to them when the device is a CPU."""
