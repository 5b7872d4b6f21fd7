"""CausalLMModule: the LightningModule for (long-context) causal-LM training.

It wraps ``longctx.models.GPT`` (architecture only) and a ``longctx.ParallelPlan`` (how it
runs, as asked for). ``setup`` resolves the run plan once (``longctx.run_plan.RunPlan``, through
``planning.plan_run``; train.py resolves it before the build, ``check_fit``, and hands it over,
``use_run_plan``) and hands it to the strategy (``use_run_plan``: the data-parallel mode);
``configure_model`` applies its ``model`` part with ``longctx.parallelize`` under the layout the
strategy describes (``ContextParallelStrategy.parallel_dims``: CP context, FSDP2 or DDP);
the strategy shards every batch. What this module adds:

* the loss: ``GPT.loss`` gives (summed token loss, token count) of this rank's shard;
  ``longctx.loss.TokenWeightedAccumulator`` turns it into the exact gradient of the token
  mean over the whole global batch (dp x cp ranks x accumulated micro-batches);
* AdamW (weight decay on matrices only) with linear warmup + cosine decay, per step; the
  gradients freed right after each optimizer step (not through the next forward);
* logging: ``train_loss`` (the true global mean, identical on every rank), the step's other
  figures (``step_metrics.StepMetrics``: ``train_ppl``, ``lr``, ``tokens_per_s``, ``mfu``,
  ``step_s``, ``outside_s``, the fullest rank's peak memory); ``val_loss`` / ``val_ppl``
  token-weighted over all ranks (torchmetrics); the start-up's stages, printed as the first
  batch starts and logged as ``startup_s`` (``startup.StartupClock``).

Beside it: ``planning`` (the run plan from the Trainer's world, before the model is built) and
``batches.DocumentBatches`` (document positions, balance and plan of each batch).

Non-finite losses/gradients are not handled here: ``longctx.lightning.health.NonFiniteGuard`` (a
callback, which train.py adds) decides skip/stop on all ranks at once. It runs before this
module's ``on_before_optimizer_step``; a skipped step has no gradients, which the
accumulation rescale below leaves alone.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union, get_args

import lightning as L
import torch
from torchmetrics import MeanMetric

from longctx.data.prepare import BatchPreparation
from longctx.loss import TokenWeightedAccumulator
from longctx.models.checkpoint_import import (
    SIZE_FIELDS,
    check_checkpoint_spec,
    check_run_checkpoint_sizes,
    load_pretrained,
)
from longctx.models.config import GPTConfig
from longctx.models.gpt import GPT, draw_init_seed
from longctx.parallel import ParallelDims, ParallelPlan, parallelize
from longctx.validation import ArgumentValueError, check_choice, check_number

from .batches import DocumentBatches
from .planning import check_batch_memory, cp_size, memory_totals, model_config, plan_run
from .startup import StartupClock
from .step_metrics import StepMetrics
from .strategy import ContextParallelStrategy

Attention = Literal["document", "causal"]
RopePositions = Literal["document", "global"]
ATTENTION, ROPE_POSITIONS = get_args(Attention), get_args(RopePositions)


def lr_lambda(warmup_steps: int, decay_steps: int, min_lr_ratio: float):
    """Multiplier of the peak lr: linear warmup to 1, then cosine to ``min_lr_ratio``."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step >= decay_steps:
            return min_lr_ratio
        progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
        return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))

    return f


_deferring = False


@contextlib.contextmanager
def deferred_parameters():
    """``CausalLMModule``s made inside hold a fresh GPT's structure only (meta tensors): its
    parameters are drawn in ``configure_model``, the same values a build here would draw.
    train.py builds its module this way: the first process builds before the Trainer
    launches the others, which then build their own, so each rank's copy is made once the
    processes exist, all at the same time. Pretrained weights (``init_from``, ``hf_model``)
    load as usual."""
    global _deferring
    before, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = before


