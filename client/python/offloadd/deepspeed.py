"""DeepSpeed configs for offloadd.torch.wrap.

    model, optimizer = offloadd.torch.wrap(model, deepspeed_config="ds_config.json")

translate() maps each field of a DeepSpeed config (ZeRO stage 3, offload,
optimizer, fp16/bf16, clipping, accumulation) to wrap()'s adamw_config and
zero_config. A field offloadd does not support is an InvalidArgumentError
naming it. A field that has no meaning under offloadd's design (buffer
counts and sizes: one pool per node is sized by the daemon) is accepted
with a note saying why; from_config() logs one WARNING line naming those
fields, and each note at DEBUG, on the "offloadd.deepspeed" logger.
"""
import json
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


class Translation:
    def __init__(self):
        self.adamw = {}
        self.has_optimizer = False  # the config has an optimizer section
        self.zero = {"placement": {}}
        self.notes = []  # "field: accepted and ignored: why" or "field: applied: what"

    def note(self, field, why):
        self.notes.append(f"{field}: accepted and ignored: {why}")

    def applied(self, field, what):
        self.notes.append(f"{field}: applied: {what}")


def _fail(field, why):
    raise offloadd.InvalidArgumentError(f"DeepSpeed config field '{field}': {why}")


def _device(t, section, kind, d):
    device = d.get("device", "none")
    if device in ("cpu", "none"):
        t.zero["placement"][kind] = "host"
        if device == "none":
            t.note(f"{section}.device", "'none' (no offload): offloadd holds this data in its "
                   "host tier")
    elif device == "nvme":
        t.zero["placement"][kind] = "nvme"
    else:
        _fail(f"{section}.device", f"'{device}' is not cpu, nvme or none")
    for k, v in d.items():
        field = f"{section}.{k}"
        if k == "device":
            continue
        if k == "ratio":
            if v != 1 and v != 1.0:
                _fail(field, f"{v}: offloadd steps the whole optimizer on the CPU; a share of "
                      "it on the GPU is not supported")
            continue
        if k in _OFFLOAD_FIELDS:
            t.note(field, _OFFLOAD_FIELDS[k])
        else:
            _fail(field, "not a field offloadd knows")


