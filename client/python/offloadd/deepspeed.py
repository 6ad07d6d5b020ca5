"""DeepSpeed configs for offloadd.torch.wrap.

    model, optimizer = offloadd.torch.wrap(model, deepspeed_config="ds_config.json")

translate() maps each field of a DeepSpeed config (ZeRO stage 3, offload,
optimizer, fp16/bf16, clipping, accumulation) to wrap()'s adamw_config and
zero_config. The fields offloadd does not support are named in one
InvalidArgumentError. A field that has no meaning under offloadd's design
(buffer counts and sizes: one pool per node is sized by the daemon) is
accepted with a note saying why; from_config() logs one line naming those
fields (WARNING; INFO where the config was taken whole), and each note at
DEBUG, on the "offloadd.deepspeed" logger.

With fp16 or bf16 enabled, wrap() converts the model to that dtype first,
as DeepSpeed's engine does (module.half(), module.bfloat16()): it computes
in it, and its fp32 master weights start from the converted values.
"""
import json
import math
import logging
import os

import offloadd

log = logging.getLogger("offloadd.deepspeed")

_BUFFERS = ("offloadd keeps one host pool per node, sized by the daemon's "
            "memory.host_budget_bytes, and moves data in chunks of its own; there are no "
            "per-rank buffers to size")
_PINNED = ("the daemon's pool is shared memory mapped by the trainers; it is locked "
           "(mlock) if the daemon runs with memory.lock_pool=true")
_NVME_PATH = ("the NVMe tier is the daemon's (its --nvme.dirs, shared by every rank on the "
              "node); a trainer does not choose it")
_COMM = ("offloadd.torch gathers a module's parameters together (in one all-gather with "
         "the GPU tier) and averages gradients in buckets of zero_config "
         "reduce_bucket_elements (DeepSpeed's reduce_bucket_size)")
_BATCHES = "the trainer's loop chooses its batches"
_IGNORED_TOP = {
    "steps_per_print": "progress is the trainer's to print (offloadctl stats shows the daemon's)",
    "wall_clock_breakdown": "Optimizer.engine.timings holds fetch, return and step times",
    "tensorboard": "monitoring is the trainer's; the daemon exports Prometheus metrics",
    "wandb": "monitoring is the trainer's; the daemon exports Prometheus metrics",
    "csv_monitor": "monitoring is the trainer's; the daemon exports Prometheus metrics",
    "flops_profiler": "not part of offloadd",
    "comms_logger": "not part of offloadd",
    "zero_allow_untested_optimizer": "offloadd runs its own Adam/AdamW",
    "zero_force_ds_cpu_optimizer": "offloadd runs its own Adam/AdamW (AVX-512/AVX2) in the daemon",
    "aio": ("offloadd's NVMe I/O is io_uring in the daemon (nvme.queue_depth, nvme.rings, "
            "nvme.request_bytes); libaio settings do not apply"),
    "dump_state": "not part of offloadd",
    "memory_breakdown": "the daemon's memory is in offloadctl stats and its metrics",
}
_IGNORED_ZERO = {
    "overlap_comm": _COMM,
    "contiguous_gradients": "the daemon's gradient buffers are contiguous per partition",
    "allgather_bucket_size": _COMM,
    "allgather_partitions": _COMM,
    "reduce_scatter": _COMM,
    "round_robin_gradients": _COMM,
    "sub_group_size": ("the daemon steps partitions in chunks (placement.state_chunk_bytes) "
                       "on its own optimizer threads"),
    "stage3_gather_16bit_weights_on_model_save": "model.state_dict() gathers full weights",
    "stage3_gather_fp16_weights_on_model_save": "model.state_dict() gathers full weights",
    "memory_efficient_linear": "parameters' saved values are re-gathered in backward",
    "ignore_unused_parameters": "unused parameters simply return no gradient",
    "elastic_checkpoint": ("offloadd's checkpoints (optimizer.checkpoint, restore_from) "
                           "restore with any number of ranks"),
    "load_from_fp32_weights": "restore_from restores the fp32 master weights offloadd saved",
}
# DeepSpeed's stage-3 residency knobs and the GPU tier's settings they set.
_GPU_TIER = {
    "stage3_prefetch_bucket_size": "prefetch_elements",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "persistence_threshold",
}
_GPU_NOTES = {
    "stage3_prefetch_bucket_size": "how far ahead, along the order learned in the first "
                                   "iteration, parameters are copied to the GPU",
    "stage3_max_live_parameters": "the most non-persistent parameters on the GPU at once",
    "stage3_max_reuse_distance": ("parameters reused within this distance are evicted last; "
                                  "eviction is by next use (Belady) along the learned order"),
    "stage3_param_persistence_threshold": ("parameters this small stay on the GPU between "
                                           "uses, until the next step"),
}
_OFFLOAD_FIELDS = {
    "buffer_count": _BUFFERS,
    "buffer_size": _BUFFERS,
    "max_in_cpu": _BUFFERS,
    "pin_memory": _PINNED,
    "nvme_path": _NVME_PATH,
    "fast_init": "the daemon initialises state in place",
    "pipeline": "offloadd always overlaps swapping with the step",
    "pipeline_read": "offloadd always overlaps swapping with the step",
    "pipeline_write": "offloadd always overlaps swapping with the step",
}


