"""Layer runtime: what torchtitan.train imports on every rank (trainer, platforms, data,
console, preemption watch). Imports base and tracking, modeling and kernels; never launcher."""