class CausalLMModule(L.LightningModule):
    """Causal-LM training of a ``GPT``.

    Args:
        model: a ``GPTConfig``, a mapping for ``GPTConfig.from_dict`` (``preset`` plus
            overrides), or None with ``init_from``.
        parallel: the runtime plan as asked for (``longctx.ParallelPlan`` or a mapping of its
            fields; what it leaves at None is the device's default: on a GPU activation
            checkpointing "auto" and pointwise fusion, on a CPU neither); its "auto"s are
            resolved once in ``setup``, before ``configure_model``
            (``longctx.run_plan.resolve_run``: kernels, memory settings, with the strategy's
            data-parallel mode and the document balance): ``run_plan``, printed at the start
            of a fit; ``plan`` (``run_plan.model``) / ``hparams["parallel"]`` its model part, which train.py's
            config.yaml records (with the resolved ``load_balance`` and ``rope_positions``) so
            that the run reproduces.
        attention: ``"document"`` (default): a token attends only to earlier tokens of its own
            document, from the batch's ``document_ids`` (a batch without them is one
            document); ``"causal"``: to every earlier token of the packed sequence.
        rope_positions: ``"document"`` (RoPE positions restart at every document; the
            default with document masking) or ``"global"`` (positions in the packed
            sequence; the default with causal attention).
        load_balance: reorder each batch's tokens so that the context-parallel ranks get
            equal document-masked attention work and documents stay whole on one rank where
            that keeps the balance (``longctx.balance_documents``: exact, same loss and
            gradients). None (default): where it applies (document attention, CP > 1, the
            ring, zigzag layout, full batches with ``document_ids``); True: every such
            batch, also under Ulysses, and raise where it cannot (contiguous layout, batches
            sharded by the user); False: never. The model then sees each batch in balanced
            order (positions, labels and ids travel with their tokens). With document
            attention every full batch also gets its ``longctx.documents.DocumentPlan``
            here, once per step, which every layer reuses; the first one is reported.
        init_from: a Hugging Face directory, a ``.gguf`` file, or a train.py run folder or
            ``.ckpt`` (its tokenizer too) to start from (``load_pretrained``); ``model`` then
            holds overrides (e.g. ``rope_theta``, ``rope_scaling``), not sizes.
        hf_model: a local Hugging Face causal-LM directory (Llama, Qwen2, Mistral, ...) to
            train instead of a ``GPT``, through ``longctx.hf``'s ring attention; a directory
            with only ``config.json`` gives a random init of that shape.
        lr: peak learning rate (AdamW).
        min_lr_ratio: the schedule's floor as a share of ``lr`` (``min_lr = lr * min_lr_ratio``).
        weight_decay: AdamW weight decay, on matrices only (not norms or biases).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup length in optimizer steps.
        decay_steps: where the cosine reaches its floor; None = the Trainer's max_steps.
        seq_len: the full (unsharded) training sequence length, for FLOPs/MFU; None = read
            from the first batch.
        memory_check: in ``setup`` (before the model is built; from the data module's
            ``seq_len``/``batch_size``), predict this rank's peak memory
            (``longctx.memory.estimate``) and print it (one line, rank 0). Where it would not
            fit the GPU and the plan leaves the MLP untiled and nothing offloaded, the MLP is
            tiled and the saved inputs of the fewest blocks predicted to fit go to host memory
            (``longctx.memory_fit.fitting_plan``; printed); what still cannot fit raises a
            one-line ``ValueError`` naming what to change. On CPU only the prediction is
            printed. The plan taken is ``hparams["parallel"]`` (train.py's config.yaml too).
            Data whose shapes are unknown before the fit is only checked, on the first batch
            (the model is built by then). False: none of this.
    """

    def __init__(
        self,
        model: Union[GPTConfig, Mapping[str, Any], None] = None,
        *,
        parallel: Union[ParallelPlan, Mapping[str, Any], None] = None,
        attention: Attention = "document",
        rope_positions: Optional[RopePositions] = None,
        load_balance: Optional[bool] = None,
        init_from: Optional[str] = None,
        hf_model: Optional[str] = None,
        lr: float = 3e-4,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        decay_steps: Optional[int] = None,
        seq_len: Optional[int] = None,
        memory_check: bool = True,
    ) -> None:
        super().__init__()
        self._init_seed: Optional[int] = None  # built deferred (deferred_parameters): made in configure_model
        # The plan as asked for, validated once (ParallelPlan); resolved in setup (run_plan).
        self.requested_plan = _check_arguments(
            dict(
                model=model,
                parallel=parallel,
                attention=attention,
                rope_positions=rope_positions,
                load_balance=load_balance,
                init_from=init_from,
                hf_model=hf_model,
                lr=lr,
                min_lr_ratio=min_lr_ratio,
                weight_decay=weight_decay,
                betas=betas,
                eps=eps,
                warmup_steps=warmup_steps,
                decay_steps=decay_steps,
                seq_len=seq_len,
            )
        )
        self.attention = attention
        self.rope_positions = rope_positions  # as asked for: the run plan resolves it
        self.load_balance = load_balance
        if isinstance(model, GPTConfig):
            model = model.to_dict()
        model = dict(model or {})
        if hf_model is not None:
            from longctx.models.hf_lm import HFCausalLM

            self.model = HFCausalLM.from_pretrained(hf_model, cp_attention=self.requested_plan.cp_attention)
        elif init_from is not None:
            self.model = load_pretrained(init_from, **model)
        elif _deferring:
            # Parameters drawn in configure_model, from the seed a build now would draw.
            self._init_seed = draw_init_seed()
            with torch.device("meta"):
                self.model = GPT(GPTConfig.from_dict(model))
        else:
            self.model = GPT(GPTConfig.from_dict(model))
        self.startup = StartupClock()
        if self._init_seed is None:
            self.startup.mark("model built")
        # Saved with the checkpoint: the resolved config, so the checkpoint alone rebuilds
        # the model (load_from_checkpoint needs no gguf/HF files; an HF model needs its directory).
        self.save_hyperparameters(ignore=["model", "init_from", "parallel"])
        self.hparams["model"] = self.model.config.to_dict()
        self.hparams["parallel"] = self.requested_plan.to_dict()  # the resolved plan's, from setup on
        self.config = self.model.config
        self.seq_len = seq_len
        self.memory_check = memory_check
        self.run_plan = None  # longctx.run_plan.RunPlan: resolved in setup, before configure_model
        self._planned = None  # a plan resolved before the build (use_run_plan): setup takes it
        self._hook_plan = None  # on_after_batch_transfer's without setup: resolved once, kept
        self._float8_scales = None  # whether optimizer steps refresh float8 weight scales: per fit
        self._check_first_batch = False
        self.document_batches = DocumentBatches(
            attention=attention,
            load_balance=load_balance,
            heads=self.config.n_head,
            kv_heads=self.config.n_kv_head,
            head_dim=self.config.head_dim,
        )
        self.acc = TokenWeightedAccumulator()
        # nan_strategy="disable": a NaN validation loss must show, not be dropped with a warning.
        self.val_loss = MeanMetric(nan_strategy="disable")
        self.step_metrics = StepMetrics()

    @classmethod
    def check_arguments(cls, *, device: Optional[Any] = None, **kwargs: Any) -> None:
        """Raise what the constructor would for these arguments, building no model (train.py
        checks a run's options with it before any data work); with ``device``, also what the
        first fit on it would (the plan's kernels, ``ParallelPlan.check_device``)."""
        bound = inspect.signature(cls.__init__).bind(None, **kwargs)
        bound.apply_defaults()
        plan = _check_arguments({k: v for k, v in bound.arguments.items() if k != "self"})
        if device is not None:
            plan.check_device(device)

    @property
    def plan(self) -> Optional[ParallelPlan]:
        """The ``ParallelPlan`` the model runs with: the run plan's (``run_plan.model``), from
        ``setup`` on; None before."""
        return None if self.run_plan is None else self.run_plan.model

    def configure_model(self) -> None:
        # Lightning calls this once the processes exist and before the strategy wraps or
        # moves anything: the place to apply the parallel layout (torchtitan's pattern).
        if getattr(self.model, "_longctx_parallelized", False):
            return
        if self._init_seed is not None:  # every rank makes its parameters now, at once
            self.model.to_empty(device="cpu")
            self.model.reset_parameters(seed=self._init_seed)
            self._init_seed = None
            self.startup.mark("model built")
        if self.run_plan is None:  # called without setup: the plan resolved here, the same way
            self.setup("configure")
        dims = getattr(self._trainer.strategy, "parallel_dims", None) if self._trainer is not None else None
        parallelize(self.model, dims or ParallelDims(), self.run_plan.model)
        self.startup.mark("parallelized")

    # -- training -----------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(input_ids, position_ids)

    def batch_preparation(self) -> Optional[BatchPreparation]:
        """What the data pipeline does to each full batch for this rank, or None where nothing
        is to be done there (``DocumentBatches.preparation``); the strategy installs it in the
        DataLoaders' collate."""
        return self.document_batches.preparation(self._trainer, self.run_plan)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        run = self.run_plan
        if run is None:  # no setup (the hook called outside a fit, a model parallelized beforehand)
            if self._hook_plan is None:  # resolved the same way, once: not on every batch
                self._hook_plan = self._resolve_run(memory_check=False)
            run = self._hook_plan
        return self.document_batches.after_transfer(batch, self._trainer, run)

    def use_run_plan(self, run: Any) -> None:
        """Take the run plan of the fit that follows, resolved before this module was built for
        the same trainer, data and model shape (train.py: the one ``check_fit`` returned):
        ``setup`` then sets the run up with it instead of resolving it again."""
        if self.run_plan is not None:
            raise RuntimeError("the module was set up with its run plan already: hand one over before the fit")
        self._planned = run

    def setup(self, stage: str) -> None:
        # Before configure_model: every "auto" of the run resolved once (longctx.run_plan), on the
        # run's shapes (the data module's), so the model is parallelized with it and config.yaml
        # and the checkpoint record it. A plan handed over (use_run_plan) is not resolved again.
        self._hook_plan = None  # resolved for another trainer, if at all
        self._float8_scales = None
        if stage == "fit":
            self.startup.mark("launch and data")
        if self.run_plan is not None or getattr(self.model, "_longctx_parallelized", False):
            return
        fit = stage == "fit"
        planned = self._planned
        self.run_plan = planned if planned is not None else self._resolve_run(memory_check=fit and self.memory_check)
        self.hparams["parallel"] = self.run_plan.model.to_dict()  # the checkpoint's record
        strategy = getattr(self._trainer, "strategy", None)
        if isinstance(strategy, ContextParallelStrategy):  # handed over once: its data-parallel mode
            strategy.use_run_plan(self.run_plan)
        self._check_first_batch = fit and self.memory_check and self.run_plan.estimate is None
        if fit and self._trainer is not None and self.trainer.global_rank == 0:
            for line in (*self.run_plan.notes, self.run_plan.line()):  # the plan configure_model applies
                print(line, flush=True)
            if self.run_plan.estimate is not None:
                print(self.run_plan.estimate.summary(), flush=True)

    def _resolve_run(self, *, memory_check: bool):
        trainer = self._trainer
        datamodule = getattr(trainer, "datamodule", None)
        device = getattr(getattr(trainer, "strategy", None), "root_device", None) or torch.device("cpu")
        return plan_run(
            self.config,
            trainer,
            requested=self.requested_plan,
            seq_len=self.seq_len or getattr(datamodule, "seq_len", None),
            batch_size=getattr(datamodule, "batch_size", None),
            attention=self.attention,
            load_balance=self.load_balance,
            rope_positions=self.rope_positions,
            n_params=sum(p.numel() for p in self.parameters()),
            memory_check=memory_check,
            hf_modules=self.hparams.get("hf_model") is not None,
            **memory_totals(device),
        )

    @classmethod
    def check_fit(cls, trainer: "L.Trainer", datamodule: Any, *, host_total: Optional[int], **kwargs: Any) -> Any:
        """Raise what a fit of this module on ``trainer`` (built, its processes not started) would
        raise in ``setup`` for ``datamodule``'s ``seq_len`` x ``batch_size``: the memory model's refusal
        (``longctx.memory_fit.PredictedOutOfMemory``, one line), from the arguments alone, before
        any data work or model build (train.py calls it; the model's shape read from its config,
        checkpoint header or Hugging Face ``config.json``). ``host_total``: the host memory the
        run's ranks on this machine share now, which the run is checked against (None: the
        machine's, as ``setup`` checks it). Returns the plan such a fit resolves in ``setup`` (the
        plan is made for the machine's memory, as there: the same in every process), which
        ``use_run_plan`` hands to the module built then (train.py); None without a memory check, or
        where the shape cannot be read before the build (``setup`` resolves it then)."""
        bound = inspect.signature(cls.__init__).bind(None, **kwargs)
        bound.apply_defaults()
        args = bound.arguments
        config = model_config(args["model"], args["init_from"], args["hf_model"])
        if not args["memory_check"] or config is None:
            return None
        device = trainer.strategy.root_device
        return plan_run(
            config,
            trainer,
            requested=ParallelPlan.from_dict(args["parallel"]),
            seq_len=args["seq_len"] or datamodule.seq_len,
            batch_size=datamodule.batch_size,
            attention=args["attention"],
            load_balance=args["load_balance"],
            rope_positions=args["rope_positions"],
            n_params=config.num_params(),  # the built model's count (setup's), a GPT's or a Llama's
            memory_check=True,
            hf_modules=args["hf_model"] is not None,
            host_check=host_total,
            **memory_totals(device),
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.step_metrics.first_step and self.step_metrics.step_start is None:
            self.startup.mark("first batch")
            self.print(self.startup.line())
        self.step_metrics.micro_batch_started()
        # Data whose sequence length was unknown before the fit: the memory is checked (not
        # planned: the model is built) on the first batch.
        if self._check_first_batch and isinstance(batch, Mapping) and "input_ids" in batch:
            self._check_first_batch = False
            check_batch_memory(
                self.config,
                self.run_plan,
                self.trainer,
                batch,
                documents=self.attention == "document",
                hf_modules=self.hparams.get("hf_model") is not None,
            )

    def _loss(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        docs = None
        if self.attention == "document":
            docs = batch.get("document_plan", batch.get("document_ids"))
        return self.model(batch["input_ids"], batch.get("position_ids"), labels=batch["labels"], document_ids=docs)

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, n_tokens = self._loss(batch)
        out = self.acc.add(loss_sum, n_tokens, accumulate=self.trainer.accumulate_grad_batches)
        self.step_metrics.count(
            batch["input_ids"], batch.get("document_plan"), world_size=self.trainer.world_size, cp=cp_size(self.trainer)
        )
        if self.seq_len is None:
            self.seq_len = batch["input_ids"].shape[1] * cp_size(self.trainer)
        return out.loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # After all micro-batches' backwards (and DDP's all-reduce), before clipping.
        mean, _ = self.acc.finish(self.parameters())
        first_step = self.step_metrics.first_step
        metrics = self.step_metrics.finish(
            mean,
            lr=optimizer.param_groups[0]["lr"],
            device=self.device,
            config=self.config,
            seq_len=self.seq_len,
            world_size=self.trainer.world_size,
        )
        if first_step:
            self._report_kernel_compile()
            metrics["startup_s"] = torch.tensor(self.startup.total())
        # Values are global (identical on all ranks; the peaks were all-reduced): no sync_dist.
        self.log("train_loss", mean, prog_bar=True, on_step=True, on_epoch=False)
        self.log_dict({k: v.float() for k, v in metrics.items()}, on_step=True, on_epoch=False)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # FSDP2's float8 all-gather: next step's weight scales in one all-reduce. Decided at the
        # first step: the plan's float8, or (a model parallelized before the fit, no plan) its
        # own float8 layers, if any.
        if self._float8_scales is None:
            from longctx.float8 import float8_modules

            asked = self.run_plan is None or self.run_plan.parallel.float8
            self._float8_scales = asked and bool(float8_modules(self.model))
        if self._float8_scales:
            from longctx.float8 import after_optimizer_step

            after_optimizer_step(self.model)
        # Lightning sets gradients to None only inside the next step's closure, after its
        # forward: the gradients (4 bytes a parameter, over the FSDP2 shards: 15 GiB a rank for
        # an 8B model on 2) would sit through that forward, its peak. Freed here instead, as
        # longctx.memory counts the step.
        optimizer.zero_grad(set_to_none=True)

    def on_fit_start(self) -> None:
        self.startup.mark("optimizer and strategy")
        self._warm_up_kernels()
        self.startup.mark("kernel warm-up")

    def _warm_up_kernels(self) -> None:
        """FlashAttention-4 compiles a kernel variant on its first call: every variant a step
        calls is called once here, before step 1, so that no compile lands mid-run."""
        plan = self.run_plan.parallel if self.run_plan is not None else None
        if plan is None or self.device.type != "cuda":
            return
        documents = self.attention == "document"
        if "fa4" not in (plan.attention_backend, plan.document_backend if documents else None):
            return
        from longctx.kernels import fa4
        from longctx.run_plan import compute_dtype

        dtype = compute_dtype(self.trainer.precision)
        if dtype not in (torch.bfloat16, torch.float16):  # FA4 runs neither fp32 nor fp64
            return

        cfg = self.config
        shape = (self.device, dtype, cfg.head_dim, cfg.n_head, cfg.n_kv_head)
        start, n = time.perf_counter(), 0
        local = self.trainer.num_devices  # this host's processes share FA4's disk cache
        if local > 1 and fa4.cache_dir() is not None:
            # Each compiles its share into the cache; the full warm-up below then loads the rest.
            part = (self.trainer.local_rank, local)
            n = fa4.warm_up(*shape, documents=documents, full_blocks=plan.cp > 1, part=part)
            self.trainer.strategy.barrier("fa4_warm_up")
        n += fa4.warm_up(*shape, documents=documents, full_blocks=plan.cp > 1)
        self.print(
            f"FlashAttention-4: {n} kernel variants compiled or loaded before step 1 "
            f"in {time.perf_counter() - start:.1f} s"
        )

    def _report_kernel_compile(self) -> None:
        """After the first step: what FlashAttention-4's first-call compiles (or loads from its
        on-disk cache) during step 1 cost, since they make it slower than the rest (those of
        the warm-up were reported before it)."""
        from longctx.kernels import fa4

        first_calls = fa4.first_calls_since_warm_up()
        if first_calls:
            self.print(
                f"FlashAttention-4: {len(first_calls)} kernel variants compiled or loaded in step 1 "
                f"in {sum(first_calls.values()):.1f} s (cache: {fa4.cache_dir()})"
            )

    # -- validation -------------------------------------------------------------------------

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        loss_sum, n_tokens = self._loss(batch)
        n = n_tokens.float()
        # Token-weighted mean of the shard; torchmetrics all-gathers (value, weight) over the
        # whole world at compute(), so the result is the global token mean.
        self.val_loss.update(loss_sum.detach() / n.clamp(min=1.0), weight=n)

    def on_validation_epoch_start(self) -> None:
        self.step_metrics.validation_started()

    def on_validation_epoch_end(self) -> None:
        self.step_metrics.validation_ended()
        if self.val_loss.update_count == 0:
            return
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val_loss", loss, prog_bar=True, sync_dist=False)
        self.log("val_ppl", torch.exp(loss.clamp(max=50.0)), sync_dist=False)

    # -- optimizer --------------------------------------------------------------------------

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # Not fused: Lightning's mixed-precision plugin refuses gradient clipping with
        # optimizers that unscale internally (fused AdamW), seen on H200 with bf16-mixed.
        extra = {"foreach": True} if self.device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, **extra)
        decay_steps = hp.decay_steps
        if decay_steps is None:
            max_steps = self.trainer.max_steps if self._trainer is not None else -1
            decay_steps = max_steps if max_steps and max_steps > 0 else 10**9
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(hp.warmup_steps, decay_steps, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoints ------------------------------------------------------------------------

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of another shape would fail deep inside load_state_dict with a list of
        # tensor sizes; name the differing config fields instead.
        saved = (checkpoint.get("hyper_parameters") or {}).get("model")
        if not saved:
            return
        mine = self.config.to_dict()
        diff = {k: (saved.get(k), mine.get(k)) for k in SIZE_FIELDS if saved.get(k) != mine.get(k)}
        if diff:
            detail = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diff.items())
            raise ValueError(f"checkpoint was saved from a different model shape ({detail})")


def _check_arguments(args: Mapping[str, Any]) -> ParallelPlan:
    """Every value of CausalLMModule's arguments, refused before anything is built; returns
    the ``parallel`` argument as the ``ParallelPlan`` it asks for."""
    check_choice("attention", args["attention"], ATTENTION)
    if args["rope_positions"] is not None:
        check_choice("rope_positions", args["rope_positions"], ROPE_POSITIONS)
    if args["load_balance"] and args["attention"] != "document":
        raise ValueError(
            "load_balance=True needs attention='document': across documents the "
            "token order decides what each token attends to"
        )
    check_number("lr", args["lr"], low=0, low_open=True)
    check_number("min_lr_ratio", args["min_lr_ratio"], low=0, high=1)
    check_number("weight_decay", args["weight_decay"], low=0)
    check_number("eps", args["eps"], low=0, low_open=True)
    betas = args["betas"]
    if not (
        isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    ):
        raise ArgumentValueError("betas", f"must be two numbers in [0, 1), got {betas!r}")
    check_number("warmup_steps", args["warmup_steps"], low=0, integer=True)
    check_number(
        "decay_steps", args["decay_steps"], low=1, integer=True, optional=True, hint=" (null: the Trainer's max_steps)"
    )
    check_number("seq_len", args["seq_len"], low=1, integer=True, optional=True)
    try:
        requested = ParallelPlan.from_dict(args["parallel"])
    except ArgumentValueError as e:  # named as the option it came from: parallel.cp_attention
        raise e.within("parallel") from None
    except ValueError as e:
        raise ValueError(f"parallel: {e}") from None
    model, init_from, hf_model = args["model"], args["init_from"], args["hf_model"]
    if hf_model is not None:
        if model or init_from is not None:
            raise ArgumentValueError(
                "hf_model", "takes the model from its directory: give no `model` sizes or init_from"
            )
        if not (Path(hf_model) / "config.json").is_file():
            raise ArgumentValueError(
                "hf_model", f"{hf_model}: no config.json there (a local Hugging Face model directory)"
            )
    elif init_from is not None:
        check_checkpoint_spec("init_from", init_from)
        check_run_checkpoint_sizes(init_from, model)  # a train.py checkpoint's sizes, before any data work
    config = model if isinstance(model, GPTConfig) else None
    if hf_model is None and init_from is None and config is None:
        config = GPTConfig.from_dict(dict(model or {}))  # unknown keys and bad sizes
    blocks = requested.checkpointed_blocks
    if blocks is not None and hf_model is not None:
        raise ArgumentValueError(
            "parallel.checkpointed_blocks", "is not available for Hugging Face models (checkpointed all or none)"
        )
    if blocks is not None and config is not None and blocks > config.n_layer:
        raise ArgumentValueError(
            "parallel.checkpointed_blocks", f"must be at most the model's {config.n_layer} blocks, got {blocks}"
        )
    return requested