# Fields offloadd takes at the value that means "off" (or DeepSpeed's
# default) and refuses at any other, with why.
_OFF_TOP = {
    "prescale_gradients": (False, "offloadd averages gradients across ranks after reducing "
                                  "them (DeepSpeed's default)"),
    "gradient_predivide_factor": (1.0, "offloadd averages gradients across ranks after "
                                       "reducing them"),
    "sparse_gradients": (False, "offloadd's gradients are dense"),
}
_OFF_ZERO = {
    "zero_quantized_weights": (False, "offloadd gathers parameters in their working dtype"),
    "zero_quantized_nontrainable_weights": (False, "offloadd gathers parameters in their "
                                                   "working dtype"),
    "zero_quantized_gradients": (False, "offloadd reduces gradients in fp32"),
    "zero_hpz_partition_size": (1, "offloadd gathers each parameter across all ranks"),
    "mics_shard_size": (-1, "offloadd gathers each parameter across all ranks"),
}
# Sections that are the user's business, whatever they say.
_SECTIONS_NOTED = {
    "activation_checkpointing": ("DeepSpeed's checkpointing API; torch.utils.checkpoint works "
                                 "under offloadd.torch (a module's recompute gathers its "
                                 "parameters again)"),
}
# Sections offloadd takes only when disabled.
_SECTIONS_OFF = {
    "curriculum_learning": "curriculum learning is DeepSpeed's data pipeline",
    "data_efficiency": "DeepSpeed's data pipeline",
    "autotuning": "DeepSpeed's autotuner",
    "eigenvalue": "DeepSpeed's eigenvalue computation",
    "progressive_layer_drop": "DeepSpeed's progressive layer drop",
    "quantize_training": "DeepSpeed's quantisation",
    "nebula": "DeepSpeed's Nebula checkpoints (offloadd writes its own)",
}


class Translation:
    def __init__(self):
        self.adamw = {}
        self.has_optimizer = False  # the config has an optimizer section
        self.zero = {"placement": {}}
        self.notes = []  # "field: accepted and ignored: why" or "field: applied: what"
        self.errors = []  # "'field': why", every field offloadd cannot take
        self.nvme_path = None  # what the config named (not used: the NVMe tier is the daemon's)
        self.batch_sizes = (None, None)  # train_batch_size, train_micro_batch_size_per_gpu
        self.scheduler = None  # (type, params) of the scheduler section, for initialize()
        self.drop_last = False  # dataloader_drop_last, for initialize()'s data loader
        self.auto_cast = False  # fp16.auto_cast: the engine casts its inputs to fp16
        self.autos = set()  # the fields given as "auto" (refused once, by that)

    def note(self, field, why):
        self.notes.append(f"{field}: accepted and ignored: {why}")

    def applied(self, field, what):
        self.notes.append(f"{field}: applied: {what}")

    def fail(self, field, why):
        self.errors.append(f"'{field}': {why}")


def _section(t, field, v):
    """A section's dict, or None (refused) for anything else."""
    if isinstance(v, dict):
        return v
    t.fail(field, f"{v!r}: a section, given as an object ({{...}}); leave it out for "
           "DeepSpeed's defaults")
    return None


def _as_bool(v):
    """True or False as DeepSpeed's config model reads them (JSON booleans,
    0 and 1, "true"/"false" ... as text); None for anything else."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        return v.lower() in ("true", "yes", "on", "1")
    return None


def _bool(t, field, v):
    """_as_bool, refused (None) where it is neither."""
    b = _as_bool(v)
    if b is None:
        t.fail(field, f"{v!r} is not true or false")
    return b


def _number(t, field, v, minimum=None, above=None):
    """A number (not a boolean, not text); None (refused) otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        t.fail(field, f"{v!r} is not a number")
        return None
    if (minimum is not None and v < minimum) or (above is not None and v <= above):
        bound = f"at least {minimum}" if minimum is not None else f"above {above}"
        t.fail(field, f"{v!r}: must be {bound}")
        return None
    return float(v)


