"""What the benchmarks (benchmarks/) and their tests share: the training step the benchmarks
time outside Lightning, and the max-context benchmark's fits, decisions and peak attribution.
Nothing in the library imports it."""
