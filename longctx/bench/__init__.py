"""What the benchmarks (benchmarks/) and their tests share: the training step the benchmarks
time outside Lightning (step), the max-context benchmark's fits and decisions
(max_context_fit) and peak attribution (peak_trace), the recheck of stored memory
measurements (memory_recheck), train.py runs read as such measurements (memory_runs), and
the long-context perplexity benchmark whole (long_context_ppl: its command line, run by
benchmarks/long_context_ppl.py; _eval, _inputs, _compare), which its test runs in-process.
Above the model layer, which it uses; nothing else in the library imports it."""