def _whole(t, field, v, minimum):
    """A whole number (DeepSpeed writes 1e9 or 5e8 too) of at least
    `minimum`; None (refused) otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (
            float("inf"), float("-inf")) or v != int(v) or v < minimum:
        what = "non-negative" if minimum == 0 else f"at least {minimum}"
        t.fail(field, f"{v!r} is not a whole number {what}")
        return None
    return int(v)


def _off(t, field, v, off, why):
    """A field taken at its "off" value `off` only."""
    if isinstance(off, bool):
        b = _bool(t, field, v)
        if b is None:
            return
        same = b == off
    else:
        same = not isinstance(v, bool) and isinstance(v, (int, float)) and v == off
    if same:
        t.note(field, f"{v!r}: {why}")
    else:
        t.fail(field, f"{v!r}: offloadd takes only {off!r} here: {why}")


def _enabled_only_off(t, field, v, why):
    """A section offloadd takes only with enabled false."""
    d = _section(t, field, v)
    if d is None:
        return
    enabled = _bool(t, f"{field}.enabled", d.get("enabled", False))
    if enabled:
        t.fail(f"{field}.enabled", f"true: not supported by offloadd ({why})")
    elif enabled is not None:
        t.note(field, f"disabled: {why}")


def _device(t, section, kind, d):
    device = d.get("device", "none")
    if device in ("cpu", "none", None):
        t.zero["placement"][kind] = "host"
        if device != "cpu":
            t.note(f"{section}.device", f"{device!r} (no offload): offloadd holds this data in "
                   "its host tier")
    elif device == "nvme":
        t.zero["placement"][kind] = "nvme"
    else:
        t.fail(f"{section}.device", f"{device!r} is not cpu, nvme or none")
    for k, v in d.items():
        field = f"{section}.{k}"
        if k == "device":
            continue
        if k == "ratio":
            ratio = _number(t, field, v)
            if ratio is not None and ratio != 1:
                t.fail(field, f"{v}: offloadd steps the whole optimizer on the CPU; a share of "
                       "it on the GPU is not supported")
            continue
        if k == "nvme_path" and device == "nvme":
            t.nvme_path = v
        if k in _OFFLOAD_FIELDS:
            t.note(field, _OFFLOAD_FIELDS[k])
        else:
            t.fail(field, "not a field offloadd knows")


def _optimizer(t, d):
    kind = str(d.get("type", "adamw" if "optimizer.type" in t.autos else "")).lower()
    if kind not in ("adam", "adamw"):
        t.fail("optimizer.type", f"{d.get('type')!r}: offloadd runs Adam and AdamW")
    for k in d:
        if k not in ("type", "params"):
            t.fail(f"optimizer.{k}", "not a field offloadd knows")
    params = d.get("params")
    params = {} if params is None else _section(t, "optimizer.params", params)
    if params is None:
        return
    adamw = kind == "adamw"
    if "adam_w_mode" in params:
        adam_w_mode = _bool(t, "optimizer.params.adam_w_mode", params["adam_w_mode"])
        adamw = adamw or bool(adam_w_mode)
    elif kind == "adam":
        adamw = True  # DeepSpeed's Adam decouples weight decay unless adam_w_mode is false
    torch_adam = _bool(t, "optimizer.params.torch_adam", params.get("torch_adam", False))
    t.has_optimizer = True
    t.adamw["adamw"] = bool(adamw)
    # DeepSpeed's default, its CPU Adam's: 0. With torch_adam it builds
    # torch.optim.AdamW (default 0.01) or torch.optim.Adam (0) instead.
    t.adamw["weight_decay"] = 0.01 if torch_adam and adamw else 0.0
    for k, v in params.items():
        field = f"optimizer.params.{k}"
        if k in ("lr", "eps", "weight_decay"):
            n = _number(t, field, v, minimum=0.0)
            if n is not None:
                t.adamw[k] = n
        elif k == "betas":
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                t.fail(field, f"{v!r}: two numbers, [beta1, beta2]")
                continue
            betas = [_number(t, f"{field}[{i}]", b, minimum=0.0) for i, b in enumerate(v)]
            if None not in betas:
                if any(b >= 1 for b in betas):
                    t.fail(field, f"{v!r}: each below 1")
                else:
                    t.adamw["betas"] = tuple(betas)
        elif k == "torch_adam":
            t.note(field, "offloadd's Adam is bit-identical to torch's (its default "
                   "weight_decay, torch's, applies)")
        elif k == "adam_w_mode":
            pass  # (above)
        elif k == "amsgrad":
            if _bool(t, field, v):
                t.fail(field, "AMSGrad is not supported")
        elif k == "bias_correction":
            if _bool(t, field, v) is False:
                t.fail(field, "Adam without bias correction is not supported by offloadd.torch")
        else:
            t.fail(field, "not a field offloadd knows")


def _fp16(t, d):
    for k in d:
        if k not in ("enabled", "auto_cast", "loss_scale", "initial_scale_power",
                     "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                     "min_loss_scale", "fp16_master_weights_and_grads"):
            t.fail(f"fp16.{k}", "not a field offloadd knows")
    if not _bool(t, "fp16.enabled", d.get("enabled", False)):
        return
    t.zero["working_dtype"] = "fp16"
    if _bool(t, "fp16.consecutive_hysteresis", d.get("consecutive_hysteresis", False)):
        t.fail("fp16.consecutive_hysteresis", "not supported (hysteresis counts all overflows)")
    if _bool(t, "fp16.fp16_master_weights_and_grads",
             d.get("fp16_master_weights_and_grads", False)):
        t.fail("fp16.fp16_master_weights_and_grads", "offloadd's master weights are fp32")
    if _bool(t, "fp16.auto_cast", d.get("auto_cast", False)):
        t.auto_cast = True
        t.applied("fp16.auto_cast", "initialize()'s engine casts floating-point inputs to fp16 "
                  "in its forward, as DeepSpeed's (with wrap(), the model's inputs are the "
                  "caller's to cast)")
    static = _number(t, "fp16.loss_scale", d.get("loss_scale", 0), minimum=0.0)
    if static:
        t.zero["static_loss_scale"] = static
        return
    power = _number(t, "fp16.initial_scale_power", d.get("initial_scale_power", 16),
                    minimum=0.0)
    window = _whole(t, "fp16.loss_scale_window", d.get("loss_scale_window", 1000), 1)
    hysteresis = _whole(t, "fp16.hysteresis", d.get("hysteresis", 2), 1)
    min_scale = _number(t, "fp16.min_loss_scale", d.get("min_loss_scale", 1), above=0.0)
    if None not in (power, window, hysteresis, min_scale):
        t.zero["loss_scaling"] = {"initial_scale": 2.0 ** power, "growth_interval": window,
                                  "hysteresis": hysteresis, "min_scale": min_scale}


def _bf16(t, field, d, config):
    for f, v in d.items():
        if f == "immediate_grad_update":
            t.note(f"{field}.{f}", "offloadd accumulates gradients in fp32 in the daemon")
        elif f != "enabled":
            t.fail(f"{field}.{f}", "not a field offloadd knows")
    if _bool(t, f"{field}.enabled", d.get("enabled", False)):
        fp16 = config.get("fp16")
        if isinstance(fp16, dict) and _as_bool(fp16.get("enabled", False)):
            t.fail(f"{field}.enabled", "fp16 and bf16 are both enabled")
        t.zero["working_dtype"] = "bf16"


def _zero(t, d):
    stage = d.get("stage", 3 if "zero_optimization.stage" in t.autos else 0)
    if isinstance(stage, str):
        t.fail("zero_optimization.stage", f"{stage!r} is text: give the number 3")
    elif isinstance(stage, bool) or stage != 3:
        t.fail("zero_optimization.stage", f"{stage!r}: offloadd runs ZeRO stage 3 only (it "
               "partitions parameters too)")
    for k, v in d.items():
        field = f"zero_optimization.{k}"
        if k == "stage":
            continue
        if k in ("offload_param", "offload_optimizer"):
            section = {} if v is None else _section(t, field, v)
            if section is not None:
                _device(t, field, "params" if k == "offload_param" else "optimizer_state",
                        section)
        elif k in _GPU_TIER:
            # The job's own GPU tier (zero_config gpu), in elements as
            # DeepSpeed counts them; no node-wide setting changes.
            n = _whole(t, field, v, 0)
            if n is None:
                continue
            gpu = t.zero.setdefault("gpu", {})
            if k == "stage3_prefetch_bucket_size" and n == 0:
                # DeepSpeed: no prefetch (the tier's 0 elements is its default).
                gpu["prefetch_depth"] = 0
                t.applied(field, "0: sets this job's gpu.prefetch_depth 0 (nothing copied "
                          "to the GPU ahead of its use)")
                continue
            if k == "stage3_max_live_parameters" and n == 0:
                # DeepSpeed: as few as it can (the tier's 0 is the budget):
                # one module's, the least the tier can hold (it raises a
                # smaller cap to the largest module's).
                n = 1
            gpu[_GPU_TIER[k]] = n
            t.applied(field, f"sets this job's gpu.{_GPU_TIER[k]} {n} (elements; used where "
                      "the parameters are on a GPU, by this job's GPU tier alone: no node-wide "
                      "setting changes): " + _GPU_NOTES[k])
        elif k == "reduce_bucket_size":
            n = _whole(t, field, v, 1)
            if n is not None:
                t.zero["reduce_bucket_elements"] = n
        elif k == "cpu_offload":
            if _bool(t, field, v):
                t.zero["placement"]["optimizer_state"] = "host"
        elif k in _OFF_ZERO:
            _off(t, field, v, *_OFF_ZERO[k])
        elif k in _IGNORED_ZERO:
            t.note(field, _IGNORED_ZERO[k])
        else:
            t.fail(field, "not a field offloadd knows")


_SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                 "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                      "warmup_type", "last_batch_iteration"),
}


def _scheduler(t, d):
    kind = d.get("type")
    for k in d:
        if k not in ("type", "params"):
            t.fail(f"scheduler.{k}", "not a field offloadd knows")
    if kind not in _SCHEDULER_PARAMS:
        t.fail("scheduler.type", f"{kind!r}: offloadd builds WarmupLR and WarmupDecayLR; pass "
               "any other as initialize()'s lr_scheduler (a torch.optim.lr_scheduler)")
        return
    params = d.get("params")
    params = {} if params is None else _section(t, "scheduler.params", params)
    if params is None:
        return
    for k, v in params.items():
        field = f"scheduler.params.{k}"
        if k not in _SCHEDULER_PARAMS[kind]:
            t.fail(field, f"not a parameter of {kind}")
        elif k == "warmup_type":
            if v not in ("log", "linear"):
                t.fail(field, f"{v!r} is not log or linear")
        elif k in ("warmup_num_steps", "total_num_steps"):
            _whole(t, field, v, 0)
        elif k == "last_batch_iteration":
            _whole(t, field, v, -1)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                _number(t, f"{field}[{i}]", x, minimum=0.0)
        else:
            _number(t, field, v, minimum=0.0)
    if kind == "WarmupDecayLR" and "total_num_steps" not in params:
        t.fail("scheduler.params.total_num_steps", "WarmupDecayLR needs it")
    t.scheduler = (kind, dict(params))


class WarmupLR:
    """DeepSpeed's WarmupLR: each param group's lr from warmup_min_lr to
    warmup_max_lr (default: the optimizer's lr) over warmup_num_steps
    updates (log or linear), then warmup_max_lr; set to warmup_min_lr when
    made. step() after each update
    (the engine's step() calls it where an update was applied)."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        self.optimizer = optimizer
        if warmup_max_lr is None:  # (DeepSpeed's since 0.17.2: each group's lr)
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        if warmup_type not in ("log", "linear"):
            raise offloadd.InvalidArgumentError(f"warmup_type {warmup_type!r} is not log or linear")
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._set(self.get_lr())

    def _per_group(self, value, name):
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise offloadd.InvalidArgumentError(
                    f"{name}: {len(value)} values for {groups} param groups")
            return [float(v) for v in value]
        return [float(value)] * groups

    def _gamma(self):
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(i + 1) / math.log(self.warmup_num_steps)
            return i / self.warmup_num_steps
        return 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def get_last_lr(self):
        return self._last_lr

    def _set(self, lrs):
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._set(self.get_lr())

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then a linear decay to
    warmup_min_lr at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) /
                   max(1.0, self.total_num_steps - self.warmup_num_steps))


_SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """deepspeed.init_distributed: joins torch.distributed's default group
    where it is not joined yet (gloo on the CPU, nccl with CUDA), from the
    launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
    one process of its own where there is none."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized() or dist_init_required is False:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    os.environ.setdefault("RANK", str(max(rank, 0)))
    os.environ.setdefault("WORLD_SIZE", str(max(world_size, 1)))
    os.environ.setdefault("LOCAL_RANK", "0")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend, init_method=init_method, **kwargs)


def add_config_arguments(parser):
    """deepspeed.add_config_arguments: --deepspeed and --deepspeed_config
    (the config's path, for initialize(args=...)) on an argparse parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (offloadd)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (offloadd)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file")
    return parser


class _Zero:
    """deepspeed.zero: Init() is a context a model is built in; offloadd
    partitions the model at initialize() (the model is built whole, on the
    CPU or its device, first). GatheredParameters(params, modifier_rank)
    gives the parameters of a wrapped model their whole values in its
    context, and writes back what modifier_rank changed
    (offloadd.torch.GatheredParameters)."""

    @staticmethod
    def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
        from offloadd import torch as offloadd_torch
        return offloadd_torch.GatheredParameters(params, modifier_rank, fwd_module, enabled)

    class Init:
        def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                     remote_device=None, pin_memory=False, config_dict_or_path=None,
                     config=None, enabled=True, dtype=None, mpu=None, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False


zero = _Zero()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None):
    """deepspeed.initialize for offloadd: returns (engine, optimizer,
    training_dataloader, lr_scheduler) as DeepSpeed's does, the engine an
    offloadd.torch.DeepSpeedEngine over the wrapped model.

    config (or config_params, or args.deepspeed_config): the DeepSpeed
    config. optimizer: a client torch.optim.Adam/AdamW (or a callable making
    one from the parameters): offloadd steps its param groups, which become
    offloadd's optimizer's (a scheduler made on it, before or after, sets
    the lr offloadd uses, as in DeepSpeed); else the config's optimizer
    section. model_parameters: the parameters or param groups to train
    (default the model's). training_data: a Dataset, loaded by micro-batches
    (train_micro_batch_size_per_gpu; a DistributedSampler, shuffled).
    lr_scheduler: a scheduler made on the client optimizer, or a callable
    making one from the optimizer (it wins over the config's scheduler
    section, as in DeepSpeed); else the config's WarmupLR or WarmupDecayLR;
    the engine steps it after each update applied. torch.distributed is
    joined as DeepSpeed joins it (init_distributed; not with
    dist_init_required=False, where several ranks must have joined it).
    mpu (model parallelism) is not supported."""
    import torch
    import torch.distributed as dist
    from offloadd import torch as offloadd_torch
    if config is None:
        config = config_params
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise offloadd.InvalidArgumentError(
                "initialize: a config and args.deepspeed_config: give one")
        config = args.deepspeed_config
    if config is None:
        raise offloadd.InvalidArgumentError(
            "initialize: no DeepSpeed config (config=, config_params= or args.deepspeed_config)")
    if not isinstance(model, torch.nn.Module):
        raise offloadd.InvalidArgumentError(
            f"initialize: model is a {type(model).__name__}, not a torch.nn.Module")
    if mpu is not None:
        raise offloadd.InvalidArgumentError(
            "initialize: mpu (model parallelism) is not supported by offloadd")
    launched = "WORLD_SIZE" in os.environ
    if dist_init_required is False:
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise offloadd.FailedPreconditionError(
                "initialize: torch.distributed is not initialized and dist_init_required=False: "
                "initialize it first, or let initialize() do it")
    elif not dist.is_initialized() and (launched or dist_init_required):
        init_distributed(dist_init_required=dist_init_required)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    t = translate(config, world, scheduler=True)
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k != "scheduler"}  # (built here)
    # Everything that can be refused is, before the model is wrapped (a
    # wrapped model cannot be handed back as it was).
    if not t.has_optimizer and optimizer is None:
        raise offloadd.InvalidArgumentError(
            "initialize: no optimizer: give the config an optimizer section, or pass "
            "optimizer= (a torch.optim.Adam or AdamW, or a callable making one)")
    params = list(model_parameters) if model_parameters is not None else None
    client = None
    adamw = None
    if optimizer is not None:
        if t.has_optimizer:
            log.info("initialize: the client optimizer is used, not the config's optimizer "
                     "section (as DeepSpeed does)")
            config = {k: v for k, v in config.items() if k != "optimizer"}
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(params if params is not None else model.parameters())
        client = optimizer
        adamw = _client_optimizer(client, torch)
    elif params is not None:
        adamw = {"params": params}
    if lr_scheduler is not None:
        made_on = getattr(lr_scheduler, "optimizer", None)
        if hasattr(lr_scheduler, "step"):
            if made_on is None or made_on is not client:
                raise offloadd.InvalidArgumentError(
                    "initialize: lr_scheduler was made on another optimizer than the one "
                    "passed as optimizer=; make it on that one, or pass a callable that makes "
                    "it from the optimizer it is given")
        elif not callable(lr_scheduler):
            raise offloadd.InvalidArgumentError(
                f"initialize: lr_scheduler is a {type(lr_scheduler).__name__}: give a scheduler "
                "made on the client optimizer, or a callable making one from an optimizer")
        if t.scheduler is not None:
            log.info("initialize: lr_scheduler is used, not the config's scheduler section (as "
                     "DeepSpeed does)")
            t.scheduler = None
    groups = 1
    if adamw and adamw.get("params") and isinstance(adamw["params"][0], dict):
        groups = len(adamw["params"])
    if t.scheduler is not None:
        kind, sparams = t.scheduler
        for name in ("warmup_min_lr", "warmup_max_lr"):
            v = sparams.get(name)
            if isinstance(v, list) and len(v) != groups:
                raise offloadd.InvalidArgumentError(
                    f"DeepSpeed config field 'scheduler.params.{name}': {len(v)} values for "
                    f"{groups} param groups")
    loader = None
    if training_data is not None:
        if t.batch_sizes[1] is None:
            raise offloadd.InvalidArgumentError(
                "initialize: training_data needs train_micro_batch_size_per_gpu (or "
                "train_batch_size) in the config")
        loader = data_loader(training_data, t.batch_sizes[1], collate_fn, t.drop_last)
    model, opt = offloadd_torch.wrap(model, adamw, deepspeed_config=config)
    try:
        if client is not None:
            # The client's param groups are the ones offloadd steps (a
            # scheduler made on the client sets their lr), as DeepSpeed's
            # ZeRO-3 steps its basic optimizer's.
            client.param_groups = opt.param_groups
        scheduler = lr_scheduler
        if t.scheduler is not None:
            kind, sparams = t.scheduler
            scheduler = _SCHEDULERS[kind](opt, **sparams)
        elif lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
            scheduler = lr_scheduler(opt)
        engine = offloadd_torch.DeepSpeedEngine(model, opt, scheduler, client=client,
                                                config=config, auto_cast=t.auto_cast)
    except BaseException:
        opt.close()  # (its session, unfinished: an exception is on its way)
        raise
    return engine, opt, loader, scheduler


