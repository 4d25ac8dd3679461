"""GPU part: NVML discovery (nvml), the CUDA driver checkpoint API (cuda_checkpoint), whole process trees (tree)."""
