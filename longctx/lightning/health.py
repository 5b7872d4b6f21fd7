"""Numerical health: one decision, taken by every rank at once, about a non-finite step.

``NonFiniteGuard`` (a Lightning callback) asks before every optimizer step whether the loss
or any gradient is non-finite on *any* rank, then skips the step (``policy="skip"``) or stops
the run (``policy="stop"``) on all ranks together: one ``all_reduce(MAX)`` of a local flag.
A rank that decided alone would apply different updates from then on, or raise while the
others wait in the next collective until the process-group timeout.

The check runs in ``on_before_optimizer_step``: after the last micro-batch's backward, before
clipping and ``optimizer.step``. Under DDP the gradients are already the world average there,
but the loss is each rank's own (a loss can be non-finite with finite gradients), so the
all-reduce is needed; without DDP it covers the gradients too. Each micro-batch's loss is
observed in ``on_before_backward`` and OR-ed on the device (no sync).

The one host sync per step (an 8-byte copy of the flag) is needed: "skip" must withhold the
optimizer step itself, since AdamW moves the weights (momentum, weight decay) even at zero
gradient. "Skip" sets every gradient to None, so AdamW leaves each parameter, its moments and
its step count alone; the global step and a step-wise LR schedule still advance (a resumed run
sees the same learning rate at the same step). ``skips`` and ``consecutive`` are logged and
checkpointed; after ``max_skips`` consecutive skips ``NonFiniteError`` is raised on every
rank. A non-finite gradient *norm* counts as non-finite. fp16 with a GradScaler skips
overflow steps itself, so the guard warns at setup: use bf16.

Outside Lightning, call ``guard.observe_loss(loss)`` before each backward and
``guard.check(step, named_parameters, optimizer)`` before ``optimizer.step()``.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Literal, Optional, get_args

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..validation import ArgumentValueError, check_choice

Policy = Literal["skip", "stop"]
POLICIES = get_args(Policy)


class NonFiniteError(FloatingPointError):
    """Raised (on every rank, with the same message) when a step is non-finite.

    Attributes: ``step`` (the optimizer step index, ``trainer.global_step``), ``parameter``
    (first parameter in module order with a non-finite gradient on any rank, or None),
    ``grad_ranks`` / ``loss_ranks`` (ranks whose gradients / local loss were non-finite).
    """

    def __init__(
        self, message: str, *, step: int, parameter: Optional[str], grad_ranks: list[int], loss_ranks: list[int]
    ) -> None:
        super().__init__(message)
        self.step, self.parameter = step, parameter
        self.grad_ranks, self.loss_ranks = grad_ranks, loss_ranks


def _world(group: Optional[dist.ProcessGroup]) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _collective_device(group: Optional[dist.ProcessGroup], device: torch.device) -> torch.device:
    """Where a flag must live for a collective on ``group``'s backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" in backend:  # "cpu:gloo,cuda:nccl": either works
        return device
    if "nccl" in backend:
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend:
        return torch.device("cpu")
    return device


def grad_norms(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per-tensor 2-norms (fp32, on ``device``) in the order given, few fused kernels.

    ``_foreach_norm`` needs one device and dtype per call, so tensors are grouped. Sharded
    (FSDP2 ``DTensor``) gradients count by their local shard: the flags are all-reduced.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float32, device=device)
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    dense = [g.coalesce().values() if g.is_sparse else g for g in local]
    for i, g in enumerate(dense):
        groups.setdefault((g.device, g.dtype), []).append(i)
    norms: list[Optional[torch.Tensor]] = [None] * len(dense)
    for idx in groups.values():
        for i, n in zip(idx, torch._foreach_norm([dense[i] for i in idx])):
            norms[i] = n
    return torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])