def data_loader(dataset, batch_size, collate_fn=None, drop_last=False, data_sampler=None,
                pin_memory=None):
    """DeepSpeed's data loader: micro-batches of `dataset`, each rank its
    share (a DistributedSampler, shuffled, where torch.distributed is
    joined; else shuffled)."""
    import torch
    import torch.distributed as dist
    if data_sampler is None:
        data_sampler = (torch.utils.data.DistributedSampler(dataset, dist.get_world_size(),
                                                            dist.get_rank())
                        if dist.is_initialized() else torch.utils.data.RandomSampler(dataset))
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=data_sampler,
                                       collate_fn=collate_fn, pin_memory=pin_memory,
                                       drop_last=drop_last)


def _client_optimizer(optimizer, torch):
    """wrap()'s adamw_config from a client torch.optim.Adam or AdamW: its
    param groups with their hyperparameters."""
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise offloadd.InvalidArgumentError(
            f"initialize: a client {kind.__name__}: offloadd runs Adam and AdamW in its daemon "
            "(pass a torch.optim.Adam or AdamW, or the config's optimizer section)")
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps",
                                                           "weight_decay", "amsgrad",
                                                           "maximize")})
    return {"params": groups, "adamw": kind is torch.optim.AdamW}


def _without_auto(t, d, prefix=""):
    """`d` without its "auto" values, each refused by name (Hugging Face's
    DeepSpeed integration fills them in)."""
    kept = {}
    for k, v in d.items():
        if isinstance(v, dict):
            kept[k] = _without_auto(t, v, f"{prefix}{k}.")
        elif isinstance(v, str) and v == "auto":
            t.fail(prefix + k, "'auto' is filled in by Hugging Face's DeepSpeed integration; "
                   "give the value")
            t.autos.add(prefix + k)
        else:
            kept[k] = v
    return kept


