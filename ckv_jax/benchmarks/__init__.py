"""Device benchmarks of ckv-jax kernels with their baselines, timed on the device."""