class NonFiniteGuard(Callback):
    """Detect a non-finite loss or gradient on any rank; skip the step or stop, everywhere.

    Args:
        policy: ``"skip"`` (withhold this optimizer step, count it, continue) or ``"stop"``
            (raise ``NonFiniteError`` naming the step, the first offending parameter in
            module order and the ranks that saw it).
        max_skips: with ``"skip"``, raise after this many *consecutive* skipped steps
            (None: never). A run that keeps producing NaNs is broken, not unlucky.
        group: process group of the decision; None = the whole world (what keeps every
            rank in step; a subgroup is only right if it contains every rank that shares
            the optimizer step).
    """

    def __init__(
        self, policy: Policy = "stop", max_skips: Optional[int] = None, group: Optional[dist.ProcessGroup] = None
    ) -> None:
        check_choice("policy", policy, POLICIES)
        if max_skips is not None and (isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 1):
            raise ArgumentValueError("max_skips", f"must be None or an int >= 1, got {max_skips!r}")
        if max_skips is not None and policy != "skip":
            raise ArgumentValueError("max_skips", "only applies to policy='skip'")
        self.policy, self.max_skips, self.group = policy, max_skips, group
        self.skips = 0  # total skipped optimizer steps
        self.consecutive = 0  # skipped steps since the last good one
        self._loss_bad: Optional[torch.Tensor] = None  # device bool: OR over micro-batches

    # -- Lightning hooks -------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None:
            warnings.warn(
                "NonFiniteGuard with fp16 loss scaling: the GradScaler's routine overflow "
                "steps will be counted as non-finite steps; use bf16-mixed precision"
            )

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self.observe_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.check(trainer.global_step, pl_module.named_parameters(), optimizer)
        log = getattr(pl_module, "log", None)
        if callable(log):
            # Identical on every rank (decided collectively): no sync_dist needed.
            log("nonfinite_skips", float(self.skips), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"skips": self.skips, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skips = int(state_dict.get("skips", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))

    # -- the check (usable without Lightning) -----------------------------------------------

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Remember whether this micro-batch's loss is finite (device-side, no sync)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad.to(self._loss_bad.device)

    def check(self, step: int, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], optimizer: Any) -> bool:
        """Decide collectively; returns True when the step was skipped (grads set to None).

        Must be called on every rank of ``group`` at the same point (it is a collective).
        Raises ``NonFiniteError`` under ``"stop"`` or after ``max_skips`` consecutive skips.
        """
        params = _optimizer_params_in_module_order(named_parameters, optimizer)
        with_grad = [i for i, (_, p) in enumerate(params) if p.grad is not None]
        loss_bad, self._loss_bad = self._loss_bad, None
        device = (
            _local(params[with_grad[0]][1].grad).device
            if with_grad
            else loss_bad.device
            if loss_bad is not None
            else torch.device("cpu")
        )
        norms = grad_norms([params[i][1].grad for i in with_grad], device)
        grad_bad = ~torch.isfinite(norms).all()
        loss_bad = torch.zeros((), dtype=torch.bool, device=device) if loss_bad is None else loss_bad.to(device)
        local = torch.stack([loss_bad, grad_bad]).to(torch.int32)
        world = _world(self.group)
        flags = local
        if world > 1:
            # copy: ``local`` must keep this rank's own flags for the diagnosis.
            flags = local.to(_collective_device(self.group, device), copy=True)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        any_loss, any_grad = flags.tolist()  # the one host sync per optimizer step (see module doc)
        if not (any_loss or any_grad):
            self.consecutive = 0
            return False

        err = self._diagnose(step, params, with_grad, norms, bool(local[0]), world)
        if self.policy == "stop":
            raise err
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self.skips += 1
        self.consecutive += 1
        if self.max_skips is not None and self.consecutive >= self.max_skips:
            raise NonFiniteError(
                f"{self.consecutive} consecutive optimizer steps skipped for non-finite values "
                f"(max_skips={self.max_skips}); last one: {err}",
                step=err.step,
                parameter=err.parameter,
                grad_ranks=err.grad_ranks,
                loss_ranks=err.loss_ranks,
            )
        if _rank(self.group) == 0:
            warnings.warn(f"skipping optimizer step ({self.skips} skipped so far): {err}")
        return True

    def _diagnose(
        self,
        step: int,
        params: list[tuple[str, torch.Tensor]],
        with_grad: list[int],
        norms: torch.Tensor,
        loss_bad: bool,
        world: int,
    ) -> NonFiniteError:
        """Failure path: gather (loss flag, first bad parameter index) from every rank."""
        bad_local = (~torch.isfinite(norms)).nonzero().flatten().tolist()
        first = with_grad[bad_local[0]] if bad_local else -1  # index into params: same on all ranks
        info = torch.tensor([int(loss_bad), first], dtype=torch.int64)
        if world > 1:
            info = info.to(_collective_device(self.group, norms.device))
            parts = [torch.empty_like(info) for _ in range(world)]
            dist.all_gather(parts, info, group=self.group)
            rows = [t.tolist() for t in parts]
        else:
            rows = [info.tolist()]
        loss_ranks = [r for r, (lb, _) in enumerate(rows) if lb]
        grad_ranks = [r for r, (_, i) in enumerate(rows) if i >= 0]
        parameter = None
        what = []
        if grad_ranks:
            idx = min(rows[r][1] for r in grad_ranks)
            parameter = params[idx][0]
            seen = [r for r in grad_ranks if rows[r][1] == idx]
            what.append(
                f"first parameter (module order) with a non-finite gradient: '{parameter}' "
                f"(on rank(s) {seen}; ranks with any non-finite gradient: {grad_ranks})"
            )
        if loss_ranks:
            what.append(f"non-finite loss on rank(s) {loss_ranks}")
        msg = f"non-finite values at optimizer step {step} (world size {world}): " + "; ".join(what)
        if world > 1 and len(grad_ranks) == world:  # sharded (FSDP) gradients name the rank they came from
            msg += (
                " (under DDP gradients are averaged before this check, so a NaN produced on "
                "one rank shows on every rank; the loss flags are per rank)"
            )
        return NonFiniteError(msg, step=step, parameter=parameter, grad_ranks=grad_ranks, loss_ranks=loss_ranks)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if _world(group) > 1 else 0


def _optimizer_params_in_module_order(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], optimizer: Any
) -> list[tuple[str, torch.Tensor]]:
    """(name, param) of every parameter the optimizer steps, in the module's order.

    Parameters the optimizer holds but the module does not name come last, named by their
    position in ``param_groups``. Identical on every rank for identical models.
    """
    owned = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            owned.setdefault(id(p), (f"param_groups[{gi}][{pi}]", p))
    out = []
    for name, p in named_parameters:
        if id(p) in owned:
            out.append((name, owned.pop(id(p))[1]))
    out.extend(owned.values())
    return out