def translate(config, world_size=1, scheduler=False):
    """A DeepSpeed config (dict, or path of a JSON file) as a Translation.
    Every field offloadd cannot take is named in one InvalidArgumentError.
    `scheduler`: its scheduler section is taken (initialize() builds it)."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise offloadd.InvalidArgumentError("a DeepSpeed config is a dict or a JSON file path")
    t = Translation()
    config = _without_auto(t, config)
    if "zero_optimization" not in config:
        t.fail("zero_optimization", "missing: offloadd.torch is ZeRO stage 3")
    for k, v in config.items():
        if k == "zero_optimization":
            d = _section(t, k, v)
            if d is not None:
                _zero(t, d)
        elif k == "optimizer":
            d = _section(t, k, v)
            if d is not None:
                _optimizer(t, d)
        elif k == "fp16":
            d = _section(t, k, v)
            if d is not None:
                _fp16(t, d)
        elif k in ("bf16", "bfloat16"):  # (DeepSpeed takes both names)
            d = _section(t, k, v)
            if d is not None:
                _bf16(t, k, d, config)
        elif k == "gradient_clipping":
            clip = _number(t, k, v, minimum=0.0)
            if clip is not None:
                t.zero["gradient_clipping"] = clip
        elif k == "gradient_accumulation_steps":
            n = _whole(t, k, v, 1)
            if n is not None:
                t.zero["gradient_accumulation_steps"] = n
        elif k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            _whole(t, k, v, 1)  # (used below, with the accumulation)
        elif k == "scheduler" and scheduler:
            d = _section(t, k, v)
            if d is not None:
                _scheduler(t, d)
        elif k == "scheduler":
            t.fail("scheduler", "offloadd.deepspeed.initialize() builds it (WarmupLR, "
                   "WarmupDecayLR); with wrap(), use a torch.optim.lr_scheduler on the optimizer "
                   "wrap() returns, and call its step() only after a step() that updated: where "
                   "model.is_gradient_accumulation_boundary() was true before it (DeepSpeed "
                   "steps its scheduler at the accumulation boundary)")
        elif k == "data_types":
            d = _section(t, k, v)
            for f, x in (d or {}).items():
                if f == "grad_accum_dtype" and x in (None, "fp32"):
                    t.note(f"{k}.{f}", "offloadd accumulates gradients in fp32")
                else:
                    t.fail(f"{k}.{f}", f"{x!r}: offloadd accumulates gradients in fp32 only")
        elif k == "communication_data_type":
            if v in (None, "fp32"):
                t.note(k, "offloadd reduces gradients across ranks in fp32")
            else:
                t.fail(k, f"{v!r}: offloadd reduces gradients across ranks in fp32 only")
        elif k == "dataloader_drop_last":
            drop = _bool(t, k, v)
            if drop is not None:
                t.drop_last = drop
                t.applied(k, "initialize()'s data loader drops a last, short micro-batch" if drop
                          else "initialize()'s data loader keeps a last, short micro-batch")
        elif k in _OFF_TOP:
            _off(t, k, v, *_OFF_TOP[k])
        elif k in _SECTIONS_NOTED:
            t.note(k, _SECTIONS_NOTED[k])
        elif k in _SECTIONS_OFF:
            _enabled_only_off(t, k, v, _SECTIONS_OFF[k])
        elif k in _IGNORED_TOP:
            t.note(k, _IGNORED_TOP[k])
        else:
            t.fail(k, "not a field offloadd knows")
    if not t.errors:
        _batches(t, config, world_size)
    if len(t.errors) == 1:
        raise offloadd.InvalidArgumentError(f"DeepSpeed config field {t.errors[0]}")
    if t.errors:
        raise offloadd.InvalidArgumentError(
            f"DeepSpeed config: {len(t.errors)} fields offloadd cannot take:\n  " +
            "\n  ".join(t.errors))
    return t


def _batches(t, config, world_size):
    """DeepSpeed's batch = micro batch x accumulation x ranks: checked where
    all three are given, the accumulation derived from the other two, a
    train_batch_size that cannot be split so refused (as DeepSpeed's
    assertion does)."""
    batch, micro, gas = (int(config[k]) if config.get(k) is not None else None
                         for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                   "gradient_accumulation_steps"))
    if batch is not None and micro is not None and gas is not None:
        if batch != micro * gas * world_size:
            t.fail("train_batch_size", f"{batch} is not train_micro_batch_size_per_gpu x "
                   f"gradient_accumulation_steps x ranks = {micro} x {gas} x {world_size}")
            return
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            t.applied(k, f"checked: {micro} x {gas} x {world_size} ranks = {batch}")
    elif batch is not None and micro is not None:
        per_step = micro * world_size
        if batch % per_step:
            t.fail("train_batch_size", f"{batch} is not a multiple of "
                   f"train_micro_batch_size_per_gpu x ranks = {per_step}")
            return
        t.zero["gradient_accumulation_steps"] = batch // per_step
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            t.applied(k, f"sets gradient_accumulation_steps {batch // per_step} "
                      f"({batch} / ({micro} x {world_size} ranks))")
    elif batch is not None and gas is not None:
        if batch % (gas * world_size):
            t.fail("train_batch_size", f"{batch} is not a multiple of "
                   f"gradient_accumulation_steps x ranks = {gas * world_size}")
            return
        t.note("train_batch_size", f"checked against gradient_accumulation_steps x ranks; "
               f"{_BATCHES}")
    else:
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            if config.get(k) is not None:
                t.applied(k, f"the engine's {k}() (and initialize()'s data loader's micro-batch); "
                          f"{_BATCHES}")
    # DeepSpeed's own figures, for the engine's train_batch_size() and
    # train_micro_batch_size_per_gpu().
    gas = t.zero.get("gradient_accumulation_steps", gas or 1)
    if micro is None and batch is not None:
        micro = batch // (gas * world_size)
    if batch is None and micro is not None:
        batch = micro * gas * world_size
    t.batch_sizes = (batch, micro)


def from_config(config, world_size=1):
    """(adamw_config, zero_config) for wrap(); logs one line naming the
    fields accepted and ignored (WARNING) or only those applied in
    offloadd's own terms (INFO), each note in full at debug level.
    adamw_config is empty where the config has no optimizer section
    (DeepSpeed's client optimizer: wrap() takes it as adamw_config)."""
    return from_translation(translate(config, world_size))


def from_translation(t):
    if t.notes:
        ignored = [n.split(":", 1)[0] for n in t.notes if ": accepted and ignored:" in n]
        applied = [n.split(":", 1)[0] for n in t.notes if ": applied:" in n]
        parts = []
        if ignored:
            parts.append(f"{len(ignored)} field(s) accepted and ignored ({', '.join(ignored)})")
        if applied:
            parts.append(f"{len(applied)} applied to this job alone ({', '.join(applied)})")
        log.log(logging.WARNING if ignored else logging.INFO,
                "DeepSpeed config: %s; the notes at debug level of logger %r", "; ".join(parts),
                log.name)
    for n in t.notes:
        log.debug("DeepSpeed config %s", n)
    return t.adamw, t.zero


def _fields():
    """The fields, for help(offloadd.deepspeed)."""
    lines = ["", "Fields mapped to offloadd's settings:",
             "  zero_optimization.stage              3 (the only stage offloadd runs)",
             "  zero_optimization.offload_param/offload_optimizer.device",
             "                                       cpu or none: placement host; nvme: nvme",
             "                                       (ratio: 1 only)",
             "  zero_optimization.cpu_offload        true: optimizer state on the host",
             "  zero_optimization.reduce_bucket_size zero_config reduce_bucket_elements"]
    for k, v in _GPU_TIER.items():
        lines.append(f"  zero_optimization.{k}".ljust(39) + f" gpu.{v}: {_GPU_NOTES[k]}")
    lines += [
        "    (stage3_prefetch_bucket_size 0: no prefetch; stage3_max_live_parameters 0: as few",
        "    as the tier can hold, one module's)",
        "  optimizer                            type Adam or AdamW; params lr, betas, eps,",
        "                                       weight_decay (default 0; 0.01 with torch_adam",
        "                                       in AdamW mode), adam_w_mode, torch_adam,",
        "                                       amsgrad false, bias_correction true. Without",
        "                                       it, wrap() takes adamw_config (the optimizer",
        "                                       DeepSpeed's client would pass)",
        "  fp16                                 working dtype fp16; loss_scale (static) or",
        "                                       initial_scale_power, loss_scale_window,",
        "                                       hysteresis, min_loss_scale (dynamic)",
        "  bf16.enabled                         working dtype bf16",
        "  gradient_clipping                    global max norm, at the accumulation boundary",
        "  gradient_accumulation_steps          micro-batches per update (backward() divides",
        "                                       the loss by it); derived from",
        "                                       train_batch_size / (train_micro_batch_size_per_gpu",
        "                                       x ranks), checked where all three are given",
        "",
        "Fields accepted and ignored (one WARNING line names them; each reason at DEBUG):"]
    reasons = {}  # one line a reason, naming its fields
    for prefix, table in (("", _IGNORED_TOP), ("zero_optimization.", _IGNORED_ZERO),
                          ("zero_optimization.offload_*.", _OFFLOAD_FIELDS)):
        for k, why in table.items():
            reasons.setdefault(why, []).append(prefix + k)
    for why, fields in reasons.items():
        lines.append(f"  {', '.join(fields)}: {why}")
    lines += ["", "Fields taken at DeepSpeed's default only (any other value refused):"]
    for prefix, table in (("", _OFF_TOP), ("zero_optimization.", _OFF_ZERO)):
        for k, (off, why) in table.items():
            lines.append(f"  {prefix}{k} {json.dumps(off)}: {why}")
    lines.append("  data_types.grad_accum_dtype fp32, communication_data_type fp32: offloadd "
                 "reduces and accumulates in fp32")
    lines.append(f"  {', '.join(_SECTIONS_OFF)}: with enabled false")
    for k, why in _SECTIONS_NOTED.items():
        lines.append(f"  {k} (any): {why}")
    lines += ["", "Booleans are read as DeepSpeed reads them (true/false, 1/0, \"true\"/\"false\"",
              "as text). Refused by name, all at once (InvalidArgumentError): scheduler (a",
              "torch lr_scheduler instead), any value \"auto\", values of the wrong type, and",
              "every field not listed here."]
    return "\n".join(lines) + "\n"


__doc__ = (__doc__ or "") + _fields()  # (None under python -OO)
