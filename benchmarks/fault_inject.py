#!/usr/bin/env python
"""train.py with a probe and at most one injected fault: how benchmarks/faults.py runs it.

    LONGCTX_FAULTS_PROBE=DIR LONGCTX_FAULT='{"kind": "nan", "rank": 1, "step": 6}' \
        python benchmarks/fault_inject.py TRAIN.PY FLAGS...

Same flags as train.py; Lightning re-runs this file for the other ranks, which inherit the
environment. Without ``LONGCTX_FAULTS_PROBE`` and ``LONGCTX_FAULT`` nothing is patched.

Probe (``DIR``): every rank writes ``rank{R}.pid`` as it starts and appends one line per
optimizer step it completed to ``rank{R}.steps`` (``step`` = the trainer's global step after
it, then ``skips`` of the NonFiniteGuard, then with ``"checksums": true`` the sha1 of this
rank's parameter shards and of the full parameters), written with one ``os.write`` each so
that a SIGKILL loses nothing; ``rank{R}.fit`` once the rank's ``on_fit_start`` ran (the
process group and the watchdog exist by then).

Faults (``kind``; ``rank``: the rank it hits; ``step``: the global step it hits at):
* ``stall``: the rank sleeps ``seconds`` inside ring attention, between the first and the
  second block of a forward (a hop is in flight), at ``step``;
* ``nan``: after the backward of ``step`` (gradients reduced: sharded under FSDP2), one
  element of the rank's first local gradient becomes NaN (``"value": "inf"``: +Inf);
* ``enospc``: the rank's first shard file of the checkpoint saved at ``step`` raises
  ``OSError(ENOSPC)`` after 4 KiB (a disk that filled up during a sharded save);
* ``sigkill_in_save``: the rank SIGKILLs itself after 4 KiB of that file (a rank killed,
  by the OOM killer say, while the others wait in the save's collectives);
* ``pause``: every rank sleeps ``seconds`` after ``on_fit_start`` (a window before step 1).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

PROBE_ENV, FAULT_ENV = "LONGCTX_FAULTS_PROBE", "LONGCTX_FAULT"
# The launcher's rank (0) has neither variable; the ranks it or torchrun starts have them.
RANK = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _append(name: str, line: str) -> None:
    fd = os.open(Path(os.environ[PROBE_ENV]) / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _injected(what: str) -> None:
    """Say (stderr) and record (probe: ``rank{R}.fault``, the time) that the fault hits now."""
    print(f"[fault] rank {RANK}: {what}", file=sys.stderr, flush=True)
    if PROBE_ENV in os.environ:
        _append(f"rank{RANK}.fault", f"{time.time()} {what}")


def _sha1(tensors) -> str:
    import torch

    digest = hashlib.sha1()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _install(fault: dict) -> None:
    from torch.distributed.tensor import DTensor

    from longctx.lightning.module import CausalLMModule

    state = {"step": 0}  # the global step the running batch will complete
    kind, target, at = fault.get("kind"), fault.get("rank"), fault.get("step")
    here = target is None or target == RANK

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    before_batch = CausalLMModule.on_train_batch_start

    def on_train_batch_start(self, batch, batch_idx):
        state["step"], state["calls"] = self.trainer.global_step + 1, 0
        return before_batch(self, batch, batch_idx)

    def on_fit_start_probe(self):
        if PROBE_ENV in os.environ:
            _append(f"rank{self.global_rank}.fit", str(time.time()))
        if kind == "pause":
            time.sleep(float(fault.get("seconds", 5)))

    fit_start = CausalLMModule.on_fit_start

    def on_fit_start(self):
        fit_start(self)
        on_fit_start_probe(self)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if PROBE_ENV not in os.environ:
            return
        guard = next((c for c in self.trainer.callbacks if type(c).__name__ == "NonFiniteGuard"), None)
        fields = [str(self.trainer.global_step), str(getattr(guard, "skips", -1))]
        if fault.get("checksums"):
            params = [p for _, p in sorted(self.named_parameters())]
            full = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]  # collective: every rank
            fields += [_sha1(local(p) for p in params), _sha1(full)]
        _append(f"rank{self.global_rank}.steps", " ".join(fields))

    def on_after_backward(self):
        if kind == "nan" and here and state["step"] == at:
            grad = next(local(p.grad) for p in self.parameters() if p.grad is not None and local(p.grad).numel())
            grad.view(-1)[0] = float(fault.get("value", "nan"))
            _injected(f"{fault.get('value', 'nan')} written into a gradient at step {at}")

    CausalLMModule.on_train_batch_start = on_train_batch_start
    CausalLMModule.on_fit_start = on_fit_start
    CausalLMModule.on_train_batch_end = on_train_batch_end
    CausalLMModule.on_after_backward = on_after_backward

    if kind == "stall" and here:
        import longctx.ring as ring

        forward = ring.attention_forward

        def stalling_forward(*args, **kwargs):
            state["calls"] = state.get("calls", 0) + 1
            if state["step"] == at and state["calls"] == 2:
                _injected(f"stalling {fault['seconds']}s inside ring attention at step {at}")
                time.sleep(float(fault["seconds"]))
            return forward(*args, **kwargs)

        ring.attention_forward = stalling_forward

    if kind in ("enospc", "sigkill_in_save") and here:
        from torch.distributed.checkpoint.filesystem import FileSystem

        create_stream = FileSystem.create_stream
        mark = f"step{int(at):06d}"

        @contextmanager
        def failing_stream(self, path, mode):
            with create_stream(self, path, mode) as stream:
                if "w" in mode and mark in str(path):
                    stream.write(b"\0" * 4096)  # what was written before the failure
                    stream.flush()
                    if kind == "sigkill_in_save":
                        _injected(f"SIGKILL writing {path}")
                        os.kill(os.getpid(), signal.SIGKILL)
                    _injected(f"ENOSPC writing {path}")
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                yield stream

        FileSystem.create_stream = failing_stream


def main() -> int:
    # sys.argv stays [this file, train.py, flags]: Lightning re-runs it as is for the other ranks.
    train = Path(sys.argv[1]).resolve()
    fault = json.loads(os.environ.get(FAULT_ENV) or "{}")
    if PROBE_ENV in os.environ:
        _append(f"rank{RANK}.pid", str(os.getpid()))
    if fault or PROBE_ENV in os.environ:
        _install(fault)
    sys.path.insert(0, str(train.parent))
    import train as train_module

    return train_module.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