def _optimizer(t, d):
    kind = str(d.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        _fail("optimizer.type", f"'{d.get('type')}': offloadd runs Adam and AdamW")
    for k in d:
        if k not in ("type", "params"):
            _fail(f"optimizer.{k}", "not a field offloadd knows")
    params = dict(d.get("params") or {})
    adamw = kind == "adamw" or params.pop("adam_w_mode", True)
    params.pop("adam_w_mode", None)
    t.has_optimizer = True
    t.adamw["adamw"] = bool(adamw)
    # DeepSpeed's default, its CPU Adam's: 0. With torch_adam it builds
    # torch.optim.AdamW (default 0.01) or torch.optim.Adam (0) instead.
    t.adamw["weight_decay"] = 0.01 if params.get("torch_adam") and adamw else 0.0
    for k, v in params.items():
        field = f"optimizer.params.{k}"
        if k in ("lr", "eps", "weight_decay"):
            t.adamw[k] = float(v)
        elif k == "betas":
            t.adamw["betas"] = tuple(float(b) for b in v)
        elif k == "torch_adam":
            t.note(field, "offloadd's Adam is bit-identical to torch's (its default "
                   "weight_decay, torch's, applies)")
        elif k == "amsgrad":
            if v:
                _fail(field, "AMSGrad is not supported")
        elif k == "bias_correction":
            if not v:
                _fail(field, "Adam without bias correction is not supported by offloadd.torch")
        else:
            _fail(field, "not a field offloadd knows")


def _fp16(t, d):
    for k in d:
        if k not in ("enabled", "auto_cast", "loss_scale", "initial_scale_power",
                     "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                     "min_loss_scale", "fp16_master_weights_and_grads"):
            _fail(f"fp16.{k}", "not a field offloadd knows")
    if not d.get("enabled", False):
        return
    t.zero["working_dtype"] = "fp16"
    if d.get("consecutive_hysteresis"):
        _fail("fp16.consecutive_hysteresis", "not supported (hysteresis counts all overflows)")
    if d.get("fp16_master_weights_and_grads"):
        _fail("fp16.fp16_master_weights_and_grads", "offloadd's master weights are fp32")
    if d.get("auto_cast"):
        t.note("fp16.auto_cast", "the model runs in its parameters' dtype; use torch.autocast")
    static = float(d.get("loss_scale", 0))
    if static > 0:
        t.zero["static_loss_scale"] = static
        return
    t.zero["loss_scaling"] = {
        "initial_scale": 2.0 ** float(d.get("initial_scale_power", 16)),
        "growth_interval": int(d.get("loss_scale_window", 1000)),
        "hysteresis": int(d.get("hysteresis", 2)),
        "min_scale": float(d.get("min_loss_scale", 1)),
    }


def _zero(t, d):
    stage = d.get("stage", 0)
    if stage != 3:
        _fail("zero_optimization.stage", f"{stage}: offloadd partitions parameters (stage 3)")
    for k, v in d.items():
        field = f"zero_optimization.{k}"
        if k == "stage":
            continue
        if k == "offload_param":
            _device(t, field, "params", v or {})
        elif k == "offload_optimizer":
            _device(t, field, "optimizer_state", v or {})
        elif k in _GPU_TIER:
            # The job's own GPU tier (zero_config gpu), in elements as
            # DeepSpeed counts them; no node-wide setting changes.
            n = _count(field, v)
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
            t.zero["reduce_bucket_elements"] = int(v)
        elif k == "cpu_offload":
            if v:
                t.zero["placement"]["optimizer_state"] = "host"
        elif k in _IGNORED_ZERO:
            t.note(field, _IGNORED_ZERO[k])
        else:
            _fail(field, "not a field offloadd knows")


def _count(field, v):
    """A count of elements (DeepSpeed writes 1e9 or 5e8 too): a whole,
    non-negative number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
        _fail(field, f"{v!r} is not a whole number of elements")
    return int(v)


def _positive_int(field, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 or v != int(v):
        _fail(field, f"{v!r} is not a positive whole number")
    return int(v)


def _refuse_auto(d, prefix):
    for k, v in d.items():
        if isinstance(v, dict):
            _refuse_auto(v, f"{prefix}{k}.")
        elif v == "auto":
            _fail(prefix + k, "'auto' is filled in by Hugging Face's DeepSpeed integration; "
                  "give the value")


def translate(config, world_size=1):
    """A DeepSpeed config (dict, or path of a JSON file) as a Translation."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise offloadd.InvalidArgumentError("a DeepSpeed config is a dict or a JSON file path")
    t = Translation()
    _refuse_auto(config, "")
    if "zero_optimization" not in config:
        _fail("zero_optimization", "missing: offloadd.torch is ZeRO stage 3")
    for k, v in config.items():
        if k == "zero_optimization":
            _zero(t, v)
        elif k == "optimizer":
            _optimizer(t, v)
        elif k == "fp16":
            _fp16(t, v)
        elif k == "bf16":
            for f in v:
                if f != "enabled":
                    _fail(f"bf16.{f}", "not a field offloadd knows")
            if v.get("enabled", False):
                if config.get("fp16", {}).get("enabled", False):
                    _fail("bf16.enabled", "fp16 and bf16 are both enabled")
                t.zero["working_dtype"] = "bf16"
        elif k == "gradient_clipping":
            t.zero["gradient_clipping"] = float(v)
        elif k == "gradient_accumulation_steps":
            t.zero["gradient_accumulation_steps"] = _positive_int(k, v)
        elif k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            _positive_int(k, v)  # (used below, with the accumulation)
        elif k == "scheduler":
            _fail("scheduler", "use a torch.optim.lr_scheduler on the optimizer wrap() returns, "
                  "and call its step() only after a step() that updated: where "
                  "model.is_gradient_accumulation_boundary() was true before it (DeepSpeed "
                  "steps its scheduler at the accumulation boundary)")
        elif k in _IGNORED_TOP:
            t.note(k, _IGNORED_TOP[k])
        else:
            _fail(k, "not a field offloadd knows")
    _batches(t, config, world_size)
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
            _fail("train_batch_size", f"{batch} is not train_micro_batch_size_per_gpu x "
                  f"gradient_accumulation_steps x ranks = {micro} x {gas} x {world_size}")
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            t.applied(k, f"checked: {micro} x {gas} x {world_size} ranks = {batch}")
    elif batch is not None and micro is not None:
        per_step = micro * world_size
        if batch % per_step:
            _fail("train_batch_size", f"{batch} is not a multiple of "
                  f"train_micro_batch_size_per_gpu x ranks = {per_step}")
        t.zero["gradient_accumulation_steps"] = batch // per_step
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            t.applied(k, f"sets gradient_accumulation_steps {batch // per_step} "
                      f"({batch} / ({micro} x {world_size} ranks))")
    elif batch is not None and gas is not None:
        if batch % (gas * world_size):
            _fail("train_batch_size", f"{batch} is not a multiple of "
                  f"gradient_accumulation_steps x ranks = {gas * world_size}")
        t.note("train_batch_size", f"checked against gradient_accumulation_steps x ranks; "
               f"{_BATCHES}")
    else:
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            if config.get(k) is not None:
                t.note(k, _BATCHES)


def from_config(config, world_size=1):
    """(adamw_config, zero_config) for wrap(); logs one line naming the
    fields accepted and ignored and those applied in offloadd's own terms
    (each note in full at debug level). adamw_config is empty where the
    config has no optimizer section (DeepSpeed's client optimizer: wrap()
    takes it as adamw_config)."""
    t = translate(config, world_size)
    if t.notes:
        ignored = [n.split(":", 1)[0] for n in t.notes if ": accepted and ignored:" in n]
        applied = [n.split(":", 1)[0] for n in t.notes if ": applied:" in n]
        parts = []
        if ignored:
            parts.append(f"{len(ignored)} field(s) accepted and ignored ({', '.join(ignored)})")
        if applied:
            parts.append(f"{len(applied)} applied to this job alone ({', '.join(applied)})")
        log.warning("DeepSpeed config: %s; the notes at debug level of logger %r",
                    "; ".join(parts), log.name)
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
    lines += ["", "Refused by name (InvalidArgumentError): scheduler (a torch lr_scheduler",
              "instead), any value \"auto\", and every field not listed here."]
    return "\n".join(lines) + "\n"


__doc__ = (__doc__ or "") + _fields()  # (None under python -OO)
