"""megatron-core as the recipe finds it: versions and feature probes (`versions`), the CPU patches
(`cpu_patches`, one registry installed once per process), log filters (`log_filters`)."""
