"""The full-depth memory runs of benchmarks/device/device_memory_full.sh as one table: per case the
memory model's prediction (recomputed from the run's own config.yaml) against the measured
``torch.cuda.max_memory_allocated`` (the fullest rank's), the ratio and whether it passes
(measured <= predicted <= 1.10 x measured), with tokens/s and MFU of the last step.

    python benchmarks/memory_full_table.py RUNS --out $OUT/memory_full.json [--readme]

RUNS holds one folder per case (``longctx.bench.memory_runs``). ``--readme`` also prints the
rows in the README's table format. ``memory_validate.py --recheck`` takes the JSON later.
"""

from __future__ import annotations

from longctx.bench.memory_runs import table_main

if __name__ == "__main__":
    raise SystemExit(table_main())
