"""ZeRO-3 training of a torch model through the node's offloadd.

    import offloadd.torch
    model, optimizer = offloadd.torch.wrap(
        model,
        {"lr": 3e-4, "weight_decay": 0.1},                     # AdamW, as torch.optim.AdamW
        {"placement": {"optimizer_state": "nvme"}, "gradient_clipping": 1.0})
    for x, y in batches:
        loss = loss_fn(model(x), y)
        optimizer.backward(loss)    # loss.backward() does too, without fp16 or accumulation
        optimizer.step()
        optimizer.zero_grad()

What happens:
- Every parameter is split into `world_size` equal slices (the last padded);
  each rank registers its slice with its node's daemon (one session per rank)
  and keeps none of it. The daemon holds the fp32 master weights, Adam
  moments and gradient accumulator, placed on the host or NVMe.
- Just before a module runs, a hook fetches its parameters' slices from the
  daemon and all-gathers them into full tensors; after the module ran they
  are freed. In backward a parameter is gathered again when autograd needs
  its saved value (a saved-tensor hook), and freed once its gradient exists.
- A parameter's gradient is averaged across ranks (reduce-scatter, or
  all-reduce where the backend has no reduce-scatter), and this rank's slice
  is returned to the daemon, which accumulates it in fp32 across
  micro-batches.
- `optimizer.step()` asks every rank's daemon for its gradients' squared norm
  and overflow, combines them across ranks, and commits the step with the
  global clip coefficient (or skips it on overflow, every rank alike). Torch
  param groups and lr schedulers work as with torch's optimizers.

On a GPU, the GPU tier (zero_config "gpu") copies each module's parameters
to the device ahead of use on a side stream, from the daemon's arena
registered for DMA, into a budget of GPU memory where they stay while they
fit, and copies gradients back on a stream of their own while backward
runs (see _GpuTier). nn.MultiheadAttention and torch's transformer layers
are gathered whole (their forward reads submodules' weights directly).

The torch.distributed process group (gloo on CPU, NCCL on GPU) is the
trainer's: initialise it before wrap(); without one, wrap() trains in one
process. Give init_process_group a timeout so that a rank whose peer died
gets an error (PeerLostError) instead of waiting for it forever.

Limits, said plainly:
- A parameter must be used inside the forward of the module it belongs to,
  called as module(x) (its own parameter, or one of its ParameterList or
  ParameterDict, not a submodule's: a parent's forward that reads a child's
  weight without calling the child is refused; nn.MultiheadAttention and
  torch's transformer layers are gathered whole, everything below them
  with them); a use of its values anywhere else is refused
  (FailedPreconditionError naming it), through p.data and p.detach() too
  (an EMA of the weights, copy.deepcopy(model): read them with
  model.state_dict()), and so are model.to(), .cpu(), .half() ... after
  wrap() where they would move or cast a parameter (one that changes
  nothing, model.to(the device it is on), is served). Its shape, size and
  numel() are the whole parameter's at any time.
- p.grad stays None: the gradients go to the daemon in backward (clip with
  zero_config gradient_clipping, scale the loss with optimizer.backward;
  optimizer.last_step has the step's gradient norm).
- Every rank runs each forward of the wrapped model (evaluations too) and
  calls state_dict() and load_state_dict() at the same point: each
  parameter is gathered from all ranks; a rank that gathers other
  parameters in the same collective is told so on every rank
  (FailedPreconditionError; on a GPU at the end of the backward or
  state_dict()); collectives of different sizes fail in torch.distributed
  (gloo may end the process; otherwise the process group's timeout).
- model.state_dict() is a collective (every rank calls it), on the wrapped
  model itself (not a submodule); it returns the working copy, so with a
  bf16/fp16 working_dtype the values are rounded from the fp32 master
  (zero_config state_dict "master": the fp32 master weights themselves),
  on the CPU also for a model on a GPU (whose memory need not hold the
  model twice; as FSDP's offload_to_cpu), the parameters' buffers where
  they are.
  model.load_state_dict() is one too: each rank's slice of the loaded values
  becomes its partition's master weights (fp32, exactly where the module's
  parameters are fp32: torch copies the loaded values into them first; the
  working copy rounded from them); the optimizer's moments and step counts
  stay, as
  torch's do. optimizer.state_dict() and load_state_dict() are torch
  AdamW's format (collectives too); optimizer.checkpoint(dir) and
  zero_config restore_from are faster and keep the fp32 master weights.
- A forward that changes its module's parameters in place (under no_grad:
  nn.Embedding's max_norm, a constraint the module applies) has the elements
  it changed kept as their master weights, each rank its own slice's, once
  the module's forward returns; with the delayed update (the forward read
  the step before's weights) or the GPU tier (its copies on the GPU would
  have to follow) that is refused with FailedPreconditionError.
- Non-finite gradients skip the step on every rank (torch would write NaN);
  optimizer.last_step says so.
- With loss scaling, call optimizer.backward(loss), not loss.backward().
"""
import atexit
import bisect
import contextlib
import functools
import glob
import inspect
import logging
import math
import random
import re
import os
import signal
import sys
import threading
import time
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

import offloadd

_log = logging.getLogger("offloadd.torch")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TIERS = {"host": 100, "cpu": 100, "nvme": 0}


class PeerLostError(offloadd.UnavailableError):
    """A collective with the other ranks failed: a peer died or hung."""


class SessionRestored(Exception):
    """offloadd stopped or crashed and came back, and this job goes on from
    the session it kept (a SIGTERM, with server.reconnect_lease_seconds on) or
    from its last automatic checkpoint (checkpoint.auto_*): the model's
    parameters and the optimizer's state are those after `step` updates
    (counted from the start of training; a step skipped for non-finite
    gradients does not count). Raised by the call that found out; during
    backward, by optimizer.backward(loss) (loss.backward() would turn it
    into a RuntimeError). The iteration that
    raised it is lost; the training loop goes on from step `step` (its data
    position and learning-rate schedule are its own to rewind):

        step = 0
        while step < steps:
            try:
                optimizer.backward(loss_fn(model(batch(step))))
                optimizer.step()
                step += 1
            except offloadd.torch.SessionRestored as restored:
                step = restored.step
    """

    def __init__(self, step, source):
        super().__init__(f"offloadd restarted; this job goes on from step {step} ({source})")
        self.step = step
        self.source = source


class _Uninterrupted:
    """A Ctrl-C (SIGINT) held back on the main thread while a call to
    offloadd and the record of what it did run, then handled (by default:
    KeyboardInterrupt) when the outermost such block ends: raised between
    the call's return and its record, it lost what the call did (a unit
    in use on the GPU tier that no forward knew of, which then never had
    room again; gradients returned and not dropped by zero_grad; a step
    applied whose copies on the GPU stayed stale). A wait for room inside
    (with_room, where the call failed and did nothing) handles it at once.
    Nested blocks count; other threads (autograd's) get no SIGINT."""

    _depth = 0
    _previous = None  # the handler held back while _depth > 0
    _pending = None   # (signum, frame) of a SIGINT held back

    def __enter__(self):
        cls = _Uninterrupted
        self.active = threading.current_thread() is threading.main_thread()
        if not self.active:
            return self
        if cls._depth == 0:
            # (A handler not set from Python, which could not be put back,
            # or none at all: left alone.)
            if signal.getsignal(signal.SIGINT) in (None, signal.SIG_IGN):
                self.active = False
                return self
            try:
                cls._previous = signal.signal(signal.SIGINT, cls._hold)
            except ValueError:  # (not the main interpreter)
                self.active = False
                return self
        cls._depth += 1
        return self

    def __exit__(self, *exc):
        if not self.active:
            return False
        cls = _Uninterrupted
        cls._depth -= 1
        if cls._depth == 0:
            signal.signal(signal.SIGINT, cls._previous)
            cls._deliver(cls._previous)
        return False

    @staticmethod
    def _hold(signum, frame):
        _Uninterrupted._pending = (signum, frame)

    @classmethod
    def handle_now(cls):
        """Inside a block, where nothing is left half done: a SIGINT held
        back is handled now (its KeyboardInterrupt raised here; on the main
        thread, whose it is)."""
        if cls._depth > 0 and threading.current_thread() is threading.main_thread():
            cls._deliver(cls._previous)

    @classmethod
    def _deliver(cls, handler):
        pending, cls._pending = cls._pending, None
        if pending is None:
            return
        if callable(handler):
            handler(*pending)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)  # (restored: what it would have done)


class _GuardedSession:
    """A session whose calls survive a crash of offloadd: a call that finds
    the daemon gone (UNAVAILABLE) waits for it to come back, and once it
    answers that the session is from before its restart (NOT_FOUND), the
    engine opens a new one from the last automatic checkpoint and the call
    raises SessionRestored. Without automatic checkpoints, calls fail as
    the session's do."""

    # How long a call waits for offloadd to come back (a stop that keeps
    # the sessions writes them first, and the next offloadd reads them).
    RESTART_WAIT_SECONDS = 300.0

    def __init__(self, engine, session):
        self._engine = engine
        self._session = session

    @property
    def raw(self):
        """The binding's Session (for native code that takes one)."""
        return self._session

    def __getattr__(self, name):
        attr = getattr(self._session, name)
        if not callable(attr) or not self._session.auto_checkpoint_dir:
            return attr

        def call(*args, **kwargs):
            deadline = time.monotonic() + self.RESTART_WAIT_SECONDS
            while True:
                try:
                    return attr(*args, **kwargs)
                except offloadd.UnavailableError:
                    if time.monotonic() >= deadline:
                        raise
                    _Uninterrupted.handle_now()  # (nothing done: a Ctrl-C held back goes now)
                    time.sleep(0.05)  # offloadd is gone or stopping: wait for its successor
                except offloadd.NotFoundError as e:
                    if "not one of its ids" not in str(e):
                        raise
                    self._engine.resume_after_crash(e)  # raises SessionRestored
                except offloadd.FailedPreconditionError as e:
                    if "kept session" not in str(e):
                        raise
                    self._engine.resume_kept(e)  # raises SessionRestored
        return call


def _percent(kind, value):
    if value is None:
        return None
    if isinstance(value, str):
        if value not in _TIERS:
            raise offloadd.InvalidArgumentError(
                f"placement.{kind}: '{value}' is not a tier; use 'host', 'nvme' or a percent "
                "kept on the host")
        return _TIERS[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise offloadd.InvalidArgumentError(
            f"placement.{kind}: {value!r} is not a percent in [0, 100]")
    return int(round(value))


class _Shard:
    """One parameter: its full shape here, its slice in the daemon."""

    __slots__ = ("name", "param", "shape", "numel", "slice_numel", "dtype", "device", "pid",
                 "_gathered", "accumulate_node", "module_shards", "refs", "version", "in_optimizer",
                 "unit", "guarded", "has_grad", "grad_since_step", "changes_in_place",
                 "snapshot", "off_slab", "accumulated_in", "__weakref__")

    def __init__(self, name, param, world):
        self.name = name
        self.param = param
        self.shape = param.shape
        self.numel = param.numel()
        self.slice_numel = max(1, -(-self.numel // world))  # ceil; the last rank's is padded
        self.dtype = param.dtype
        self.device = param.device
        self.pid = None
        self.guarded = False  # its class turns _OffloadedParameter while not gathered
        self.gathered = False
        self.accumulate_node = None
        self.module_shards = [self]  # gathered together in backward
        self.refs = 0  # forward calls running that use it (a module inside another's)
        self.version = 0  # its version counter as the outermost such call began
        self.in_optimizer = False  # in a param group: its gradients go to the daemon
        self.unit = None  # its unit in the GPU tier (_GpuTier), if one runs
        # torch's p.grad would be a tensor (a backward reached it, and no
        # zero_grad(set_to_none=True) since): a step updates it, with a zero
        # gradient if none came since the last step.
        self.has_grad = False
        self.grad_since_step = False  # a backward reached it since the last step
        # Its module's forward changed it in place before: each forward
        # keeps a copy of what it gathered (`snapshot`) to compare with.
        self.changes_in_place = False
        self.snapshot = None
        # Gathered by a forward run again in backward and kept (see
        # _after_forward): its GPU tier unit let go already.
        self.off_slab = False
        # The backward (_Engine._backwards) whose gradient of it was
        # accumulated (and it freed): that backward reads it no more.
        self.accumulated_in = -1

    @property
    def gathered(self):
        """Whether the whole parameter's values are in param.data."""
        return self._gathered

    @gathered.setter
    def gathered(self, present):
        self._gathered = present
        if self.guarded:
            # Checked only while absent: a forward's own uses cost nothing.
            self.param.__class__ = torch.nn.Parameter if present else _OffloadedParameter


class _ReduceBucket:
    """Gradients of several parameters averaged across ranks in one
    collective (DeepSpeed's reduce_bucket_size, in elements of full
    gradients): rank r's part of each gradient lies in row r of one fp32
    buffer, the parameters side by side, so one reduce-scatter (NCCL; with
    gloo, which has none, an all-reduce) leaves each rank its averaged
    slices side by side. Every rank adds the same gradients in the same
    order (backward's), so every rank reaches each collective. A gradient
    is copied in when it comes: none is kept alive for the bucket.

    That every rank did is checked in the same collective: SIGNATURE columns
    past the gradients hold, in every row, the bytes of a checksum of the
    bucket's parameters and their squares; summed over the ranks, (sum)^2
    equals world x (sum of squares) for every byte only where every rank's
    was the same (a model whose modules differ by rank, as DDP refuses, would
    otherwise average one parameter's gradient into another's of the same
    size, silently). Every rank sees the same sums, so all raise alike. The
    sums are looked at once a backward (verify(), at its end, where the host
    waits for the device anyway), not at each collective."""

    SIGNATURE = 8  # four bytes of the checksum, and their squares

    def __init__(self, engine, elements):
        self.e = engine
        self.columns = max(1, elements // engine.world)  # each rank's share of a bucket
        self.buf = None  # world x columns (or one larger parameter's slice), zeros past `used`
        self.entries = {}  # id(shard) -> (shard, its first column), in the order added
        self.used = 0
        self.checks = []  # (what, names, the signature's sums), for verify()

    def add(self, s, grad):
        """Takes `s`'s full gradient; returns [(shard, its averaged slice)]
        of a bucket this filled (or of the one before it)."""
        comm = self.e._comm_device(s)
        done = []
        if self.entries and (self.used + s.slice_numel > self.columns
                             or self.buf.device != comm
                             or id(s) in self.entries):  # tied: returned twice
            done = self.flush()
        if self.buf is None:
            # Never more than the model's gradients: a DeepSpeed config's
            # reduce_bucket_size of 5e8 must not allocate 2 GB for a small one.
            model = sum(x.slice_numel for x in self.e.shards if x.in_optimizer)
            self.columns = max(1, min(self.columns, model))
        need = max(self.columns, s.slice_numel) + self.SIGNATURE
        if self.buf is None or self.buf.device != comm or self.buf.shape[1] < need:
            self.buf = torch.zeros(self.e.world, need, dtype=torch.float32, device=comm)
        flat = grad.detach().reshape(-1)
        region = self.buf[:, self.used:self.used + s.slice_numel]
        rows, rest = divmod(s.numel, s.slice_numel)
        if rows:
            region[:rows].copy_(flat[:rows * s.slice_numel].view(rows, s.slice_numel))
        if rest:
            region[rows, :rest].copy_(flat[rows * s.slice_numel:])
        self.entries[id(s)] = (s, self.used)
        self.used += s.slice_numel
        if self.used >= self.columns:
            done += self.flush()
        return done

    def flush(self):
        if not self.entries:
            return []
        e = self.e
        entries, used = list(self.entries.values()), self.used
        self.entries, self.used = {}, 0
        checked = e.world <= 256  # (the sums exact in fp32: 256 x 256^2 = 2^24)
        cols = used + (self.SIGNATURE if checked else 0)
        if checked:
            # (By name: partition ids are each rank's own session's.)
            digits = [float(b) + 1 for b in _crc_bytes(
                f"{s.name}:{s.slice_numel}" for s, _ in entries)]
            # (fill_ with numbers: no host tensor copied in, which on a GPU
            # would make the host wait for it at every collective.)
            for i, v in enumerate(digits + [d * d for d in digits]):
                self.buf[:, used + i].fill_(v)
        src = self.buf[:, :cols]
        what = f"reduce-scatter of '{entries[0][0].name}'" + (
            f" and {len(entries) - 1} more gradient(s)" if len(entries) > 1 else "")
        try:
            if e.backend == "nccl":
                src = src.contiguous()
                mine = torch.empty(cols, dtype=torch.float32, device=src.device)
                if hasattr(dist, "reduce_scatter_tensor"):
                    e._collective(what, lambda: dist.reduce_scatter_tensor(
                        mine, src.view(-1), group=e.group))
                else:
                    e._collective(what, lambda: dist.reduce_scatter(
                        mine, list(src.unbind(0)), group=e.group))
            else:
                src = src.contiguous() if cols < self.buf.shape[1] else src.clone()
                e._collective(what, lambda: dist.all_reduce(src, group=e.group))
                mine = src[e.rank]
        finally:
            self.buf[:, :cols].zero_()
        e.counts["reduce_collectives"] += 1
        if checked:
            self.checks.append((what, [s.name for s, _ in entries[:4]] + (
                ["..."] if len(entries) > 4 else []), mine[used:cols].clone()))
        mine = mine[:used].div_(e.world)
        return [(s, mine[at:at + s.slice_numel]) for s, at in entries]

    def verify(self):
        """Raises if a collective since the last verify() found that the
        ranks added different parameters (see the class)."""
        checks, self.checks = self.checks, []
        if not checks:
            return
        sums = torch.stack([c[2] for c in checks]).double().tolist()  # (one wait for the device)
        world = self.e.world
        for (what, names, _), row in zip(checks, sums):
            if any(row[i] * row[i] != world * row[4 + i] for i in range(4)):
                raise offloadd.FailedPreconditionError(
                    f"the ranks' {what} differ: this rank's holds {', '.join(names)}, another's "
                    "other parameters. Every rank must run the same modules with gradients in "
                    "the same order in each backward (as DistributedDataParallel requires): a "
                    "module used on some ranks only, or control flow that differs by rank, mixes "
                    "one parameter's gradient into another's")

    def discard(self):
        if self.entries:
            self.buf[:, :self.used].zero_()
        self.entries, self.used = {}, 0
        self.checks = []


class _OffloadedParameter(torch.nn.Parameter):
    """The class a wrapped model's parameters take: their values live in
    offloadd and are here only while a forward (or backward) that uses them
    runs (with the GPU tier's resident units: from their module's first
    forward in an iteration until backward is over). Their shape, size and
    count answer as the whole parameter's at any time; a use of their
    values at any other time is refused in words, naming the parameter,
    instead of reading an empty tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_HANDLES and args and type(args[0]) is cls:
            # p.data and p.detach() of an absent parameter: an alias that
            # refuses its values by name (_AbsentValues); the empty (or, on
            # the GPU tier, stale) storage behind it was handed out silently
            # (an EMA, copy.deepcopy). torch's state_dict() detaches each
            # parameter before the hook that puts the gathered weights in
            # its place.
            s = getattr(args[0], "_offloadd_shard", None)
            if s is not None and not s.gathered:
                return _AbsentValues.of(s)
        return _refuse_absent(cls, lambda s: not s.gathered, func, types, args, kwargs)

    def __reduce_ex__(self, protocol):
        s = getattr(self, "_offloadd_shard", None)
        if s is not None and not s.gathered:
            raise _refusal(s, "pickling")
        return super().__reduce_ex__(protocol)


class _AbsentValues(torch.Tensor):
    """What p.data and p.detach() give of a parameter whose values are not
    here: a tensor of its whole shape whose values (and pickling) are
    refused by name, as the parameter's are; flags set on it (requires_grad_)
    are its own. It stays so once the parameter is gathered again: take
    p.data inside the forward for the values."""

    @staticmethod
    def of(s):
        t = torch.Tensor._make_subclass(_AbsentValues, torch.empty(0, dtype=s.dtype,
                                                                    device=s.device))
        t._offloadd_shard = s
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _VALUE_HANDLES and args and type(args[0]) is cls:
            return args[0]  # (its .data and .detach(): itself, refusing as it does)
        return _refuse_absent(cls, lambda s: True, func, types, args, kwargs or {})

    def __reduce_ex__(self, protocol):
        raise _refusal(self._offloadd_shard, "pickling")


def _refusal(s, what):
    return offloadd.FailedPreconditionError(
        f"parameter '{s.name}' was used ({what}) "
        "outside the forward of a module that owns it: offloadd holds its "
        "values between uses and gathers them for its module's forward and "
        "backward only. Use it inside such a forward, the module called as "
        "module(x) (module.forward(x) runs none of offloadd's hooks; a module "
        "that reads another's weights should own them, or call it), or read "
        "the weights with model.state_dict()")


def _moved(s, what):
    return offloadd.FailedPreconditionError(
        f"parameter '{s.name}' of a wrapped model was moved or cast ({what}: model.to(), "
        ".cpu(), .float(), .half() ...): offloadd holds the parameters, gathered where the "
        "model computes and in its working dtype; move or cast the model before wrap() "
        "(a move that changes nothing is served)")


# Module._apply is how model.to(), .cuda(), .half(), .type(), .share_memory()
# ... change every tensor of a module: on a wrapped model's modules it goes
# through their engine's guard_move (a parameter with its values here, as
# the GPU tier's resident ones are, had its data replaced silently).
# Module -> weakref to its engine (neither kept alive by this table).
_WRAPPED_MODULES = weakref.WeakKeyDictionary()
_torch_module_apply = torch.nn.Module._apply


def _module_apply(module, fn, *args, **kwargs):
    ref = _WRAPPED_MODULES.get(module)
    engine = ref() if ref is not None else None
    if engine is not None:
        if engine.closed:
            raise offloadd.FailedPreconditionError(_CLOSED)
        fn = engine.guard_move(module, fn)
    return _torch_module_apply(module, fn, *args, **kwargs)


torch.nn.Module._apply = _module_apply


def _refuse_absent(cls, absent, func, types, args, kwargs):
    """`func` on `args`, unless it reads the values of a `cls` argument
    whose shard is `absent`: its whole shape where asked (_WHOLE), else the
    refusal naming it; what needs no values (_METADATA) always runs."""
    if func not in _METADATA:
        for a in _tensor_args(args, kwargs):
            s = getattr(a, "_offloadd_shard", None) if type(a) is cls else None
            if s is not None and absent(s):
                shape = _WHOLE.get(func)
                if shape is not None:
                    return shape(s, *args[1:], **kwargs)
                if func in _MOVES:
                    raise _moved(s, getattr(func, "__name__", func))
                if func is torch.autograd.grad:
                    raise offloadd.FailedPreconditionError(
                        f"torch.autograd.grad of parameter '{s.name}' of a wrapped model: offloadd "
                        "takes the model's gradients itself, in backward (they go to the daemon, "
                        "not to .grad or to a caller); use loss.backward() (or "
                        "optimizer.backward(loss)); the gradient norm of each step is in "
                        "optimizer.last_step['grad_norm']")
                raise _refusal(s, getattr(func, "__name__", func))
    return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


def _tensor_args(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


# What may be asked of a parameter whose values are not here: what torch,
# autograd and offloadd.torch itself ask (the data and gradient slots,
# flags, hooks), never its values.
_METADATA = {
    torch.Tensor.data.__get__, torch.Tensor.data.__set__,
    torch.Tensor.grad.__get__, torch.Tensor.grad.__set__, torch.Tensor.grad.__delete__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.requires_grad.__set__,
    torch.Tensor.requires_grad_, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_quantized.__get__, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.register_hook,
    torch.Tensor.retain_grad, torch.Tensor._is_view, torch.Tensor.__hash__,
    torch._has_compatible_shallow_copy_type,  # (Module._apply's, of a move that changes nothing)
}
# What moves or casts a tensor (Module.to, .cpu(), .float(), ... after wrap).
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.float,
          torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double,
          torch.Tensor.share_memory_}
# What hands out a tensor of the parameter's values: of an absent one, an
# alias that refuses them (_AbsentValues, see __torch_function__).
_VALUE_HANDLES = {torch.Tensor.data.__get__, torch.Tensor.detach}
# The whole parameter's shape where its values are not here.
_WHOLE = {
    torch.Tensor.shape.__get__: lambda s, *_: s.shape,
    torch.Tensor.size: lambda s, dim=None: s.shape if dim is None else s.shape[dim],
    torch.Tensor.numel: lambda s: s.numel,
    torch.Tensor.nelement: lambda s: s.numel,
    torch.Tensor.dim: lambda s: len(s.shape),
    torch.Tensor.ndim.__get__: lambda s, *_: len(s.shape),
}


class _Engine:
    """The hooks and the daemon session behind one wrapped model."""

    def __reduce_ex__(self, protocol):
        raise offloadd.FailedPreconditionError(
            "a model wrapped by offloadd cannot be pickled or deep-copied whole (torch.save("
            "model), copy.deepcopy(model)): its parameters' values live in offloadd. Save "
            "model.state_dict() (the full weights) or optimizer.checkpoint(dir), and build a "
            "copy from a state_dict")

    def __init__(self, model, config, process_group):
        self.config = config
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.backend = dist.get_backend(process_group) if self.distributed else None
        self.working_dtype = config["working_dtype"]
        self.torch_working = _DTYPES[self.working_dtype]
        # Seconds on the trainer's thread: fetching parameters, returning
        # gradients (of it, with the GPU tier, waiting for the device to
        # finish backward: device_wait), stepping.
        self.timings = {"fetch": 0.0, "return": 0.0, "step": 0.0, "device_wait": 0.0}
        # "stats_sent": returns that carried the trainer's statistics (the
        # daemon takes them on a step's first return of a partition).
        self.counts = {"fetches": 0, "returns": 0, "stats_sent": 0, "steps": 0, "skipped": 0,
                       "room_waits": 0, "split_returns": 0, "reduce_collectives": 0,
                       "gather_collectives": 0}
        self._storage_to_shard = {}  # gathered storage's base address -> shard
        self._sweep_queued = False
        self._backwards = 0  # backwards ended (their sweeps), as an id of the one under way
        self._hook_error = None  # the last offloadd error a hook raised (_remembering)
        # (shard, this rank's averaged gradient slice, its statistics or None)
        # not yet returned
        self._returns = []
        self._return_bytes = 0
        # With several ranks, gradients averaged in buckets (one collective
        # for many parameters).
        self._reduce = (_ReduceBucket(self, config["reduce_bucket_elements"])
                        if self.world > 1 else None)
        # Each all-gather carries a signature of what this rank gathers
        # (_signature); on a GPU the comparison's outcome waits here, read
        # at backward's end (verify_gathers), not at each gather.
        self._signatures = {}
        self._gather_bad, self._gather_first, self._gather_count = None, None, 0
        # With one micro-batch per step, gradient buffers are handed over:
        # the daemon measures them and its step reads them in place (no fp32
        # accumulator written and read). A second return of a partition
        # before the step (tied weights, another backward pass) still works:
        # the fetch takes the buffer back into the accumulator.
        self._hand_over = config.get("gradient_accumulation_steps", 1) == 1
        # Who measures handed-over gradients (squared norm and non-finite
        # count, for clipping and the overflow check): "trainer", torch
        # where the gradient slice is, before its copy to the host (on a GPU
        # next to nothing, and the daemon then reads no buffer before its
        # update, which runs beside the next iteration); "daemon", the
        # daemon reads each buffer; "auto", the trainer on a CUDA device.
        self._gradient_stats = config["gradient_stats"]
        # Whether a forward or backward pass holds every partition from its
        # start to its end (one fetch and one release per pass instead of
        # one each per module): when the working parameters rest on the
        # host, where holding them costs no memory, and the step does not
        # overlap the next forward (a fetch of everything would wait for
        # the whole step).
        self._held_views = None  # partition id -> view, while a pass holds them all
        self.returned_since_step = False  # gradients went to the daemon since the last step
        self.restored = None  # the last SessionRestored raised (for backward's)

        self.client = offloadd.Client(config["address"])
        for name, value in config["node_tunables"].items():
            if isinstance(value, bool):  # (before int: True is one)
                value = "true" if value else "false"
            self.client.set_tunable(name, str(value))
        params_host = self.host_percent("params")
        self.hold_per_pass = params_host == 100 and not config["overlap_step"]
        # The step this job goes on from: 0 for a new one, a checkpoint's
        # with restore_from, and with resume "auto" the step the ranks'
        # automatic checkpoints share after offloadd died (see _resume).
        self.resumed_step = 0
        self.resumed_from = config["restore_from"]
        if config["resume"] == "auto" and not config["restore_from"]:
            self.session = _GuardedSession(self, self._resume())
        else:
            self.session = _GuardedSession(self, self._open_session(
                config["restore_from"], restore_steps=config["restore_steps"]))
        # A script that ends without optimizer.close() has finished its job
        # unless an exception ended it: its session closes as it exits (left
        # open, offloadd kept it, its memory held, for the reconnect lease),
        # and with resume "auto" its checkpoints go then (they would resume
        # a finished job), and stay otherwise.
        _UncaughtWatch.install()
        _OPEN_AT_EXIT.add(self)
        self.params_host = params_host
        # The node's host pool, which every rank's holds share: batches of
        # gradient returns stay well inside it (see _size_batches).
        try:
            self.pool_bytes = int(self.client.stats()["tiers"]["host"]["budget_bytes"])
        except (offloadd.Error, KeyError, TypeError):
            self.pool_bytes = 0
        self.tier = None  # _GpuTier, where the parameters are on a GPU (or gpu.device says)
        self._optimizer = None  # set by Optimizer
        # The parameters fetched are the newest (drained since the last
        # step, or no delayed update): unknown until asked (latest_weights).
        self._weights_current = False
        self.shards = []
        self.by_param = {}
        self._handles = []  # hooks, removed if wrap() fails
        self._originals = {}  # id(param) -> its data, until wrap() succeeds
        self._model = model
        self._forward_depth = 0
        # id(module) -> per call of its forward under way, the nodes that
        # made its inputs (or None) and the walks' count when it began
        # (_watch_backward); the nodes the walks of the forward under way
        # went through, each with the count at its last walk; the watches
        # alive.
        self._watching = {}
        self._walked = {}
        self._walks = 0
        self._watches = weakref.WeakSet()
        self.closed = False  # optimizer.close(): the values went with the session
        try:
            self._register(model)
            if self.resumed_step:
                self._drop_interrupted_gradients(self.session)
            self._size_batches()
            self._group_units(model)
            self.tier = _GpuTier.create(self, config["gpu"])
            if self.tier is not None:
                self.hold_per_pass = False  # the tier holds what it copies, while it copies
            self._install_hooks(model)
        except BaseException:
            self.abort()
            raise

    # How long a hold or step the node's pool has no room for is retried
    # (the other ranks' holds and steps give room back) before the job
    # fails, naming the pool it needs.
    ROOM_WAIT_SECONDS = 20.0

    @staticmethod
    def _release_quietly(session, ids):
        """Lets holds go while another error is on its way (that error is
        the one the caller sees)."""
        try:
            session.release(ids)
        except (offloadd.Error, SessionRestored):
            pass

    def _size_batches(self):
        """Gradient returns hold their partitions' parameters and gradients
        in the node's pool while they are written: a batch takes at most a
        quarter of the pool shared by every rank (it may be smaller than the
        default 32 MiB), and at least one partition."""
        if self.pool_bytes > 0:
            self.RETURN_BYTES = max(1, min(self.RETURN_BYTES, self.pool_bytes // (4 * self.world)))

    def _held_bytes(self, shards):
        """What holding `shards` for a gradient return takes from the pool
        (parameters in the working dtype, fp32 gradients)."""
        esize = torch.empty(0, dtype=self.torch_working).element_size()
        return sum(s.slice_numel * (esize + 4) for s in shards)

    def _room_error(self, what, cause):
        """The error of a hold or step that found no room for too long,
        with the least pool this job needs on one node (pool_need)."""
        need = self.pool_need()
        return offloadd.ResourceExhaustedError(
            f"rank {self.rank} of {self.world}: the node's host pool "
            f"({self.pool_bytes or 'unknown'} bytes) had no room for {what} for "
            f"{self.ROOM_WAIT_SECONDS:g} s while the other ranks and steps held theirs: this job "
            f"needs at least {need['least']} bytes of pool on one node ({need['homed']} homed on "
            f"the host by its {need['ranks']} rank(s) there, {need['homed_each']} each: "
            f"{need['per_param']:g} bytes a parameter as placed; and what passes through it: "
            f"{need['ranks']} rank(s) holding their largest module's parameters and gradients, "
            f"{need['largest']} bytes each, or one step's chunk of state, {need['step']} bytes), "
            f"plus what other jobs on the node hold: raise memory.host_budget_bytes, place more "
            f"on NVMe, lower placement.state_chunk_bytes, or run fewer ranks per node ({cause})")

    def pool_need(self):
        """The least pool this job needs on one node: what its ranks there
        keep homed on the host, per parameter of their slices (the working
        copy, twice with the delayed update; the fp32 gradient buffer; fp32
        master and two moments; an fp32 accumulator where gradients are not
        handed over), scaled by the shares placed on the host, plus the
        larger of what passes through the pool where anything is on NVMe:
        every rank holding its largest module's parameters and gradients,
        or one step pinning a chunk of the largest partition's state
        (master, moments and gradients in fp32, and the working copy). Ranks
        on the node: torch's LOCAL_WORLD_SIZE where the launcher sets it,
        else all of them."""
        esize = torch.empty(0, dtype=self.torch_working).element_size()
        try:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        except ValueError:
            ranks = self.world
        ranks = max(1, min(ranks, self.world))
        share = {}
        for kind in ("params", "grads", "optimizer_state"):
            try:
                share[kind] = self.host_percent(kind) / 100.0
            except (offloadd.Error, KeyError, ValueError):
                share[kind] = 1.0
        working = esize * (2 if self.config["delayed_update_after_steps"] is not None else 1)
        accumulator = 4 if (self.config["gradient_accumulation_steps"] > 1
                            or not self._hand_over) else 0
        per_param = (working * share["params"] + 4 * share["grads"]
                     + (12 + accumulator) * share["optimizer_state"])
        slices = getattr(self, "_planned_slices", None) or [s.slice_numel for s in self.shards]
        elements = sum(slices)
        homed_each = int(per_param * elements)
        largest = max((self._held_bytes(m) for m in self._modules_shards()), default=0)
        try:
            chunk = int(self.client.get_tunable("placement.state_chunk_bytes")["value"]) // 4
        except (offloadd.Error, KeyError, ValueError):
            chunk = 1 << 22
        step = max((min(n, chunk) for n in slices), default=0) * (16 + esize)
        if min(share.values()) >= 1.0:
            largest = step = 0  # all homed on the host: holds and steps pin nothing more
        return {"least": ranks * homed_each + max(ranks * largest, step), "ranks": ranks,
                "homed": ranks * homed_each, "homed_each": homed_each, "per_param": per_param,
                "largest": largest, "step": step}

    def _modules_shards(self):
        groups = {}
        for s in self.shards:
            groups.setdefault(id(s.module_shards), s.module_shards)
        return list(groups.values())

    # RESOURCE_EXHAUSTED of a bound that waiting does not lift (the daemon's
    # and the GPU tier's own words for them): the NVMe tier's size, the
    # session's arena, the mapping budget, the sessions a daemon or a user
    # may have; the GPU tier's budget, the device's memory.
    # Room the pool could not make because writing a block out to the NVMe
    # tier failed, in the daemon's words (swapper.cc, MakeRoomLocked). (Not
    # "NVMe tier full": a rewrite takes a new extent before it frees the old
    # one, and other sessions free theirs: waiting lifts it.)
    _DISK_FAILED = ("in the host pool: writing block",)
    _NOT_ROOM = ("cannot rest on NVMe", "on NVMe: the tier has room", "session arena full",
                 "memory-mapping budget", "server.max_sessions", "the GPU tier has no room",
                 "cudaErrorMemoryAllocation", "emulated device:", "calls in flight at offloadd")

    def with_room(self, what, call, relieve=None, half_done=False):
        """call(), retried with backoff while the node's pool has no room
        (RESOURCE_EXHAUSTED: another rank's holds or a step fill it and
        give it back); after ROOM_WAIT_SECONDS, an error naming the pool
        this job needs. Another bound reached (_NOT_ROOM) is raised at once
        as the daemon said it. relieve(), before each retry, lets go of
        what this rank itself holds and need not (gradients in flight)."""
        delay, deadline = 0.002, time.monotonic() + self.ROOM_WAIT_SECONDS
        while True:
            try:
                return call()
            except offloadd.ResourceExhaustedError as e:
                if any(m in str(e) for m in self._NOT_ROOM):
                    raise
                if any(m in str(e) for m in self._DISK_FAILED):
                    # The pool makes room by writing blocks out to the NVMe
                    # tier, and the tier refuses: waiting does not help.
                    raise offloadd.ResourceExhaustedError(
                        f"offloadd cannot make room in its pool for {what}: its NVMe tier "
                        "refuses writes (free space on its filesystem, or mend the disk; the "
                        f"blocks stay in host memory meanwhile): {e}") from e
                if time.monotonic() >= deadline:
                    raise self._room_error(what, e) from e
                self.counts["room_waits"] += 1
                if not half_done:  # (the call did nothing: a Ctrl-C held back goes now)
                    _Uninterrupted.handle_now()
                if relieve is not None:
                    relieve()
                # Jittered: ranks that collided (two steps each pinning
                # half of what fits) do not collide again in lockstep.
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(2 * delay, 0.25)

    def _open_session(self, restore_from, resume_lost=False, restore_steps=None):
        """This rank's session, placed and configured as zero_config says."""
        config = self.config
        placement = config["placement"]
        return self.client.open_session(
            f"{config['session_name']}/rank{self.rank}",
            params_host_percent=_percent("params", placement.get("params")),
            grads_host_percent=_percent("grads", placement.get("grads")),
            optimizer_state_host_percent=_percent("optimizer_state",
                                                  placement.get("optimizer_state")),
            delayed_update_after_steps=config["delayed_update_after_steps"],
            loss_scaling=config["loss_scaling"],
            restore_from=restore_from,
            share_weight=config["share_weight"],
            resume_lost=resume_lost,
            restore_steps=restore_steps,
            # A job that resumes by itself also after a rank (not offloadd)
            # failed: what its sessions checkpointed outlives an unfinished
            # close; optimizer.close() at the end of the job removes it.
            keep_for_resume=config["resume"] == "auto")

    def _close_at_exit(self):
        if self.closed:
            return
        # The session itself, not its guard: a program on its way out does
        # not wait for a successor of an offloadd that went away (the guard
        # waits up to RESTART_WAIT_SECONDS).
        session = self.session
        self.session = getattr(session, "raw", session)
        try:
            self.close(finished=not _UncaughtWatch.seen)
        except (offloadd.Error, SessionRestored):
            pass  # offloadd went away: what it kept stays
        finally:
            self.session = session

    def _resume(self):
        """zero_config resume "auto": this rank's session from what its
        session of the same name left when offloadd died, at the newest
        step every rank has (an automatic checkpoint keeps the one before
        it too, so that ranks one checkpoint apart meet). Nothing lost
        anywhere, or no step in common: a new session (step 0). Collective:
        every rank calls it in wrap()."""
        failed, mine = None, None
        try:
            looked = self._look_for_lost()
            mine = [int(s) for s in looked.restorable_steps]
            looked.close()  # before a step: what it restored stays for the final open
        except offloadd.Error as e:
            failed = e
        steps = [mine]
        if self.world > 1:
            # Every rank reaches the agreement, a failed one too (None), so
            # that no rank waits in it for one that gave up.
            steps = [None] * self.world
            self._collective("agreement on the step to resume from",
                             lambda: dist.all_gather_object(steps, mine, group=self.group))
        if failed is not None:
            raise failed
        if any(s is None for s in steps):
            raise offloadd.UnavailableError(
                f"rank {self.rank} of {self.world}: another rank could not look for its "
                "automatic checkpoints; restart the job")
        common = set.intersection(*(set(s) | {0} for s in steps))
        target = max(common)
        if mine and target == 0:
            warnings.warn(f"offloadd.torch: rank {self.rank} had automatic checkpoints of steps "
                          f"{mine}, but another rank has none of them: the job starts anew")
        # The final choice: the newest checkpoint of that step is restored
        # and the rank's other lost ones go (0: all go, a new session).
        session = self._open_session("", resume_lost=True, restore_steps=target)
        self.resumed_step, self.resumed_from = target, session.restored_from
        self._resumed_from = session.restored_from or None
        return session

    # How long wrap() waits for the sessions of its name that went
    # unfinished to finish writing their last step (offloadd writes them one
    # after another).
    LOST_WAIT_SECONDS = 1800.0

    def _look_for_lost(self):
        """A session opened to find what this rank's session of the same
        name left (resume_lost); retried while offloadd says a session of
        the name is still writing its last step."""
        deadline = time.monotonic() + self.LOST_WAIT_SECONDS
        while True:
            try:
                return self._open_session("", resume_lost=True)
            except offloadd.UnavailableError as e:
                if "still writing its last step" not in str(e) or time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)

    def _register_slice(self, session, s):
        """Registers this rank's slice of `s`'s parameter in `session`
        (held), as a slice of the tensor named by the parameter, so that a
        checkpoint comes back with another number of ranks. Waits for room
        in the node's pool as holds do (a registration that finds none is
        undone whole)."""
        return self.with_room(f"registering '{s.name}'", lambda: session.register(
            s.name, s.slice_numel, param_dtype=self.working_dtype, grad_dtype="fp32",
            fp32_master=self.working_dtype != "fp32", tensor=s.name, shape=list(s.shape) or [1],
            offset=self.rank * s.slice_numel))

    def resume_kept(self, cause):
        """offloadd stopped and came back keeping this session (its
        reconnect lease): the session taken back (ResumeSession), as it
        was at the stop, then SessionRestored with its step, for the loop
        to redo the iteration the stop interrupted. One rank, as
        resume_after_crash."""
        old = self.session._session
        if self.world > 1:
            raise offloadd.FailedPreconditionError(
                f"{cause}; offloadd.torch takes a kept session back by itself only with one "
                "rank") from cause
        session = self.client.resume_session(old.id, old.token)
        views = session.fetch([s.pid for s in self.shards])
        steps = {v.step for v in views}
        session.release([s.pid for s in self.shards])
        self._reset_after_restart(session)
        self.restored = SessionRestored(max(steps) if steps else 0,
                                        "the session offloadd kept across its stop")
        raise self.restored from cause

    @staticmethod
    def _drop_interrupted_gradients(session):
        """The loop redoes the iteration it was in, from the step it goes
        on from: gradients that iteration returned before offloadd went (kept
        with the session, or in an automatic checkpoint taken after an
        overlapped step) go, else they would count twice."""
        if session.pending_gradients()["partitions"]:
            session.step(skip=True)

    def _reset_after_restart(self, session):
        """What the previous daemon's session held or was returning is gone
        with it: this engine goes on with `session`."""
        self._drop_interrupted_gradients(session)
        # Read before anything here changes (a call that fails leaves the
        # engine as it was): the restored session's scale, its checkpoint's,
        # which the daemon unscales the gradients by.
        scale = (session.pending_gradients()["loss_scale"]
                 if self.config["loss_scaling"] is not None else None)
        self._held_views = None
        self._returns, self._return_bytes = [], 0
        self.returned_since_step = False
        for s in self.shards:
            s.grad_since_step = False  # (zero slices returned went with it: again at the step)
        self.free_all()
        self.session = _GuardedSession(self, session)
        self._weights_current = False  # (a restored session may hold a newer copy)
        opt = self._optimizer
        if opt is not None:
            opt._overlapped = False
            opt._clip_coef = None  # (the lost iteration's clip)
            # A DeepSpeed loop's accumulation window begins again: the
            # micro-batches returned before went with the daemon.
            opt._micro_steps = 0
            if scale is not None:
                opt._loss_scale = scale
        if self.tier is not None:
            # It copies from one session's arena (its mappings, its DMA
            # registration, its partitions): a new one for the new session;
            # what the old one held on the GPU is stale.
            try:
                self.tier.close()
            except offloadd.Error:
                pass  # what it held went with the old daemon
            self.tier = None
            self.tier = _GpuTier.create(self, self.config["gpu"])

    def resume_after_crash(self, cause):
        """offloadd died and came back: a new session restores this one's
        last automatic checkpoint, every parameter's partition registered
        again (its state restored); then SessionRestored. One rank only
        (several would have to agree on the step first); without a
        checkpoint to go on from, `cause`."""
        old = self.session._session
        # Its own last automatic checkpoint, or, if it crashed before one
        # committed, the one it went on from.
        directory = old.auto_checkpoint_dir
        if not _holds_checkpoint(directory):
            directory = getattr(self, "_resumed_from", None) or directory
        if self.world > 1:
            # Several ranks find the daemon gone at different calls, so an
            # agreement among them could meet another rank's collective: the
            # job restarts, and wrap() agrees (resume "auto").
            how = ("restart the job (torchrun --max-restarts does) and wrap() goes on from the "
                   "newest automatic checkpoint every rank has" if self.config["resume"] else
                   "restart the job with zero_config resume 'auto' (or this rank's "
                   f"restore_from {directory})")
            raise offloadd.NotFoundError(
                f"{cause}; with {self.world} ranks, offloadd.torch does not go on in this "
                f"process: {how}") from cause
        if not _holds_checkpoint(directory):
            raise offloadd.NotFoundError(
                f"{cause}; offloadd went away before this job's first automatic checkpoint was "
                "taken (offloadd's checkpoint.auto_interval_seconds and auto_every_steps say how "
                "often): there is nothing to go on from; start the job again") from cause
        try:
            session, pids, steps = self._restore_from_dir(directory, None)
        except offloadd.DataLossError as e:
            # Its latest checkpoint does not read back (a disk's corruption;
            # not a parameter the checkpoint lacks): the one kept before it,
            # if intact, is where to go on from. (The steps that read back:
            # the latest's first where its manifest did, and failed after.)
            readable = offloadd.checkpoint_steps(
                directory, f"{self.config['session_name']}/rank{self.rank}")
            if "holds no state of" in str(e):
                older = []  # (a parameter the checkpoint lacks: no corruption)
            elif ".manifest:" in str(e):
                older = readable  # (its manifest: only those that read back are listed)
            else:
                older = readable[1:]  # (its data: the latest's step is listed first)
            for step in older:
                try:
                    session, pids, steps = self._restore_from_dir(directory, step)
                except offloadd.DataLossError:
                    continue
                _log.warning("the latest automatic checkpoint in %s does not read back (%s): "
                             "going on from the one of step %d", directory, e, step)
                break
            else:
                raise offloadd.DataLossError(
                    f"{e}; this job cannot go on from it" +
                    (f" (nor from the one kept before it in {directory})" if older else "")
                ) from cause
        for s in self.shards:
            s.pid = pids[id(s)]
        self._reset_after_restart(session)
        self._resumed_from = directory
        # Partitions no step updated (frozen) count fewer.
        step = max(steps) if steps else 0
        self.restored = SessionRestored(step, f"its automatic checkpoint in {directory}")
        raise self.restored from cause

    def _restore_from_dir(self, directory, steps):
        """A session restoring `directory`'s checkpoint (of `steps`, or its
        latest) with every parameter registered: (session, pids, steps);
        a DataLossError closes what it opened."""
        session = self._open_session(directory, restore_steps=steps)
        try:
            pids, restored = self._register_restored(
                session, f"the automatic checkpoint in {directory}")
        except BaseException:
            session.close()
            raise
        return session, pids, restored

    def _register_restored(self, session, what):
        """Every parameter's partition registered in `session`, opened from
        a checkpoint (`what`), and released: ({id(shard): partition id},
        the steps restored). DATA_LOSS naming the first parameter the
        checkpoint holds no state of (the caller closes `session`)."""
        pids, steps = {}, set()
        for s in self.shards:
            part = self._register_slice(session, s)
            session.release([part.id])
            if not part.restored:
                raise offloadd.DataLossError(f"{what} holds no state of '{s.name}'")
            pids[id(s)] = part.id
            steps.add(part.step)
        return pids, steps

    def all_ranks_ok(self, ok, what):
        """Whether `ok` holds on every rank (a collective: every rank asks;
        one rank: `ok`)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0])
        self._collective(what, lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN,
                                                       group=self.group))
        return flag.item() == 1.0

    def on_rank0(self, write, what, agree=True):
        """`write()` on rank 0 (a file the job needs beside its checkpoint),
        its failure raised on every rank (with `agree`: a collective after
        it, every rank calls this), `what` naming it for the other ranks."""
        failure = None
        if self.rank == 0:
            try:
                write()
            except Exception as exc:  # (told to every rank below)
                failure = exc
        if agree and not self.all_ranks_ok(failure is None, f"agreement after {what}"):
            failure = failure or offloadd.UnavailableError(
                f"rank 0 could not write {what} (its error says why)")
        if failure is not None:
            raise failure

    def restore_checkpoint(self, directory, restore_steps=None):
        """This rank's session replaced by one restored from `directory`
        (Optimizer.checkpoint's: every rank's, any number of ranks), every
        parameter's partition registered again with its state; the old
        session closed once the new one holds everything. All or nothing on
        every rank: where any rank's restore fails, each closes its new
        session and goes on with the old (the ranks agree first). The pool
        holds both sessions' state meanwhile (wrap's restore_from needs only
        one). Returns the step restored. Every rank calls it."""
        self.check_open()
        directory = os.path.abspath(directory)
        opt = self._optimizer
        if opt is not None:
            opt.wait_overlapped()
        self.free_all()
        self.flush_gradients()
        session, failure = None, None
        pids, steps = {}, set()
        try:
            session = self._open_session(directory, restore_steps=restore_steps)
            pids, steps = self._register_restored(session, f"the checkpoint in {directory}")
        except Exception as e:  # (agreed on below; a KeyboardInterrupt ends the job)
            failure = e
        if not self.all_ranks_ok(failure is None, "agreement on the restored checkpoint"):
            failure = failure or offloadd.FailedPreconditionError(
                f"another rank could not restore {directory}: every rank goes on with the "
                "session it had")
        old, old_pids = self.session, {id(s): s.pid for s in self.shards}
        if failure is None:
            try:
                for s in self.shards:
                    s.pid = pids[id(s)]
                    s.has_grad = s.grad_since_step = False
                self._reset_after_restart(session)
            except Exception as e:
                failure = e
                for s in self.shards:
                    s.pid = old_pids[id(s)]
                self.session = old
        if failure is not None:
            if session is not None:
                try:
                    session.close(finished=False)
                except offloadd.Error:
                    pass
            raise failure
        self._resumed_from = self.resumed_from = directory
        self.resumed_step = max(steps) if steps else 0
        try:
            getattr(old, "raw", old).close(finished=True)
        except offloadd.Error:
            pass  # (gone with its offloadd: nothing of it is used any more)
        return self.resumed_step

    def host_percent(self, kind):
        """The share of this session's `kind` ("params", "grads",
        "optimizer_state") kept on the host: as placed in zero_config, else
        the node's default."""
        percent = _percent(kind, self.config["placement"].get(kind))
        if percent is None:
            percent = float(self.client.get_tunable(f"placement.{kind}_host_percent")["value"])
        return percent

    def commit(self):
        """wrap() succeeded: the parameters' own data goes, and a use of one
        while its values are not here is refused by name."""
        self._originals = {}
        for s in self.shards:
            if type(s.param) is torch.nn.Parameter:
                s.param._offloadd_shard = s
                s.guarded = True
                s.gathered = s.gathered
        me = weakref.ref(self)
        for m in self._model.modules():
            _WRAPPED_MODULES[m] = me

    def guard_move(self, module, fn):
        """What Module._apply applies to each of `module`'s tensors: `fn`,
        unless it would change a wrapped parameter (move, cast, a new memory
        format, new storage, shared memory), which is refused before
        anything changes: `fn` is tried first on small tensors of each
        parameter dtype and device (1-, 4- and 5-dimensional: the memory
        formats), and where it returns anything but the tensor it was given
        it changes something. A move that changes nothing leaves the
        parameters as they are, as torch does."""
        future = getattr(torch, "__future__", None)
        for flag in ("get_overwrite_module_params_on_conversion",
                     "get_swap_module_params_on_conversion"):
            if future is not None and getattr(future, flag, lambda: False)():
                raise offloadd.FailedPreconditionError(
                    f"torch.__future__.{flag[4:]} is set: a wrapped model's parameters would be "
                    "replaced by model.to() and the like even where nothing changes; unset it, "
                    "or move the model before wrap()")
        shards = {}
        for p in module.parameters():
            s = self.by_param.get(id(p))
            if s is not None:
                shards.setdefault(id(p), s)
        tried = set()
        for s in shards.values():
            if (s.dtype, s.device) in tried:
                continue
            tried.add((s.dtype, s.device))
            for shape in ((1,), (1, 2, 1, 2), (1, 2, 1, 1, 2)):
                probe = torch.empty(shape, dtype=s.dtype, device=s.device)
                out = fn(probe)
                if out is not probe or (out.device.type == "cpu" and out.is_shared()):
                    raise _moved(s, "Module._apply")

        def keep(t):
            s = shards.get(id(t))
            if s is None:
                return fn(t)
            if s.gathered and fn(t) is not t:  # (what the probes did not tell)
                raise _moved(s, "Module._apply")
            return t
        return keep

    def abort(self):
        """wrap() failed: the model is as it was, the session closed."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for s in self.shards:
            if id(s.param) in self._originals:
                s.param.data = self._originals[id(s.param)]
        self._originals = {}
        self._model.__dict__.pop("forward", None)
        try:
            # A job that resumes by itself did not finish: what its session
            # restored (and its automatic checkpoints) stays for the next try.
            self.session.close(finished=self.config["resume"] != "auto")
        except offloadd.Error:
            pass

    # --- registration -----------------------------------------------------

    def _my_slice(self, s, t):
        """This rank's slice of `t` (a whole tensor of `s`'s size, any dtype
        or device) in fp32 on the CPU, the last rank's padded with zeros."""
        flat = t.detach().reshape(-1)
        lo = min(self.rank * s.slice_numel, s.numel)
        hi = min(lo + s.slice_numel, s.numel)
        mine = torch.zeros(s.slice_numel, dtype=torch.float32)
        mine[: hi - lo] = flat[lo:hi]
        return mine

    def _write_initial(self, s, p, name, part, master):
        """The initial values of a registered (held) slice: rank 0's, as
        DDP starts."""
        full = p.detach().reshape(-1).to(torch.float32)
        if self.distributed:
            full = full.to(self._comm_device(s)).contiguous()
            self._collective(f"broadcast of '{name}'",
                             lambda: dist.broadcast(full, 0, group=self.group))
        mine = self._my_slice(s, full)
        torch.frombuffer(part.params, dtype=self.torch_working).copy_(mine)
        if master:
            torch.frombuffer(part.master_init, dtype=torch.float32).copy_(mine)

    def _register(self, model):
        for mname, m in model.named_modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                # (torch's AdamW refuses the sparse gradients it makes too.)
                raise offloadd.InvalidArgumentError(
                    f"{repr(mname) if mname else 'the model'} makes sparse gradients "
                    "(sparse=True), which offloadd's Adam, as "
                    "torch's AdamW, does not take: make it with sparse=False")
        # The whole model's slices, for pool_need while some are not
        # registered yet (a pool too small fails during registration).
        self._planned_slices = [max(1, -(-p.numel() // self.world))
                                for p in {id(p): p for p in model.parameters()}.values()]
        for name, p in model.named_parameters():
            if id(p) in self.by_param:
                continue
            if p.device.type == "meta":
                raise offloadd.InvalidArgumentError(
                    f"parameter '{name}' is on the meta device (it has no values): materialize "
                    "the model (load its weights, or to_empty() and initialize) before wrap()")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise offloadd.InvalidArgumentError(
                    f"parameter '{name}' is {p.dtype}; offloadd holds fp32, bf16 and fp16 "
                    "parameters (convert the model before wrap())")
            s = _Shard(name, p, self.world)
            master = self.working_dtype != "fp32"
            part = self._register_slice(self.session, s)
            if part.restored:
                self._restored_step = max(getattr(self, "_restored_step", 0), part.step)
            try:
                if not part.restored:
                    self._write_initial(s, p, name, part, master)
            except BaseException:
                self._release_quietly(self.session, [part.id])  # (that error is the one to see)
                raise
            # (With an fp32 master, the release makes the values written the
            # master weights: on NVMe, that takes room too.)
            self.with_room(f"releasing '{s.name}'", lambda: self.session.release([part.id]))
            s.pid = part.id
            self.shards.append(s)
            self.by_param[id(p)] = s
            # The gradient hook returns p's gradient; the hook of the node
            # that accumulates it frees the gathered values once it is in
            # (resident units stay until backward is over).
            # Also on frozen parameters, which may be unfrozen later.
            with torch.enable_grad():
                frozen = not p.requires_grad
                p.requires_grad_(True)
                try:
                    s.accumulate_node = p.expand_as(p).grad_fn.next_functions[0][0]
                    self._handles.append(
                        s.accumulate_node.register_hook(self._make_after_grad(s)))
                    self._handles.append(p.register_hook(self._make_grad_hook(s)))
                finally:
                    if frozen:
                        p.requires_grad_(False)
        for s in self.shards:
            self._originals[id(s.param)] = s.param.data
            self._free(s)

    # --- gathering and freeing --------------------------------------------

    def _comm_device(self, s):
        return s.device if self.backend == "nccl" else torch.device("cpu")

    # How gloo and NCCL say that a peer is gone or silent.
    _PEER_LOST = ("connection closed", "connection reset", "broken pipe", "timed out",
                  "timeout", "communicator was aborted", "socket closed", "unable to connect")

    def _collective(self, what, fn):
        try:
            return fn()
        except RuntimeError as e:
            if not any(k in str(e).lower() for k in self._PEER_LOST):
                raise
            raise PeerLostError(
                f"rank {self.rank} of {self.world}: the {what} with the other ranks failed; "
                "a peer trainer died or stopped answering, or the ranks ran different "
                "collectives (every rank must run each forward of the wrapped model, "
                "evaluations too, and call state_dict(), load_state_dict(), "
                f"save_checkpoint(), load_checkpoint() and save_16bit_model()): {e}") from e

    @staticmethod
    def _base(t):
        return t.data_ptr() - t.storage_offset() * t.element_size()

    def gather(self, shards):
        need = [s for s in shards if not s.gathered]
        if not need:
            return
        start = time.perf_counter()
        if self.tier is not None and self.tier.resident:
            self.tier.gather_resident(need)
            self.counts["fetches"] += len(need)
            self.timings["fetch"] += time.perf_counter() - start
            return
        if self.tier is not None:
            self.tier.gather(need)
            self.counts["fetches"] += len(need)
            self.timings["fetch"] += time.perf_counter() - start
            return
        held = self._held_views
        if held:
            locals_ = [torch.frombuffer(held[s.pid].params, dtype=self.torch_working)
                       for s in need]
        else:
            # Copied out and let go before any collective: a rank waiting
            # for the others then holds none of the node's pool, which they
            # may need to fetch their own slices.
            ids = [s.pid for s in need]
            views = self.with_room(
                f"the parameters of '{need[0].name}' and its module's ({self._held_bytes(need)} "
                "bytes)", lambda: self.session.fetch(ids))
            try:
                # (One rank: the copy to the parameter's device and dtype
                # below is the only one.)
                locals_ = [torch.frombuffer(v.params, dtype=self.torch_working)
                           for v in views]
                if self.world == 1:
                    locals_ = [loc.to(device=s.device, dtype=s.dtype, copy=True)
                               for s, loc in zip(need, locals_)]
                else:
                    locals_ = [loc.clone() for loc in locals_]
            finally:
                self.session.release(ids)
        if self.world == 1:
            fulls = [local if not held else local.to(device=s.device, dtype=s.dtype, copy=True)
                     for s, local in zip(need, locals_)]
        else:
            fulls = [full.to(device=s.device, dtype=s.dtype)
                     for s, full in zip(need, self.all_gather(need, locals_))]
        for s, full in zip(need, fulls):
            s.param.data = full[: s.numel].view(s.shape)
            s.gathered = True
            self._storage_to_shard[self._base(s.param.data)] = s
        self.counts["fetches"] += len(need)
        self.timings["fetch"] += time.perf_counter() - start

    def all_gather(self, ss, locals_):
        """Every rank's slices of `ss` (a unit's: gathered together) in one
        all-gather: each rank's slices side by side, then each parameter
        cut out of every rank's part, in the working dtype, on the device
        the collective runs on."""
        # gloo has no bf16: its bits travel as fp16 (a gather copies them
        # unchanged).
        wire = self.torch_working
        if self.backend != "nccl" and wire == torch.bfloat16:
            wire = torch.float16
        comm = self._comm_device(ss[0])
        sig = self._signature(ss, wire, comm)
        body = (torch.cat([loc.view(wire) for loc in locals_]) if len(locals_) > 1
                else locals_[0].view(wire)).to(comm)
        src = torch.cat([body, sig])
        flat = torch.empty(src.numel() * self.world, dtype=wire, device=comm)
        what = f"all-gather of '{ss[0].name}'" + (
            f" and {len(ss) - 1} more parameter(s) of its module" if len(ss) > 1 else "")
        self._collective(what, lambda: dist.all_gather(list(flat.chunk(self.world)), src,
                                                       group=self.group))
        self.counts["gather_collectives"] += 1
        parts = flat.view(self.world, src.numel())
        self._check_gathered(parts[:, -sig.numel():], sig, what)
        out, at = [], 0
        for s in ss:
            out.append(parts[:, at:at + s.slice_numel].reshape(-1).view(self.torch_working))
            at += s.slice_numel
        return out

    def _signature(self, ss, dtype, device):
        """What this rank gathers in one collective, as the 4 bytes of a
        CRC-32 of its parameters' names (_crc_bytes: an element each, exact
        in fp16, bf16 and fp32), of `dtype` on `device` (made once for each
        such set)."""
        # (By the shards, which stay: partition ids change with a restore.)
        key = (tuple(id(s) for s in ss), dtype, device)
        sig = self._signatures.get(key)
        if sig is None:
            sig = torch.tensor(_crc_bytes(s.name for s in ss), dtype=dtype).to(device)
            self._signatures[key] = sig
        return sig

    def _check_gathered(self, gathered, mine, what):
        """`gathered`: every rank's signature as one collective carried it
        (world x 4). Ranks that gathered different parameters (a
        forward, or state_dict(), on some ranks only: an evaluation or a
        save on rank 0) had each parameter's values mixed with another's:
        every rank sees it and raises. On the CPU at once; on a GPU at the
        next verify_gathers (backward's end, state_dict's), not waiting for
        the device here."""
        bad = (gathered != mine).any()
        if gathered.device.type == "cpu":
            if bool(bad):
                raise self._gathers_differ(f"the {what}")
            return
        # One flag on the device for every gather since the last check (no
        # wait for the device, no list growing through an evaluation loop).
        if self._gather_bad is None:
            self._gather_bad, self._gather_first = bad, what
        else:
            self._gather_bad = self._gather_bad | bad
        self._gather_count += 1

    def verify_gathers(self):
        bad, first, n = self._gather_bad, self._gather_first, self._gather_count
        self._gather_bad, self._gather_first, self._gather_count = None, None, 0
        if bad is not None and bool(bad):
            raise self._gathers_differ(
                f"one of the {n} all-gathers since the last check, the first the {first}")

    def _gathers_differ(self, where):
        return offloadd.FailedPreconditionError(
            f"rank {self.rank} of {self.world}: the ranks gathered different parameters in one "
            f"collective (this rank: {where}), and each parameter's values were mixed with "
            "another's. Every rank must run each forward of the wrapped model, evaluations too, "
            "and call state_dict() and load_state_dict() at the same point: a forward or a "
            "state_dict() on one rank only (an evaluation or a save on rank 0) is not possible, "
            "and every rank must run the same modules in the same order (routing that depends "
            "on each rank's data, a mixture of experts skipping an expert no token of this "
            "rank's chose, must call every expert, on an empty batch if need be)")

    def begin_pass(self):
        """Holds every partition for a forward or backward pass (see
        hold_per_pass); False if there is nothing to do."""
        if not self.hold_per_pass or self._held_views is not None or not self.shards:
            return False
        start = time.perf_counter()
        held = {}
        session = self.session
        try:
            for ids in self._id_chunks():
                held.update((v.id, v) for v in session.fetch(ids))
        except BaseException as exc:
            # Not after offloadd restarted: the holds went with it.
            if held and not isinstance(exc, SessionRestored):
                self._release_quietly(session, list(held))
            raise
        self._held_views = held
        self.timings["fetch"] += time.perf_counter() - start
        return True

    def end_pass(self):
        if self._held_views is None:
            return
        self._held_views = None
        start = time.perf_counter()
        for ids in self._id_chunks():
            self.session.release(ids)
        self.timings["fetch"] += time.perf_counter() - start

    # The most partitions one FetchParams or ReleasePartitions may name.
    MAX_IDS_PER_CALL = 4096

    def _id_chunks(self):
        ids = [s.pid for s in self.shards]
        n = self.MAX_IDS_PER_CALL
        return [ids[i:i + n] for i in range(0, len(ids), n)]

    def _free(self, s):
        if self.tier is not None and self.tier.resident:
            return  # stays gathered until the tier lets its unit go (free_all)
        # (On the GPU tier, freed on both sides or on neither, whatever a
        # Ctrl-C does; without it, nothing to hold a Ctrl-C for: a free a
        # parameter, twice an iteration, on the host's hot path.)
        with _Uninterrupted() if self.tier is not None else contextlib.nullcontext():
            if s.gathered:
                if self.tier is not None and not s.off_slab:
                    self.tier.freeing(s)  # (raises with nothing changed)
                self._storage_to_shard.pop(self._base(s.param.data), None)
            s.off_slab = False
            s.param.data = torch.empty(0, dtype=s.dtype, device=s.device)
            s.gathered = False

    def _shard_of(self, t):
        """The gathered parameter `t` is (a view of), or None."""
        s = self._storage_to_shard.get(self._base(t))
        if s is None and self.tier is not None:
            s = self.tier.shard_at(t)
        return s

    def free_all(self):
        if self.tier is not None and self.tier.resident:
            self.tier.release_all()
            return
        with _Uninterrupted():
            for s in self.shards:
                if s.gathered:
                    self._free(s)
            if self.tier is not None:
                self.tier.release_unmarked()

    def delayed_update_on(self):
        """Whether the session's delayed update is on now, as the daemon
        says: it switches itself on after delayed_update_after_steps, and a
        session restored from a checkpoint has the checkpoint's (with its
        newer working copy), before any step of this process."""
        return bool(self.session.pending_gradients()["delayed_update"])

    def latest_weights(self):
        """With the delayed update on, the parameters fetched are one step
        older than the last step's: makes the newest current (the daemon
        drains the update: off, then on again), after an overlapped step
        ends. The next iteration then reads the newest weights (one step
        less stale, once). Nothing to do otherwise (the delayed update off,
        or drained since the last step)."""
        if self._weights_current:
            return
        if not self.delayed_update_on():
            self._weights_current = True
            return
        opt = self._optimizer
        if opt is not None:
            opt.wait_overlapped()
        pending = self._resident_gathered()
        self.free_all()
        if self.tier is not None:
            # Ends its iteration (an evaluation's forward holds every
            # partition): copies done, holds let go.
            self.tier.flush_gradients()
        self.session.set_delayed_update(False)
        self.session.set_delayed_update(True)
        self._weights_current = True
        if self.tier is not None:
            self.tier.invalidate()
            self._regather(pending)

    def master_weights(self, s):
        """Shard `s`'s fp32 master weights, whole, on the CPU (a collective
        with several ranks: each daemon holds a slice). The newest: a step
        of them still running ends first."""
        opt = self._optimizer
        if opt is not None:
            opt.wait_overlapped()  # (its failure surfaces here, not later)
        return self.read_state(s, master=True)[1][0]

    def read_state(self, s, master=False):
        """(step, [exp_avg, exp_avg_sq] or [master, exp_avg, exp_avg_sq])
        of shard `s`, whole (gathered from every rank), fp32 on the CPU."""
        got = self.session.read_moments(s.pid, 0, s.slice_numel, master=master)
        step, arrays = got[0], got[1:]
        if master:
            arrays = (arrays[2], arrays[0], arrays[1])
        k = len(arrays)
        mine = torch.frombuffer(bytearray(b"".join(arrays)), dtype=torch.float32)
        if self.world > 1:
            comm = self._comm_device(s)
            sig = self._signature([s], torch.float32, comm)
            mine = torch.cat([mine.to(comm), sig])
            flat = torch.empty(mine.numel() * self.world, dtype=torch.float32, device=comm)
            what = f"all-gather of the optimizer state of '{s.name}'"
            self._collective(what, lambda: dist.all_gather(list(flat.chunk(self.world)), mine,
                                                           group=self.group))
            rows = flat.view(self.world, -1)
            self._check_gathered(rows[:, -sig.numel():], sig, what)
            self.verify_gathers()
            parts = rows[:, :-sig.numel()].reshape(self.world, k, s.slice_numel)
        else:
            parts = mine.view(1, k, s.slice_numel)
        # On the CPU (a model offloaded for want of GPU memory has no room
        # for more bytes a parameter there); torch's load_state_dict moves
        # values to each parameter's device itself.
        return step, [parts[:, i].reshape(-1)[: s.numel].view(s.shape).to("cpu", copy=True)
                      for i in range(k)]

    def _resident_gathered(self):
        """Resident units: the parameters gathered now, whose views a
        pending backward may have saved (see _regather)."""
        if self.tier is None or not self.tier.resident:
            return []
        return [s for s in self.shards if s.gathered]

    def _regather(self, shards):
        """After the tier invalidated its copies: `shards` (gathered
        before) gathered again, their new values copied into their places
        before anything later reads them, as a backward without the tier
        would gather them again."""
        if shards:
            self.gather(shards)

    # --- gradients ---------------------------------------------------------

    # The hooks on autograd's nodes reach the engine and the shard through
    # weak references: a node (C++) holds its hooks out of the garbage
    # collector's sight, and a strong one made engine -> shard -> node ->
    # hook -> engine a cycle it could never free (a model dropped without
    # optimizer.close() kept its session until the process ended).
    def _make_grad_hook(self, s):
        engine_ref, shard_ref = weakref.ref(self), weakref.ref(s)

        def hook(grad):
            self, s = engine_ref(), shard_ref()
            if self is None or s is None:
                return grad
            with self._remembering():
                return self._grad_hook(s, grad)
        return hook

    @contextlib.contextmanager
    def _remembering(self):
        """An offloadd error raised in one of autograd's hooks, kept: autograd
        hands it on as a RuntimeError, and optimizer.backward raises it again
        as it was."""
        try:
            yield
        except (offloadd.Error, SessionRestored) as exc:
            self._hook_error = exc
            raise

    def _grad_hook(self, s, grad):
        if s.in_optimizer:
            s.has_grad = s.grad_since_step = True
        tier = self.tier
        if tier is not None and tier.resident:
            if s.in_optimizer:
                tier.queue_gradient(s, grad)
            return grad
        if s.in_optimizer:
            self._return_gradient(s, grad)
        if not s.gathered:
            # Backward did not need p's values (a Linear whose input needs no
            # gradient saves no weight), so p is empty; the accumulation lays
            # .grad out like p: give p its shape, with no memory, until the
            # hook after it empties p again.
            s.param.data = torch.empty([1] * len(s.shape), dtype=s.dtype,
                                       device=s.device).expand(s.shape)
        return grad

    def _make_after_grad(self, s):
        engine_ref, shard_ref = weakref.ref(self), weakref.ref(s)

        def hook(*_):
            self, s = engine_ref(), shard_ref()
            if self is None or s is None:
                return
            s.param.grad = None  # returned already (or its copy queued): the daemon has it
            s.accumulated_in = self._backwards
            with self._remembering():
                self._free(s)
        return hook

    def _return_gradient(self, s, grad):
        start = time.perf_counter()
        if self._reduce is not None:
            for r, mine in self._reduce.add(s, grad):
                self._deliver(r, mine)
        else:
            self._deliver(s, grad.detach().reshape(-1))
        self.timings["return"] += time.perf_counter() - start
        self._queue_sweep()

    def _drain_bucket(self):
        """Averages and hands on the gradients still in the bucket (every
        rank calls it at the same point: backward's end, a step)."""
        if self._reduce is not None:
            for r, mine in self._reduce.flush():
                self._deliver(r, mine)

    def _deliver(self, s, mine):
        """`s`'s gradient for the daemon: this rank's averaged slice (several
        ranks) or the whole flat gradient (one)."""
        if self.tier is not None:
            self.tier.return_gradient(s, mine)
            return
        stats = None
        if self._hand_over and (self._gradient_stats == "trainer" or (
                self._gradient_stats == "auto" and mine.device.type == "cuda")):
            # Of what the buffer will hold (its tail past the slice is
            # zeros), where the slice is, with no copy of it: the norm in
            # fp32 (scaled, so it does not overflow), squared in double.
            v = mine[:s.slice_numel]
            stats = (torch.linalg.vector_norm(v, dtype=torch.float32),
                     torch.isfinite(v).logical_not_().sum())
        # (Several ranks: a copy of its slice of the bucket's result, which
        # is not kept alive for it.)
        mine = mine.to("cpu", copy=True) if self.world > 1 else mine.to(torch.float32)
        # Returned in batches: one fetch, one return-and-release per batch.
        if any(r[0] is s for r in self._returns):
            self._flush_returns()
        self._returns.append((s, mine, stats))
        self._return_bytes += self._held_bytes([s])  # as the pool counts the hold
        if len(self._returns) >= self.RETURN_BATCH or self._return_bytes >= self.RETURN_BYTES:
            self._flush_returns()

    # Gradients held back for one batched return: at most this many
    # partitions or bytes (and all of them when backward ends).
    RETURN_BATCH = 64
    RETURN_BYTES = 32 << 20

    def flush_gradients(self):
        """Hands every gradient of this backward to the daemon (every rank
        calls it at the same point: backward's end, a step)."""
        start = time.perf_counter()
        self._drain_bucket()
        self.timings["return"] += time.perf_counter() - start
        if self.tier is not None:
            start = time.perf_counter()
            self.tier.flush_gradients()
            self.timings["return"] += time.perf_counter() - start
        else:
            self._flush_returns()
        if self._reduce is not None:
            self._reduce.verify()  # (before any step can take them)
        self.verify_gathers()

    def _flush_returns(self):
        if not self._returns:
            return
        start = time.perf_counter()
        batch, self._returns, self._return_bytes = self._returns, [], 0
        self._return_batch(batch)
        self.timings["return"] += time.perf_counter() - start

    def _return_batch(self, batch):
        """Returns `batch` in one call, or, where the node's pool has no
        room to hold it all, in halves (and later batches no larger), down
        to one partition, which waits for room (with_room)."""
        ids = [s.pid for s, _, _ in batch]
        stats = None
        if all(r[2] is not None for r in batch):
            stats = [(float(norm) ** 2, int(bad)) for _, _, (norm, bad) in batch]
        shards = [s for s, _, _ in batch]
        session = self.session
        # (The buffers held are returned or let go, and a return is known to
        # zero_grad, whatever a Ctrl-C does meanwhile.)
        with _Uninterrupted():
            if len(batch) > 1 and self._held_views is None:
                try:
                    views = session.fetch(ids, grads=True)
                except offloadd.ResourceExhaustedError:
                    half = len(batch) // 2
                    self.RETURN_BATCH = max(1, min(self.RETURN_BATCH, half))
                    self.RETURN_BYTES = max(1, min(self.RETURN_BYTES,
                                                   self._held_bytes(shards) // 2))
                    self.counts["split_returns"] += 1
                    self._return_batch(batch[:half])
                    self._return_batch(batch[half:])
                    return
            else:
                views = self.with_room(
                    f"the gradient buffer of '{batch[0][0].name}' ({self._held_bytes(shards)} "
                    "bytes)", lambda: session.fetch(ids, grads=True))
            try:
                for (s, mine, _), v in zip(batch, views):
                    dst = torch.frombuffer(v.grads, dtype=torch.float32)
                    n = min(mine.numel(), s.slice_numel)
                    dst[:n].copy_(mine[:n])
                    dst[n:].zero_()
                # (Before: a return that stopped midway returned some.)
                self.returned_since_step = True
                # A pass holding everything lets go at its end.
                session.return_gradients(views, release=self._held_views is None,
                                         hand_over=self._hand_over, stats=stats)
            except BaseException as exc:
                if self._held_views is None and not isinstance(exc, SessionRestored):
                    self._release_quietly(session, ids)
                raise
        self.counts["returns"] += len(batch)
        if stats is not None:
            self.counts["stats_sent"] += len(batch)

    def _swept_at_backward_end(self):
        """Whether the end of the backward under way frees what is gathered
        (a sweep queued); False outside a backward."""
        if self._sweep_queued:
            return True
        try:
            self._queue_sweep()
        except RuntimeError:  # (no backward under way: no callback to queue)
            self._sweep_queued = False
            return False
        return True

    def _queue_sweep(self):
        # Frees what backward gathered but did not free (frozen parameters,
        # saved values never used) when this backward pass ends.
        if self._sweep_queued:
            return
        self._sweep_queued = True

        def sweep():
            self._sweep_queued = False
            self._backwards += 1
            # A watch some of whose nodes did not run in this backward (an
            # output the loss does not reach, autograd.grad of a part)
            # starts the next backward of its graph afresh.
            for watch in list(self._watches):
                watch.left = watch.inputs
            with self._remembering():
                self.free_all()
                self.flush_gradients()
                self.end_pass()
        torch.autograd.Variable._execution_engine.queue_callback(sweep)

    # --- hooks ---------------------------------------------------------------

    # Modules whose forward reads their submodules' parameters without
    # calling those submodules (nn.MultiheadAttention reads out_proj.weight):
    # each is one unit with everything below it.
    _SUBTREE_UNITS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                      torch.nn.TransformerDecoderLayer)

    # Containers of parameters with no forward of their own: what they hold
    # is their parent's to read (a module's forward iterating its
    # ParameterList), in its unit.
    _CONTAINERS = (torch.nn.ParameterList, torch.nn.ParameterDict)

    def _group_units(self, model):
        """The units, as (module, its shards): a module's own parameters
        (with those of its _CONTAINERS), or a _SUBTREE_UNITS module's and
        all below it. Gathered together before the module runs and freed
        after; in backward, a saved parameter brings its unit back
        (module_shards)."""
        units, inside = [], set()
        for module in model.modules():  # parents before children
            if id(module) in inside:
                continue
            subtree = isinstance(module, self._SUBTREE_UNITS)
            if subtree:
                inside.update(id(m) for m in module.modules())
            holders = [module]
            for m in holders:  # (grows: containers in containers)
                for c in m.children():
                    if isinstance(c, self._CONTAINERS) and id(c) not in inside:
                        inside.add(id(c))
                        holders.append(c)
            params = (module.parameters(recurse=True) if subtree else
                      (p for m in holders for p in m.parameters(recurse=False)))
            own, seen = [], set()
            for p in params:
                if id(p) in self.by_param and id(p) not in seen:
                    seen.add(id(p))
                    own.append(self.by_param[id(p)])
            if not own:
                continue
            for s in own:
                s.module_shards = own
            units.append((module, own))
        self._units = units

    def _install_hooks(self, model):
        for module, own in self._units:
            handle = module.register_forward_pre_hook(
                lambda m, inputs, own=own: self._before_forward(own, inputs, m))
            # First of the module's pre-hooks: those registered before wrap
            # read the parameters too (weight_norm and spectral_norm compute
            # the weight from them there).
            module._forward_pre_hooks.move_to_end(handle.id, last=False)
            self._handles.append(handle)
            self._handles.append(module.register_forward_hook(
                lambda m, inputs, out, own=own: self._after_forward(own, m, out)))

        engine = self

        def pack(t):
            if t.layout != torch.strided or not t.numel():
                return t
            s = engine._shard_of(t)
            if s is None or not s.gathered or t.dtype != s.dtype or t.device != s.device:
                return t
            # A gathered parameter (or a view of one): keep only how to make
            # it again, so that freeing the parameter frees its memory. Its
            # offset counts from the parameter's start (gathered again, it
            # may sit elsewhere in the GPU tier's memory).
            return (_SavedParam, s, t.size(), t.stride(),
                    t.storage_offset() - s.param.data.storage_offset())

        def unpack(packed):
            if not (isinstance(packed, tuple) and packed and packed[0] is _SavedParam):
                return packed
            _, s, size, stride, offset = packed
            if not s.gathered:
                with engine._remembering():
                    engine.begin_pass()
                    engine._queue_sweep()
                    # One fetch for the module's parameters, but not those
                    # whose gradients this backward accumulated already:
                    # nothing in it reads them again (a node that saved one
                    # gives it a gradient, before its accumulation), and
                    # gathered again their unit stayed in use to backward's
                    # end, beside the next modules' (an nn.Transformer's
                    # decoder layer: its cross-attention's gradient to the
                    # encoder's output comes before its self-attention's).
                    current = engine._backwards
                    engine.gather([x for x in s.module_shards
                                   if x is s or x.accumulated_in != current])
            return s.param.data.as_strided(size, stride, s.param.data.storage_offset() + offset)

        forward = model.forward

        def after_a_pass_that_raised(module, inputs):
            # The model's first pre-hook (before its own parameters' gather),
            # at a forward's start: what a pass that raised left behind. A
            # backward that raised never reached its end (torch runs no
            # queued callback then): its end now, the gradients it returned
            # kept for the step, as torch keeps them in .grad (the GPU tier's
            # were left queued, and every later backward failed on them). A
            # forward that raised left the parameters of the modules it was
            # in gathered (on the GPU tier, their units in use: room the next
            # forward needs): they go.
            if engine._forward_depth != 0 or engine.closed:
                return
            if engine._sweep_queued:
                engine._sweep_queued = False
                engine.free_all()
                engine.flush_gradients()
                engine.end_pass()
            for s in engine.shards:
                if s.refs:
                    if s.gathered:
                        engine._free(s)
                    s.refs = 0
                    s.snapshot = None

        handle = model.register_forward_pre_hook(after_a_pass_that_raised)
        model._forward_pre_hooks.move_to_end(handle.id, last=False)
        self._handles.append(handle)

        def forward_with_saved_params(*args, **kwargs):
            engine.check_open()
            if engine._forward_depth == 0 and engine.tier is not None:
                engine.tier.begin_iteration()
            engine._forward_depth += 1
            began = engine.begin_pass()
            try:
                if engine.tier is not None and engine.tier.resident:
                    # Parameters stay where they are until backward is
                    # over: saved as they are.
                    return forward(*args, **kwargs)
                with saved_tensors_hooks(pack, unpack):
                    return forward(*args, **kwargs)
            finally:
                engine._forward_depth -= 1
                if engine._forward_depth == 0:
                    # (What the walks held, and a raised forward's watches
                    # to be, go with the forward: they hold its nodes.)
                    engine._watching.clear()
                    engine._walked.clear()
                if began:
                    engine.end_pass()

        model.forward = forward_with_saved_params

        def full_state(module, state, prefix, local_metadata):
            # Gathers every parameter in a fixed order (a collective: every
            # rank calls state_dict()), the newest weights, each copied to
            # the CPU as it is gathered: a model offloaded for want of GPU
            # memory has no room for a second whole copy of itself there
            # (torch's load_state_dict moves values to each parameter's
            # device itself).
            self.check_open()
            keys = self._keys(module, prefix)
            if self.config["state_dict"] == "master":
                for key in sorted(keys):
                    if key in state:
                        state[key] = self.master_weights(keys[key])
                return state
            self.latest_weights()
            for key in sorted(keys):
                if key not in state:
                    continue
                s = keys[key]
                was = s.gathered
                self.gather([s])
                state[key] = s.param.data.detach().to("cpu", copy=True)
                if not was:
                    self._free(s)
            self.verify_gathers()
            return state

        self._handles.append(model._register_state_dict_hook(full_state))

        # model.load_state_dict(): torch copies the loaded tensors into the
        # parameters, whole ones: every parameter is gathered first, and
        # written back to the daemon afterwards as its master weights.
        def gather_for_load(state_dict, prefix, local_metadata, *_):
            self.check_open()
            # assign=True (torch 2.1+), or torch's swapping of parameters on
            # conversion: the module would hold the loaded tensors in place
            # of its parameters, which offloadd does not hold (training then
            # updates nothing, silently).
            swap = getattr(getattr(torch, "__future__", None),
                           "get_swap_module_params_on_conversion", lambda: False)()
            if (local_metadata or {}).get("assign_to_params_buffers") or swap:
                raise offloadd.InvalidArgumentError(
                    "load_state_dict(assign=True) (or torch's parameter swapping) would replace "
                    "the model's parameters with tensors offloadd does not hold: load without "
                    "it (the values are copied into offloadd's master weights)")
            keys = self._keys(model, prefix)
            # Those torch refuses (a size mismatch: it raises after loading
            # the rest; a 1-element value for a 0-d parameter it takes).
            self._load_refused = {
                keys[k].pid for k, v in state_dict.items()
                if k in keys and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(
                    keys[k].shape) and not (len(keys[k].shape) == 0 and v.dim() == 1)}
            self._load_prefix = prefix
            self.gather_for_load()

        def write_loaded(module, incompatible_keys):
            # Only the parameters torch copied values into are written back
            # (their version counters moved; or found and not refused, for a
            # module's own _load_from_state_dict that writes through .data,
            # which moves none): the others (missing from a strict=False
            # load, refused) keep their masters exactly, not rounded through
            # the working copy.
            missing = set(incompatible_keys.missing_keys)
            self.write_loaded({s.pid for key, s in self._keys(model, self._load_prefix).items()
                               if key not in missing and s.pid not in self._load_refused})

        self._handles.append(model._register_load_state_dict_pre_hook(gather_for_load))
        self._handles.append(model.register_load_state_dict_post_hook(write_loaded))

    def _keys(self, module, prefix):
        """{state_dict key: shard} of the parameters under `module`
        (a tied one under each of its names)."""
        keys = {}
        for mname, m in module.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                if p is not None and id(p) in self.by_param:
                    keys[prefix + (mname + "." if mname else "") + pname] = self.by_param[id(p)]
        return keys

    def _load_chunks(self, shards):
        """`shards` in loads of at most MAX_IDS_PER_CALL partitions and
        (past one partition) RETURN_BYTES of the pool (their working copies
        and fp32 values held while written), as gradient returns are sized:
        a load with parameters on NVMe fits the pool a job needs to train."""
        chunks, chunk, held = [], [], 0
        for s in shards:
            b = self._held_bytes([s])
            if chunk and (len(chunk) >= self.MAX_IDS_PER_CALL or held + b > self.RETURN_BYTES):
                chunks.append(chunk)
                chunk, held = [], 0
            chunk.append(s)
            held += b
        if chunk:
            chunks.append(chunk)
        return chunks

    def gather_for_load(self, shards=None):
        """`shards` (None: every parameter) whole, for torch (or a
        GatheredParameters) to copy values into; a collective: every rank
        calls it with the same shards. With the GPU tier, outside its
        budget's slab (which need not hold the whole model): gathered as
        without the tier. Only these are written back (write_loaded)."""
        shards = self.shards if shards is None else shards
        self.latest_weights()
        self.flush_gradients()
        self._gathered_before_load = self._resident_gathered()
        self.free_all()
        with self._tier_bypassed():
            for s in shards:
                self.gather([s])
        self.verify_gathers()
        # Each parameter's version counter: torch's copy of a loaded value
        # into it moves it (see write_loaded).
        self._load_versions = {s.pid: s.param._version for s in shards}
        self._loading = True

    @contextlib.contextmanager
    def _tier_bypassed(self):
        tier, self.tier, session = self.tier, None, self.session
        try:
            yield
        finally:
            if tier is not None and self.session is not session:
                # offloadd restarted meanwhile (SessionRestored): the tier
                # belongs to the old session; a new one for the new.
                try:
                    tier.close()
                except offloadd.Error:
                    pass
                tier = _GpuTier.create(self, self.config["gpu"])
            self.tier = tier

    def write_loaded(self, found=()):
        """The parameters load_state_dict copied values into (their version
        counters moved, or partition ids in `found`) back to the daemon:
        each rank's slice becomes its partition's master weights (and
        working copy); moments and step counts stay, as torch's optimizer
        state does."""
        if not getattr(self, "_loading", False):
            return
        self._loading = False
        versions, self._load_versions = self._load_versions, {}
        shards = [s for s in self.shards if s.pid in versions and (
            s.pid in found or s.param._version != versions[s.pid])]
        delayed = self.delayed_update_on()
        if delayed:
            self.session.set_delayed_update(False)
        try:
            def write(s, v):
                mine = self._my_slice(s, s.param.data)
                if v.master_init is not None:  # fp32 kept exactly, the copy rounded
                    torch.frombuffer(v.master_init, dtype=torch.float32).copy_(mine)
                else:
                    torch.frombuffer(v.params, dtype=self.torch_working).copy_(mine)
            for chunk in self._load_chunks(shards):
                self._load_values(chunk, f"loading the values of '{chunk[0].name}' and "
                                  f"{len(chunk) - 1} more", write)
        finally:
            if delayed:
                self.session.set_delayed_update(True)
            with self._tier_bypassed():
                self.free_all()
            if self.tier is not None:
                self.tier.invalidate()  # what it kept on the GPU is the old values
                self._regather(getattr(self, "_gathered_before_load", []))
            self._gathered_before_load = []

    def check_open(self):
        if self.closed:
            raise offloadd.FailedPreconditionError(_CLOSED)

    def _before_forward(self, own, inputs=(), module=None):
        self.check_open()
        for s in own:
            s.refs += 1
        self.gather(own)
        for s in own:
            if s.refs == 1:
                s.version = s.param._version
                if s.changes_in_place:
                    s.snapshot = s.param.data.detach().clone()
        self._watching.setdefault(id(module), []).append((self._inputs_made_by(inputs), self._walks))

    def _inputs_made_by(self, inputs):
        """The autograd nodes that made a module's tensor inputs needing a
        gradient (in its positional arguments, or one level inside a tuple,
        list or dict there), for _watch_backward: on the GPU tier, units
        gathered per module (not resident), and for a forward run again in
        backward, with the tier or not; None where there is nothing to
        watch."""
        if not torch.is_grad_enabled() or (self.tier is not None and self.tier.resident):
            return None
        if self._forward_depth == 0:
            # A forward run again in backward (activation checkpointing's
            # recompute), on the GPU tier or not: its parameters are kept
            # past its forward (_after_forward) and go after its backward.
            # Its first module's inputs are leaves (the checkpoint's
            # detached inputs): their accumulate nodes made them.
            made = set()
            for t in _tensors_in(inputs):
                if not t.requires_grad:
                    continue
                if t.grad_fn is not None:
                    made.add(t.grad_fn)
                elif id(t) not in self.by_param:  # (not a parameter of ours passed in)
                    made.add(t.expand_as(t).grad_fn.next_functions[0][0])
            return made or None
        if self.tier is None:
            return None
        # (Not a leaf's: a parameter passed in, a user's input. None at all,
        # inputs that need no gradient (token ids): its own nodes' ends.)
        return {t.grad_fn for t in _tensors_in(inputs) if t.requires_grad and t.grad_fn is not None}

    # The most autograd nodes a module's forward is walked through.
    MAX_WATCHED_NODES = 4096

    def _watch_backward(self, own, made, began, outputs):
        """After a module's forward: its parameters go once its own backward
        is over, as DeepSpeed's ZeRO-3 releases a module's after its
        backward. Its nodes that read its inputs (`made`: the nodes that made
        them) are found by walking back from its outputs, and a hook after
        each counts them done (_BackwardWatch); the last lets the unit go.
        Else a unit gathered in backward stayed in use until its gradient
        was accumulated, which for a module run more than once, or a weight
        tied to one run first, is backward's end: units held at once past
        what nesting holds (what wrap() checks the budget against), and a
        use found no room mid-training. Nothing of the module's inputs or
        outputs changes (a node of ours around its inputs, as DeepSpeed
        puts there, made a module's in-place change of its input invisible
        to the caller's autograd: wrong gradients). For a module none of
        whose inputs needs a gradient (token ids, a parameter passed in;
        keyword arguments, which torch 1.13's hooks do not show), its nodes
        whose only next ones are its parameters' accumulators count instead.
        A module whose walk goes through more than MAX_WATCHED_NODES nodes,
        or some of whose nodes do not run in a backward (an output the loss
        does not reach), keeps its parameters until its gradient is in, as
        before. (A parameter read off the path from the inputs to the
        outputs is gathered again by the node that reads it, as any saved
        parameter.)"""
        found, seen, walked = [], set(), self._walked

        def before(node):
            # Walked by a module whose forward was over before this one's
            # began: the graph before this module, reached through a tensor
            # it read otherwise (a captured one), not walked again. (Its
            # children's nodes, walked since it began, are its own.)
            walk = walked.get(node)
            return walk is not None and walk <= began

        # No inputs that need a gradient (token ids into an embedding, the
        # same module called again by a decoder): its nodes whose only next
        # ones are its parameters' accumulators (or none) are its backward's
        # last. (Else such a module kept its unit from its first node in
        # backward to its gradient's accumulation, the whole stretch between
        # its two calls' backwards, beside every unit used meanwhile.)
        ends = not made
        stack = [t.grad_fn for t in _tensors_in((outputs,)) if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in seen or node in made or before(node) or _accumulates(node):
                continue
            seen.add(node)
            if len(seen) > self.MAX_WATCHED_NODES:
                break
            reads, last = False, True
            for after, _ in node.next_functions:
                if after is None:
                    continue
                if after in made:  # (a recompute's leaf input: its accumulator)
                    reads = True
                elif _accumulates(after):
                    continue
                elif after not in seen and not before(after):
                    stack.append(after)
                last = False
            if reads or (ends and last):
                found.append(node)
        self._walks += 1
        if self._forward_depth != 0:
            # (Not in a recompute in backward: the walks' record lasts until
            # the model's forward ends, and would keep its graph.)
            for node in seen:
                walked[node] = self._walks
        if not found or len(seen) > self.MAX_WATCHED_NODES:
            return
        watch = _BackwardWatch(weakref.ref(self), own, len(found))
        self._watches.add(watch)
        for node in found:
            node.register_hook(watch.arrived)

    def after_module_backward(self, own):
        """A module's backward is over (see _watch_backward): its
        parameters gathered for it go. A node that reads one of them later
        (a parameter used outside the path from the module's inputs to its
        output) gathers it again as any saved parameter is."""
        if self.closed or (self.tier is not None and self.tier.resident):
            return
        for s in own:
            # (Without the GPU tier, only what a recompute kept: off_slab.)
            if s.gathered and s.refs == 0 and (self.tier is not None or s.off_slab):
                self._free(s)

    def _after_forward(self, own, module=None, outputs=None):
        # A forward that changed its parameters in place (under no_grad:
        # nn.Embedding's max_norm renormalises the rows it looks up; a
        # constraint the module applies) changed the gathered copy, which
        # goes when the module is done: the changes are kept, as torch
        # keeps them.
        calls = self._watching.get(id(module))
        made, began = calls.pop() if calls else (None, 0)
        replaced = None
        try:
            changed = [s for s in own
                       if s.refs == 1 and s.gathered and s.param._version != s.version]
            if changed:
                self._keep_changes(changed)
            replaced = self._off_the_slab(outputs)
            if made is not None:
                self._watch_backward(own, made, began,
                                     outputs if replaced is None else replaced)
        finally:
            # A forward run again in backward (activation checkpointing's
            # recompute: outside the model's forward, with grad): autograd
            # may have saved a parameter itself (LayerNorm's, BatchNorm's
            # weight: a leaf is saved as it is, not as its values), and the
            # parameter's values emptied now were what that node's backward
            # found ("weight of shape [0]"). They stay, out of the GPU tier's
            # slab (a copy of their own, gather), until the gradient is in
            # (the accumulate node's hook) or backward ends (the sweep).
            recompute = self._forward_depth == 0 and torch.is_grad_enabled()
            for s in own:
                s.refs = max(0, s.refs - 1)
                if s.refs == 0:
                    s.snapshot = None
                    if (recompute and s.gathered
                            and not (self.tier is not None and self.tier.resident)
                            and self._swept_at_backward_end()):
                        self._keep_off_the_slab(s)
                    else:
                        self._free(s)
        return replaced

    def _keep_off_the_slab(self, s):
        """`s`, gathered by a forward run again in backward, stays past it
        (off_slab), its GPU tier unit let go: its values a copy of their own
        (the recompute's gather made one; a gather before it, by a backward's
        unpack, left a view of the slab, copied now, before the unit goes)."""
        if s.off_slab:
            return
        tier = self.tier
        if tier is not None:
            values = s.param.data
            copy = values.clone() if tier._in_slab(values.data_ptr()) else None
            tier.freeing(s)
            if copy is not None:
                s.param.data = copy
                self._storage_to_shard[self._base(copy)] = s
        s.off_slab = True

    def _off_the_slab(self, outputs):
        """The GPU tier, not resident: a module's output that is (a view of)
        gathered parameters in the slab (a positional embedding's forward
        returning `self.weight[:T]`), read after the module is done, would
        see whatever a later copy puts there: each such output (itself, or
        one level inside a tuple, list or dict) is a copy of its own. The
        outputs to return instead, or None where none is in the slab."""
        tier = self.tier
        if tier is None or tier.resident or not tier.at:
            return None

        def off(t):
            if isinstance(t, torch.Tensor) and t.numel() and tier._in_slab(t.data_ptr()):
                return t.clone()
            return t
        if isinstance(outputs, torch.Tensor):
            moved = off(outputs)
            return None if moved is outputs else moved
        if isinstance(outputs, (tuple, list)):
            moved = [off(t) for t in outputs]
            if all(a is b for a, b in zip(moved, outputs)):
                return None
            if isinstance(outputs, list):
                return moved
            if hasattr(outputs, "_fields"):
                return type(outputs)(*moved)
            try:
                return type(outputs)(moved)
            except TypeError:  # (a tuple type built otherwise)
                return tuple(moved)
        if isinstance(outputs, dict):
            changed = False
            for k, t in list(outputs.items()):
                moved = off(t)
                if moved is not t:
                    outputs[k] = moved
                    changed = True
            return outputs if changed else None
        return None

    def _keep_changes(self, shards):
        """`shards`, changed in place by their module's forward: the
        elements of this rank's slice of each that changed become its master
        weights (and working copy), as a load's values do; the others keep
        their fp32 masters exactly. Nothing is written where nothing changed
        (embedding_renorm_ moves the version counter at every call); what
        the forward read is its snapshot from the second time on, the first
        time the master read back (and rounded as the gather rounds it)."""
        writes, masters = {}, {}
        for s in shards:
            s.version = s.param._version  # (kept once, also if a later forward changes it again)
            mine = self._my_slice(s, s.param.data)
            if s.snapshot is not None:
                before = self._my_slice(s, s.snapshot)
            else:
                masters[s.pid] = self._read_master(s)
                before = masters[s.pid].to(self.torch_working).to(s.dtype).to(torch.float32)
            s.changes_in_place = True
            if bool((mine != before).any()):
                writes[s.pid] = mine
        if not writes:
            return
        def refuse(why):
            return offloadd.FailedPreconditionError(
                f"parameter '{next(s for s in shards if s.pid in writes).name}' was changed in "
                f"place by its module's forward (nn.Embedding's max_norm renormalises rows so): "
                f"{why}")
        if self.delayed_update_on():
            # The forward read the step before's weights: the changed ones,
            # written back, would undo the last step's update of them.
            raise refuse("with the delayed update the forward reads weights one step behind, "
                         "and the change cannot be kept; train this model without "
                         "delayed_update")
        if self.tier is not None:
            # Its copies on the GPU (and its holds) would have to follow.
            raise refuse("offloadd's GPU tier does not keep such changes; train this model "
                         "with zero_config {'gpu': {'tier': False}}")
        for chunk in self._load_chunks([s for s in shards if s.pid in writes]):
            # 16-bit working copies: the masters of their unchanged elements,
            # read before the fetch below makes them the trainer's.
            if self.working_dtype != "fp32":
                for s in chunk:
                    if s.pid not in masters:
                        masters[s.pid] = self._read_master(s)
            def write(s, v):
                mine = writes[s.pid]
                working = torch.frombuffer(v.params, dtype=self.torch_working)
                changed = mine != working.to(s.dtype).to(torch.float32)
                if v.master_init is not None:  # (a 16-bit working copy: rounded from it)
                    torch.frombuffer(v.master_init, dtype=torch.float32).copy_(
                        torch.where(changed, mine, masters[s.pid]))
                else:  # (fp32: the master weights themselves)
                    working.copy_(torch.where(changed, mine, working))
            self._load_values(chunk, f"keeping what the forward of '{chunk[0].name}' changed "
                              "in place", write)
            # (The release ends every hold of them: the pass's too, taken
            # again.)
            if self._held_views is not None:
                ids = [s.pid for s in chunk]
                self._held_views.update((v.id, v) for v in self.session.fetch(ids))

    def _load_values(self, chunk, what, write):
        """Fetches the partitions of `chunk` for a load, `write(shard, view)`
        for each, and releases them: what was written becomes their master
        weights (the release commits it; on an error, nothing is)."""
        ids = [s.pid for s in chunk]
        views = self.with_room(f"{what} ({self._held_bytes(chunk)} bytes)",
                               lambda: self.session.fetch(ids, load=True))
        try:
            for s, v in zip(chunk, views):
                write(s, v)
        except BaseException:
            self._release_quietly(self.session, ids)
            raise
        self.with_room(f"releasing the values ({what})", lambda: self.session.release(ids))

    def _read_master(self, s):
        """This rank's slice of `s`'s fp32 master weights (the daemon reads
        its moments with them: room in the pool where they rest on NVMe)."""
        got = self.with_room(f"reading the master weights of '{s.name}'",
                             lambda: self.session.read_moments(s.pid, 0, s.slice_numel,
                                                               master=True))
        return torch.frombuffer(bytearray(got[3]), dtype=torch.float32)

    def close(self, finished=True):
        """Closes the session. finished=False (a failure unwinding): with
        resume "auto", its automatic checkpoints stay for the restart."""
        self.closed = True
        self.free_all()
        self._returns = []
        self._held_views = None
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        self.session.close(finished=finished)

    def gpu_stats(self):
        """The GPU tier's counters (bytes each way, prefetch hits, waits,
        DMA registration), or None where it does not run."""
        return self.tier.stats() if self.tier is not None else None


def _crc_bytes(names):
    """The 4 bytes (ints 0-255) of a CRC-32 of `names` joined: what a
    collective carries to tell whether every rank added the same tensors."""
    crc = zlib.crc32("\0".join(names).encode())
    return [(crc >> (8 * i)) & 0xFF for i in range(4)]


def _replace_file(path, write):
    """`path` written whole by `write(file)` (a temporary beside it, then
    renamed over it: a crash leaves the old file or the new)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _check_group(group, what):
    """Refuses a param group asking for Adam variants offloadd's step does
    not compute (other keys, a group's name say, torch keeps and ignores)."""
    for k in ("amsgrad", "maximize"):
        if group.get(k):
            raise offloadd.InvalidArgumentError(
                f"{what}: {k}=True is not supported by offloadd's Adam")


def _call_method(obj, name, *args, **kwargs):
    return getattr(obj, name)(*args, **kwargs)


_CLOSED = ("this model's optimizer was closed: its parameters' values went with its offloadd "
           "session (save model.state_dict() before optimizer.close(), and load it into a fresh "
           "model to go on)")


# torch's Optimizer.zero_grad default (False before torch 2.0, True since).
_TORCH_SET_TO_NONE = inspect.signature(torch.optim.Optimizer.zero_grad).parameters[
    "set_to_none"].default

def _by_engine(params):
    """`params` by the open wrapped models that hold them: {engine: its
    shards of them, each once, in the order given} (engines in the order
    first named), and the tensors none holds, in order."""
    engines = [e for e in list(_OPEN_AT_EXIT) if not e.closed]
    held, rest, seen = {}, [], set()
    for p in params:
        e = next((e for e in engines if id(p) in e.by_param), None)
        if e is None:
            rest.append(p)
            continue
        s = e.by_param[id(p)]
        if id(s) not in seen:
            seen.add(id(s))
            held.setdefault(e, []).append(s)
    return held, rest


def _clip_norm_of(e, shards, what):
    """The squared 2-norm of the gradients returned to `e`'s daemon since
    the last step, and their non-finite elements (every rank's: a
    collective), unscaled as the step unscales them, for a clip of
    `shards`' gradients: they must be every gradient the step applies."""
    opt = e._optimizer
    if opt is None:
        raise offloadd.FailedPreconditionError(f"{what}: the wrapped model has no optimizer")
    given = {id(s) for s in shards}
    left = [s.name for s in e.shards if s.in_optimizer and s.grad_since_step and
            id(s) not in given]
    if left:
        raise offloadd.InvalidArgumentError(
            f"{what} of some of a wrapped model's parameters (not {left[:3]}"
            f"{' and more' if len(left) > 3 else ''}): offloadd measures the norm of every "
            "gradient its step applies; pass them all (model.parameters()), or set zero_config's "
            "gradient_clipping")
    e.flush_gradients()  # (backward's end did; a forward's returns in flight too)
    sq, bad, _, _, pending = opt._pending_everywhere(f"all-reduce of the gradient norm for {what}")
    if opt._clip_coef is not None and pending["micro_batches"] != opt._clip_micro_batches:
        raise offloadd.FailedPreconditionError(
            f"{what} again after another backward: offloadd clips the gradients the step "
            "applies, all of them, by the norm measured at the last call; call it once after "
            "the last micro-batch's backward, before step()")
    opt._clip_micro_batches = pending["micro_batches"]
    return sq, bad


_torch_clip_grad_norm = torch.nn.utils.clip_grad_norm_
_torch_clip_grad_value = torch.nn.utils.clip_grad_value_


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, **kwargs):
    """torch.nn.utils.clip_grad_norm_ (which importing offloadd.torch
    replaces with this), for the parameters of wrapped models too: their
    gradients are in offloadd, not in .grad (torch's clipped nothing and
    returned 0): the norm is measured there (every rank calls it, as with
    torch's) and returned, and the next step scales the gradients by
    torch's factor, min(1, max_norm / (norm + 1e-6)) (a second call's on
    top of the first's, as torch's sees clipped gradients; zero_grad
    forgets them). Called after the step's last backward (a backward after
    it is refused at step(): its gradients were not in the norm). Others'
    .grad are scaled here, the norm taken over all. A loop that bound
    torch's function to a name before importing offloadd.torch calls
    torch's (which clips nothing here).
    Only the 2-norm; the parameters given must hold every gradient the step
    applies. A non-finite norm skips the step (as an overflow) where torch
    would write NaN into the weights."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    mine, rest = _by_engine(parameters)
    if not mine:
        return _torch_clip_grad_norm(parameters, max_norm, norm_type, error_if_nonfinite,
                                     **kwargs)
    what = "clip_grad_norm_"
    if float(norm_type) != 2.0:
        raise offloadd.InvalidArgumentError(
            f"{what} of a wrapped model's parameters with norm_type {norm_type}: offloadd "
            "measures the 2-norm only")
    # offloadd's gradients as returned (a clip before this one is the next
    # step's, to come), others' as they are now.
    sq, bad = 0.0, 0.0
    for e, shards in mine.items():
        e_sq, e_bad = _clip_norm_of(e, shards, what)
        sq, bad = sq + e_sq, bad + e_bad
    before = min((e._optimizer._clip_coef for e in mine if e._optimizer._clip_coef is not None),
                 default=1.0)
    sq *= before * before
    grads = [p.grad.detach() for p in rest if p.grad is not None]
    if grads:
        sq += float(torch.stack([torch.norm(g, 2.0).to(torch.float64) for g in grads])
                    .pow(2).sum())
    seen = math.sqrt(sq) if bad == 0 and math.isfinite(sq) else math.nan
    if error_if_nonfinite and not math.isfinite(seen):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    # This one's factor on top of those before (torch's second call sees
    # clipped gradients).
    coef = min(1.0, float(max_norm) / (seen + 1e-6)) if math.isfinite(seen) else 1.0
    for e in mine:
        e._optimizer._clip_coef = before * coef
    for g in grads:
        g.mul_(coef)
    device = parameters[0].device if parameters else torch.device("cpu")
    return torch.tensor(seen, dtype=torch.float32, device=device)


def clip_grad_value_(parameters, clip_value, **kwargs):
    """torch.nn.utils.clip_grad_value_ (replaced by this on importing
    offloadd.torch): refused for a wrapped model's parameters, whose
    gradients are in offloadd (torch's clipped nothing, silently); others'
    as torch's."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    for p in parameters:
        if getattr(p, "_offloadd_shard", None) is not None:
            raise offloadd.InvalidArgumentError(
                "clip_grad_value_ of a wrapped model's parameters: their gradients are in "
                "offloadd, which clips by norm only (torch.nn.utils.clip_grad_norm_, or "
                "zero_config's gradient_clipping)")
    return _torch_clip_grad_value(parameters, clip_value, **kwargs)


torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
torch.nn.utils.clip_grad_value_ = torch.nn.utils.clip_grad.clip_grad_value_ = clip_grad_value_

# The engines whose sessions close as the program exits, if open then (one
# collected before closes its session in the binding's destructor).
_OPEN_AT_EXIT = weakref.WeakSet()


@atexit.register
def _close_open_engines():
    for engine in list(_OPEN_AT_EXIT):
        try:
            engine._close_at_exit()
        except Exception:  # (one failing, a GPU error say: the others still close)
            pass


class _UncaughtWatch:
    """Whether an exception ended the program (sys.excepthook ran) or it
    called sys.exit with a failure (a code other than 0 or None: SystemExit
    never reaches the excepthook), for exit-time closes: such a job did not
    finish. (A SystemExit raised by hand is not seen; os._exit closes
    nothing; a sys.exit caught, after which training goes on, is forgotten
    at the next step.)"""
    seen = False
    _installed = False

    @classmethod
    def install(cls):
        if cls._installed:
            return
        cls._installed = True
        previous = sys.excepthook

        def hook(kind, value, tb):
            cls.seen = True
            previous(kind, value, tb)
        sys.excepthook = hook
        previous_exit = sys.exit

        def exit_(status=None):
            # (The main thread's: a worker thread's SystemExit ends only
            # that thread. One caught, training going on, is forgotten at
            # the next step: Optimizer.step.)
            if status is not None and status != 0 and (
                    threading.current_thread() is threading.main_thread()):
                cls.seen = True
            previous_exit(status)
        exit_.__doc__ = previous_exit.__doc__
        sys.exit = exit_


class _TierGuard:
    """The binding's GpuTier, whose calls reach offloadd without the
    session's guard (_GuardedSession): one that finds offloadd gone or
    restarted (UNAVAILABLE, or NOT_FOUND for an id of an earlier offloadd)
    asks the session with a call that changes nothing, whose guard waits for
    the successor and resumes (SessionRestored); any other error, or one
    the session's call shows was not a restart, is the tier's own."""

    def __init__(self, engine, tier):
        self._engine = engine
        # The tier, in a holder close() empties: no call's frame (kept by a
        # traceback) holds the tier itself, so that it goes when closed, and
        # the session can close after it.
        self._holder = [tier]

    def close(self):
        self._holder[0] = None

    def __getattr__(self, name):
        holder = self._holder
        attr = getattr(holder[0], name)
        if not callable(attr):
            return attr
        del attr
        engine = self._engine  # (not self: the cached call must not keep the guard alive)

        def call(*args, **kwargs):
            try:
                return getattr(holder[0], name)(*args, **kwargs)
            except offloadd.NotFoundError as e:
                if "not one of its ids" not in str(e):
                    raise
                engine.session.pending_gradients()  # SessionRestored
                raise
            except offloadd.UnavailableError:
                engine.session.pending_gradients()  # SessionRestored after a restart
                raise
        self.__dict__[name] = call  # found without __getattr__ from now on (hooks call often)
        return call


class _GpuTier:
    """The GPU tier of one wrapped model (client/gpu_tier.h through the
    binding): each module's parameters (a unit) are copied to the GPU on a
    copy stream ahead of use along the order recorded in the previous
    iteration, from the daemon's arena registered for DMA, into one slab of
    GPU memory (gpu.budget_bytes) where they stay while the budget allows;
    gradients go back into the arena on a stream of their own while the
    rest of backward runs. The compute stream waits for copies with events,
    never the host. device "emulated" runs the same code on the CPU (tests)."""

    def __init__(self, engine, cfg, device_spec, torch_device):
        self.e = engine
        self.torch_device = torch_device
        self.cuda = torch_device.type == "cuda"
        self.device = offloadd.open_device(device_spec)
        self.esize = torch.empty(0, dtype=engine.torch_working).element_size()
        shards = engine.shards
        # One unit per module's own parameters (a tied parameter: the last
        # module that owns it, as module_shards).
        groups = {}
        for s in shards:
            groups.setdefault(id(s.module_shards), s.module_shards)
        self.units = []  # unit index -> its offsets in the slab while in use, shards gathered
        self.index = {}  # id(shard) -> its position in its unit
        declared = []
        for own in groups.values():
            unit = [s for s in own if s.module_shards is own]
            declared.append(unit)
        # A unit whose module has modules with units of their own below it
        # stays in use while they run: the tier stacks such units from its
        # slab's top, the room below them in one piece.
        owner = {id(own): m for m, own in engine._units}
        with_unit = {id(m) for m, _ in engine._units}
        holders = [key in owner and any(id(m) in with_unit for m in owner[key].modules()
                                        if m is not owner[key])
                   for key in groups]
        def placed(s):  # its bytes in the slab, as the cache aligns them
            return -(-s.slice_numel * self.esize // 256) * 256
        total = sum(placed(s) for s in shards)
        largest = max((sum(placed(s) for s in u) for u in declared), default=0)
        # What is in use at once: a module's parameters while its children
        # run, down the deepest chain of modules with parameters of their own.
        nested, where = self._nested_need(engine, placed)
        budget = cfg.get("budget_bytes")
        if budget is None:
            budget = total
            if self.cuda:
                free, _ = torch.cuda.mem_get_info(torch_device)
                budget = min(total, max(int(free * 0.4), 2 * largest, nested))
        # (The least budget named at once, whichever bound sets it: a first
        # refusal naming the largest module sent a user to a second.)
        if budget < max(largest, nested):
            if largest >= nested:
                raise offloadd.ResourceExhaustedError(
                    f"gpu.budget_bytes {budget}: the largest module's parameters need {largest} "
                    f"bytes on the GPU at once (the least budget this model takes)")
            raise offloadd.ResourceExhaustedError(
                f"gpu.budget_bytes {budget}: module '{where}' runs while the modules around it "
                f"hold their own parameters on the GPU: {nested} bytes at once (the least budget "
                f"this model takes; its largest module alone needs {largest})")
        grads_host = engine.host_percent("grads")
        # DMA straight from the arena only where the daemon never removes
        # its pages (params and grads wholly on the host); else staged.
        register = engine.params_host == 100 and grads_host == 100
        # Held for a whole iteration where holding costs no memory and a
        # fetch does not wait for a running step: two calls to the daemon an
        # iteration instead of two per copy.
        hold_all = register and not engine.config["overlap_step"]
        per = lambda k: int(cfg[k]) * self.esize if cfg.get(k) else 0  # elements -> bytes
        # A cap on what is live holds at least the largest module (the one
        # in use must be), as DeepSpeed's fetches what a module needs
        # whatever stage3_max_live_parameters says.
        max_live = per("max_live_parameters") and max(per("max_live_parameters"), largest)
        kwargs = dict(budget_bytes=int(budget), prefetch_depth=int(cfg.get("prefetch_depth", 2)),
                      prefetch_bytes=per("prefetch_elements") or (256 << 20),
                      persistence_threshold_bytes=per("persistence_threshold"),
                      max_live_bytes=max_live,
                      max_reuse_distance_bytes=per("max_reuse_distance"),
                      staging_bytes=int(cfg.get("staging_bytes", 16 << 20)),
                      register_arena=register, hold_per_iteration=hold_all)
        # The slab is torch's allocation, so that torch accounts it (on the
        # emulated device too, whose copies take any address: a slab of the
        # device's own, seen through a Python buffer, made every view of it
        # hold a Python object, which a graph freed at the process's exit
        # could not release: the exit hung).
        self.slab = torch.empty(int(budget), dtype=torch.uint8, device=torch_device)
        self.tier = _TierGuard(engine, offloadd.GpuTier(
            engine.session.raw, self.device, slab=self.slab.data_ptr(),
            slab_bytes=int(budget), **kwargs))
        self.slab_base = self.slab.data_ptr()
        self.unit_shards = []  # unit index -> its shards, in the order the tier places them
        for unit, holder in zip(declared, holders):
            u = self.tier.add_unit([(s.pid, s.slice_numel * self.esize) for s in unit],
                                   holder=holder)
            self.units.append({"offsets": None, "gathered": 0, "views": None})
            self.unit_shards.append(unit)
            for i, s in enumerate(unit):
                s.unit = u
                self.index[id(s)] = i
        # Resident: the budget holds every unit at once (one rank; nothing
        # is evicted), so a unit used once stays gathered until backward
        # is over (free_all): its parameters are views of the slab, at the
        # same place iteration after iteration, saved by autograd as they
        # are, and only each iteration's first use of a unit reaches the
        # tier (which copies the values a step changed). Otherwise each
        # module's parameters are gathered for its forward and again for
        # its backward, and freed after each.
        # (Parameters of another dtype than the working copy's would each be
        # converted into memory outside the budget, held as long.)
        # (A cap on what is live that holds the whole model, as DeepSpeed's
        # default 1e9 does for most, keeps it resident.)
        self.resident = (engine.world == 1 and budget >= total and (not max_live or max_live >= total)
                         and all(s.dtype == engine.torch_working for s in shards))
        # Resident, and the iteration's holds taken at once (a fetch never
        # waits for a running step): every unit is used at the iteration's
        # start in one call, their copies issued together, so that no
        # module's forward calls the tier (see begin_iteration).
        self.use_all = self.resident and hold_all
        self.at = {}  # data_ptr of a gathered parameter in the slab -> shard
        self._starts = None  # sorted keys of `at`, built when needed
        self.grads = {}  # pid -> (shard, its gradient slice on the GPU, stats or None)
        self.grad_bytes = 0
        self.queued, self.queued_bytes = [], 0  # (pid, address, bytes) not yet issued
        self.counts = {"units_used": 0, "use_calls": 0}  # (resident: calls to the tier's use)
        self._stream = None
        self._per_batch = False  # gradient buffers held a batch at a time
        # Gradient buffers held in flight before a batch is returned (each
        # holds its partition's parameters too): where they pass through the
        # node's pool (not all homed on the host), no more of it than a
        # gradient return takes (_size_batches), counted in fp32 gradient
        # bytes.
        self.pending_bytes = (self.MAX_PENDING_BYTES if register else max(1, min(
            self.MAX_PENDING_BYTES, engine.RETURN_BYTES * 4 // (self.esize + 4))))
        # The next iteration's holds taken and copies issued after a step
        # (prefetch_next), its iteration not yet begun.
        self._prefetched = False

    @staticmethod
    def _nested_need(engine, placed):
        """The most bytes of parameters in use at once by nesting: a unit's
        own and those of every module around it that owns a unit (its
        forward still runs), and the module where that is reached."""
        own = {id(m): sum(placed(s) for s in shards) for m, shards in engine._units}
        names = {id(m): n for n, m in engine._model.named_modules()}
        best, where = 0, ""

        def walk(module, above):
            nonlocal best, where
            here = above + own.get(id(module), 0)
            if here > best:
                best, where = here, names.get(id(module), "")
            for child in module.children():
                walk(child, here)
        walk(engine._model, 0)
        return best, where or "the model"

    @staticmethod
    def create(engine, cfg):
        mode = cfg.get("tier", "auto")
        spec = cfg.get("device")
        devices = {s.device for s in engine.shards}
        if spec == "emulated":
            if mode is False:
                return None
            return _GpuTier(engine, cfg, "emulated", torch.device("cpu"))
        if mode is False:
            return None
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            if mode is True or spec is not None:
                # (Asked for by name: the tier runs where the parameters are.)
                raise offloadd.InvalidArgumentError(
                    f"gpu.{'device ' + repr(spec) if spec is not None else 'tier true'} needs "
                    "the model's parameters on one CUDA device, not "
                    f"{', '.join(sorted(str(d) for d in devices))}: move the model there before "
                    "wrap()")
            return None
        dev = next(iter(devices))
        if spec not in (None, "cuda") and torch.device(spec) != torch.device(
                "cuda", dev.index if dev.index is not None else torch.cuda.current_device()):
            raise offloadd.InvalidArgumentError(
                f"gpu.device {spec!r}, but the model's parameters are on {dev}: the tier runs "
                "where the parameters are")
        if engine.world > 1 and engine.backend != "nccl":
            return None  # gathers on the host (gloo): nothing for a GPU tier to do
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        # (By its index, the parameters' device: "cuda" alone opens device 0.)
        return _GpuTier(engine, cfg, f"cuda:{idx}", torch.device("cuda", idx))

    def stream(self):
        """The compute stream (torch's current one when the iteration began)."""
        if self._stream is None:
            self._stream = (torch.cuda.current_stream(self.torch_device).cuda_stream
                            if self.cuda else 0)
        return self._stream

    # --- parameters ---------------------------------------------------------

    def begin_iteration(self):
        start = time.perf_counter()
        self._stream = None
        self._prefetched = False
        # (With held iterations: every partition held, one call.)
        self.e.with_room("the iteration's parameters", lambda: self.tier.begin_iteration())
        if self.use_all:
            # Every unit at once: the compute stream waits for all the
            # copies a step made due (about a millisecond for 100 MB at
            # PCIe's pace) instead of each module's forward asking the tier
            # for its own (a call and a wait each, on the trainer's thread);
            # a unit the forward does not reach is copied all the same.
            need = [s for s in self.e.shards if not s.gathered]
            self.gather_resident(need)
            self.e.counts["fetches"] += len(need)
        self.e.timings["fetch"] += time.perf_counter() - start

    def prefetch_next(self):
        """After a step, where every unit is used at the iteration's start
        (use_all): the next iteration's holds taken and every stale unit's
        copy issued now, so that the copies (the step's new values) run
        while the trainer's thread is busy with zero_grad, its next batch
        and the forward's start, instead of the forward's first kernel
        waiting for all of them. Nothing is used: begin_iteration then finds
        the copies in flight or done. An error here is left to that
        begin_iteration (the step itself went through): a hold or a copy
        refused now is asked for again there; a copy that fails later is
        reported by the next use of its unit, as a prefetch's is, and
        copied again at the one after."""
        if not self.use_all or self._prefetched or self.tier._holder[0] is None:
            return
        try:
            # (Not through the guard: a restart is the forward's to handle;
            # no local holds the tier, which close() must be able to drop.)
            self.tier._holder[0].prefetch_units(list(range(len(self.units))))
        except offloadd.Error:
            return
        self._prefetched = True

    def gather(self, need):
        e = self.e
        # A module run again in backward (activation checkpointing's
        # recompute: outside the model's forward, with grad) saves the
        # values for its own backward, which runs after the unit's Done: a
        # copy of their own, not slab memory a copy issued after Done (a
        # prefetch, the next unit) may take while that backward reads it.
        recompute = e._forward_depth == 0 and torch.is_grad_enabled()
        by_unit = {}
        for s in need:
            by_unit.setdefault(s.unit, []).append(s)
        for u, ss in by_unit.items():
            with _Uninterrupted():  # (in use and its parameters marked, or neither)
                self._gather_unit(u, ss, recompute)

    def _gather_unit(self, u, ss, recompute):
        """Unit `u` used (its copies issued) and its shards `ss` pointed at
        its tensors (all-gathered across ranks)."""
        e = self.e
        rec = self.units[u]
        if rec["offsets"] is None:
            def use(rec=rec, u=u):
                rec["offsets"] = self.tier.use(u, self.stream(), self.device)
            e.with_room(f"the parameters of '{ss[0].name}' and its module's", use,
                        self._relieve)
            self.counts["units_used"] += 1
        locals_ = []
        for s in ss:
            off = rec["offsets"][self.index[id(s)]]
            locals_.append(self.slab[off:off + s.slice_numel * self.esize]
                           .view(e.torch_working))
        if e.world == 1:
            fulls = [loc if loc.dtype == s.dtype else loc.to(s.dtype)
                     for s, loc in zip(ss, locals_)]
        else:
            fulls = [full.to(s.dtype) for s, full in zip(ss, e.all_gather(ss, locals_))]
        for s, full in zip(ss, fulls):
            if recompute and self._in_slab(full.data_ptr()):
                full = full.clone()
            s.param.data = full[: s.numel].view(s.shape)
            s.gathered = True
            rec["gathered"] += 1
            if self._in_slab(full.data_ptr()):
                self.at[s.param.data.data_ptr()] = s
                self._starts = None
            else:
                e._storage_to_shard[e._base(s.param.data)] = s

    def gather_resident(self, need):
        """Resident mode: the units of `need` used (values copied where a
        step changed them; the compute stream waits for the copies, not
        the host) and their parameters pointed at their slab memory."""
        e = self.e
        # Each unit once (another of its shards gathers it with it).
        units = list(dict.fromkeys(s.unit for s in need if not s.gathered))
        if not units:
            return
        with _Uninterrupted():  # (in use on both sides, or on neither)
            if len(units) == 1:
                used = [e.with_room(f"the parameters of unit {units[0]}", lambda: self.tier.use(
                    units[0], self.stream(), self.device))]
            else:
                used = e.with_room(f"the parameters of {len(units)} units",
                                   lambda: self.tier.use_units(units, self.stream(), self.device))
            self._point_at(units, used)

    def _point_at(self, units, used):
        """Resident mode: `units` used, placed at `used` (their tensors'
        offsets in the slab): their parameters point there."""
        e = self.e
        self.counts["use_calls"] += 1
        for unit, offsets in zip(units, used):
            rec = self.units[unit]
            self.counts["units_used"] += 1
            views = rec["views"]
            if views is None or views[0] != offsets:  # placed elsewhere (a new order)
                views = (offsets, [self.slab[off:off + s.slice_numel * self.esize]
                                   .view(e.torch_working)[: s.numel].view(s.shape)
                                   for s, off in zip(self.unit_shards[unit], offsets)])
                rec["views"] = views
            rec["offsets"] = offsets
            for s, view in zip(self.unit_shards[unit], views[1]):
                s.param.data = view  # (resident: the working dtype is the parameter's)
                s.gathered = True

    def release_all(self):
        """Resident mode: every unit in use let go (the event Done records
        covers the compute issued so far); its parameters' values are
        refused until a forward gathers them again (see
        _OffloadedParameter), their memory stays in the slab."""
        units = [u for u, rec in enumerate(self.units) if rec["offsets"] is not None]
        if not units:
            return
        with _Uninterrupted():  # (done on both sides, or on neither)
            self.tier.done_units(units, self.stream(), self.device)
            for u in units:
                self.units[u]["offsets"] = None
                for s in self.unit_shards[u]:
                    s.gathered = False

    def release_unmarked(self):
        """Units in use none of whose parameters is marked gathered (an
        exception between a use and its marking: an all-gather that
        failed) let go: nothing else would, and their room stayed taken."""
        if self.resident:
            return
        for u, rec in enumerate(self.units):
            if rec["offsets"] is not None and rec["gathered"] == 0:
                self.tier.done(u, self.stream(), self.device)
                rec["offsets"] = None

    def _in_slab(self, ptr):
        return self.slab_base <= ptr < self.slab_base + self.slab.numel()

    def freeing(self, s):
        """`s` (still gathered) is being freed: its unit is done once all
        of it is (the event Done records covers the compute issued so far)."""
        rec = self.units[s.unit]
        if rec["gathered"] == 1 and rec["offsets"] is not None:
            # (Raises with nothing changed: the unit still in use here as in
            # the tier, `s` still gathered. A Ctrl-C waits for _free's end.)
            self.tier.done(s.unit, self.stream(), self.device)
            rec["offsets"] = None
        rec["gathered"] -= 1
        if self.at.pop(s.param.data.data_ptr(), None) is not None:
            self._starts = None

    def shard_at(self, t):
        """The parameter gathered into the slab that `t` lies in, or None."""
        if not self.at:
            return None
        ptr = t.data_ptr()
        if not self._in_slab(ptr):
            return None
        if self._starts is None:
            self._starts = sorted(self.at)
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        s = self.at[self._starts[i]]
        return s if ptr < self._starts[i] + s.numel * self.esize else None

    def invalidate(self):
        self.tier.invalidate(self.stream(), self.device)

    def step_running(self, running):
        """After a step: whether it still runs (see GpuTier::SetGradientsPerBatch)."""
        if running != self._per_batch:
            self.tier.set_gradients_per_batch(running)
            self._per_batch = running

    # --- gradients ------------------------------------------------------------

    # Gradients in flight to the host before a batch is returned at once.
    MAX_PENDING = 4096
    MAX_PENDING_BYTES = 1 << 30
    # Resident mode: gradients whose copies are issued together (one call,
    # one wait on the compute stream, one event), at most this many or
    # bytes; the rest of backward runs meanwhile.
    ISSUE_BATCH = 16
    ISSUE_BYTES = 8 << 20  # (within the default 16 MiB staging buffer)

    def queue_gradient(self, s, grad):
        """Resident mode, from `s`'s gradient hook: `grad` (the whole
        gradient; kept here, in fp32, until its copy is done) is copied to
        the arena with the next ones, in one call to the tier, and returned
        at the flush (the end of backward)."""
        start = time.perf_counter()
        e = self.e
        e._queue_sweep()
        if s.pid in self.grads:  # returned twice before a flush (a tied weight)
            self.flush_gradients(end=False)
        g = grad.detach().reshape(-1)
        if g.dtype != torch.float32:
            g = g.to(torch.float32)
        self.grads[s.pid] = (s, g, e._hand_over and e._gradient_stats in ("trainer", "auto"))
        self.queued.append((s.pid, g.data_ptr(), g.numel() * 4))
        self.queued_bytes += g.numel() * 4
        self.grad_bytes += g.numel() * 4
        if len(self.queued) >= self.ISSUE_BATCH or self.queued_bytes >= self.ISSUE_BYTES:
            self._issue()
        if len(self.grads) >= self.MAX_PENDING or self.grad_bytes >= self.pending_bytes:
            self.flush_gradients(end=False)
        e.timings["return"] += time.perf_counter() - start

    def _issue(self):
        if self.queued:
            items, self.queued, self.queued_bytes = self.queued, [], 0
            try:
                self.e.with_room(f"the gradient buffers of {len(items)} partitions",
                                 lambda: self.tier.add_gradients(items, self.stream(),
                                                                 self.device))
            except BaseException as exc:
                # Some may be in flight: wait for them and let their buffers
                # go unreturned. This backward's gradients are lost (the
                # error says why); any returned before (a full batch, a tied
                # weight) are the daemon's: zero_grad() drops them.
                try:
                    self._drop()
                except BaseException:
                    pass  # (the first error is the one to see)
                raise exc

    def _relieve(self):
        """Before a hold asked again for room (not in resident mode): the
        parameter copies done reaped, their holds let go. (Not this rank's
        gradients in flight: returning them takes room too, and a return
        refused lets their buffers go unreturned; pending_bytes bounds
        them.)"""
        self.tier.synchronize()

    def _drop(self):
        """Waits for the gradients' copies in flight and lets their buffers
        go unreturned; their sources are kept until that succeeded."""
        self.tier.drop_gradients()
        self.grads, self.grad_bytes = {}, 0
        self.queued, self.queued_bytes = [], 0

    def return_gradient(self, s, mine):
        """`mine`: this rank's averaged fp32 slice (several ranks, from the
        engine's bucket), or the whole flat gradient (one rank)."""
        e = self.e
        if e.world == 1:
            mine = mine.to(torch.float32).contiguous()
            if mine.numel() < s.slice_numel:
                mine = torch.cat([mine, mine.new_zeros(s.slice_numel - mine.numel())])
        if s.pid in self.grads:  # returned twice before a flush (a tied weight)
            self.flush_gradients()
        # The norm where the gradient is, at the flush, all in one launch (a
        # non-finite norm: its elements are counted then, rarely).
        stats = e._hand_over and e._gradient_stats in ("trainer", "auto")
        e.with_room(f"the gradient buffer of '{s.name}'", lambda: self.tier.add_gradient(
            s.pid, mine.data_ptr(), mine.numel() * 4, self.stream(), self.device), self._relieve)
        self.grads[s.pid] = (s, mine, stats)  # alive until its copy is done
        self.grad_bytes += mine.numel() * 4
        if len(self.grads) >= self.MAX_PENDING or self.grad_bytes >= self.pending_bytes:
            self.flush_gradients(end=False)

    def flush_gradients(self, end=True, keep_prefetch=False):
        """Returns the gradients in flight; with `end` (backward is over, or
        a step comes), also ends the iteration: its copies done, its holds
        let go. With `keep_prefetch` (zero_grad), an iteration only
        prefetched (prefetch_next) and nothing in flight is left as it is:
        ending it would wait for its copies and let its holds go."""
        e = self.e
        if keep_prefetch and self._prefetched and not self.grads and not self.queued:
            return
        self._issue()
        if self.grads:
            stats = None
            entries = list(self.grads.values())
            if all(st for _, _, st in entries):
                # One transfer of every norm (the only host wait here).
                norms = torch.stack(torch._foreach_norm([m for _, m, _ in entries])).double()
                waiting = time.perf_counter()
                squares = (norms * norms).tolist()  # waits for backward on the device
                e.timings["device_wait"] += time.perf_counter() - waiting
                stats = {}
                for (s, mine, _), sq in zip(entries, squares):
                    bad = 0 if math.isfinite(sq) else int(torch.isfinite(mine).logical_not_().sum())
                    stats[s.pid] = (sq, bad)
            e.returned_since_step = True  # (before: a Ctrl-C after it, zero_grad drops them)
            try:
                returned = self.tier.return_gradients(True, e._hand_over, stats)
            finally:
                self.grads, self.grad_bytes = {}, 0
            e.counts["returns"] += len(returned)
            if stats is not None:
                e.counts["stats_sent"] += len(returned)
        # A copy to the GPU that failed after its use was issued: this
        # iteration computed with bad values; say so before its step.
        if end:
            self._stream = None
            self._prefetched = False
            self.tier.end_iteration()
        else:
            self.tier.synchronize()

    def stats(self):
        return dict(self.tier.stats(), **self.counts, device=self.device.name,
                    resident=self.resident, units=len(self.units))

    def close(self):
        try:
            self._drop()  # copies in flight read their sources until done
        except offloadd.Error:
            pass
        self.at = {}
        for u, rec in enumerate(self.units):
            if rec["offsets"] is not None:
                rec["offsets"] = None
                self.tier.done(u, self.stream(), self.device)
            if self.resident:
                rec["views"] = None
                for s in self.unit_shards[u]:  # (no view of the slab outlives it)
                    s.gathered = False
                    s.param.data = torch.empty(0, dtype=s.dtype, device=s.device)
        self.tier.close()
        self.tier = None
        self.slab = None


class _SavedParam:
    """Marks a saved tensor that is a gathered parameter (see pack)."""


def _tensors_in(args):
    """The tensors among `args`, and one level inside its tuples, lists and
    dicts."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from (t for t in a if isinstance(t, torch.Tensor))
        elif isinstance(a, dict):
            yield from (t for t in a.values() if isinstance(t, torch.Tensor))


def _accumulates(node):
    """Whether autograd node `node` accumulates a leaf's gradient (a
    parameter's .grad): torch's AccumulateGrad, the only node with a
    .variable."""
    return hasattr(node, "variable")


class _BackwardWatch:
    """One forward of a module whose unit goes after its backward
    (_Engine._watch_backward): a hook after each of its nodes that read its
    inputs calls arrived() once a backward; the last lets the unit go. (Through a weak reference to
    the engine: the graph, kept by whoever keeps an output, must not keep
    the engine and its session.)"""

    __slots__ = ("engine_ref", "own", "inputs", "left", "__weakref__")

    def __init__(self, engine_ref, own, inputs):
        self.engine_ref, self.own, self.inputs, self.left = engine_ref, own, inputs, inputs

    def arrived(self, grad_inputs, grad_outputs):
        self.left -= 1
        if self.left == 0:
            self.left = self.inputs  # (again in a second backward of a graph kept)
            engine = self.engine_ref()
            if engine is not None:
                with engine._remembering():
                    engine.after_module_backward(self.own)
        return None


class Optimizer(torch.optim.Optimizer):
    """AdamW (or Adam) whose state and step live in offloadd.

    Param groups and lr schedulers work as with torch.optim.AdamW: step()
    sends every group's current hyperparameters. Gradients accumulate in the
    daemon until step(), which consumes them (as DeepSpeed's engine does;
    torch's .grad stays until zero_grad: a second step() without a backward
    between steps each parameter that had a gradient with a zero one here,
    not the same one again, and a loop without zero_grad() steps with each
    iteration's gradients, not their sum since the start): with
    gradient_accumulation_steps N, backward() divides the loss by N and the
    trainer calls step() once every N micro-batches; wrapped with a
    deepspeed_config, as DeepSpeed's engine is called: step() after every
    micro-batch, the update at every Nth (is_gradient_accumulation_boundary)."""

    def __init__(self, engine, param_groups, defaults, config):
        self._engine = engine  # add_param_group, which torch's __init__ calls, needs it
        engine._optimizer = self  # the delayed update's drain (latest_weights) asks it
        self._config = config
        try:
            super().__init__(param_groups, defaults)
        except ValueError as e:  # torch's checks: empty, duplicate, not a leaf
            raise offloadd.InvalidArgumentError(f"param groups: {e}") from e
        self._static_scale = config["static_loss_scale"]
        # What torch.nn.utils.clip_grad_norm_, called since the last step,
        # scaled the gradients by (each call's factor, multiplied): the next
        # step's, before gradient_clipping's; and the micro-batches pending
        # when it measured them (a backward after it is refused at step()).
        self._clip_coef = None
        self._clip_micro_batches = 0
        self._overlapped = False  # an overlapped step may still run
        # The outcome of the last overlapped step that ended (its times),
        # as step() found it; last_step is the one it started.
        self.last_finished = None
        # step() returns once the daemon decided, the update running beside
        # the next forward and backward: asked for, or what the delayed
        # update is for (its fetches do not wait for the update; before it
        # switches on, each fetch waits for its own partition's).
        self._overlap = config["overlap_step"] or config["delayed_update_after_steps"] is not None
        self.last_step = None
        self._step_applied = False  # the last step() updated (DeepSpeed's was_step_applied)
        self._buffers_kept = {}  # checkpoint directory -> the step of its buffers file kept before
        self._forced_boundary = None  # DeepSpeedEngine.set_gradient_accumulation_boundary
        self._deepspeed = None  # wrap(deepspeed_config=...)'s _DeepSpeedSettings
        # DeepSpeed's loop (wrap with a deepspeed_config): step() after every
        # micro-batch, the update at every N-th (N = gradient_accumulation_steps).
        self._micro_steps = 0
        if config["loss_scaling"] is not None:
            self._loss_scale = engine.session.pending_gradients()["loss_scale"]
        else:
            self._loss_scale = self._static_scale or 1.0

    @property
    def engine(self):
        return self._engine

    @property
    def loss_scale(self):
        """The factor backward() multiplies the loss by (fp16; 1 otherwise)."""
        return self._loss_scale

    @property
    def global_steps(self):
        """Updates so far, skipped ones too (DeepSpeed's global_steps), counted
        on from a load_checkpoint's."""
        return self._engine.counts["steps"] + getattr(self, "_steps_before", 0)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """loss.backward() scaled as DeepSpeed's engine does: by the fp16
        loss scale and (scale_wrt_gas) 1 / gradient_accumulation_steps.
        Returns the loss."""
        scale = self._loss_scale
        if scale_wrt_gas:
            scale /= self._config["gradient_accumulation_steps"]
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        except RuntimeError as e:
            # Autograd turns an exception of a hook into RuntimeError: the
            # restart found during backward is SessionRestored again, and
            # offloadd's errors their own types (the GPU tier's no room, a
            # peer lost), without the stack autograd appends.
            restored = self._engine.restored
            if restored is not None and "SessionRestored" in str(e):
                raise restored from e
            kept, self._engine._hook_error = self._engine._hook_error, None
            if kept is not None and str(kept) in str(e):
                raise kept from e  # (the hook's own, as it was raised)
            raise
        return loss

    def add_param_group(self, param_group):
        _check_group(param_group, "a param group")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) not in self._engine.by_param:
                raise offloadd.InvalidArgumentError(
                    "a param group names a tensor that is not a parameter offloadd holds: one "
                    "of the wrapped model as it was at wrap() (a module added to the model "
                    "afterwards is not offloadd's: train it with a torch optimizer of its own, "
                    "or wrap the model once it is whole)")
        super().add_param_group(dict(param_group, params=params))
        for p in params:
            self._engine.by_param[id(p)].in_optimizer = True

    @property
    def cur_scale(self):
        """The loss scale (DeepSpeed's optimizer's name for it)."""
        return self._loss_scale

    def is_gradient_accumulation_boundary(self):
        """Whether the micro-batch being computed is the last before an
        update (DeepSpeed's engine method): with a deepspeed_config, step()
        updates only then (or as set_gradient_accumulation_boundary says)."""
        if self._forced_boundary is not None:
            return bool(self._forced_boundary)
        n = self._config["gradient_accumulation_steps"]
        return (self._micro_steps + 1) % n == 0

    def _inside_accumulation(self):
        """In a DeepSpeed loop, between the micro-batches of one update: the
        gradients returned so far are kept for it."""
        if not self._config.get("deepspeed_loop"):
            return False
        if self._forced_boundary is not None:
            return not self._forced_boundary
        return self._micro_steps % self._config["gradient_accumulation_steps"] != 0

    def zero_grad(self, set_to_none=None):
        """Drops the gradients of this step so far, as torch's does: those
        the daemon accumulated are consumed by a skipped step (which changes
        nothing else). set_to_none (torch's default where None: False before
        torch 2.0) as torch's: False leaves each parameter that had a
        gradient with a zero one, which the next step updates (moments and
        weight decay) if no backward reaches it. In a DeepSpeed loop, before
        the accumulation boundary, nothing (as DeepSpeed's engine)."""
        if self._inside_accumulation():
            return
        if set_to_none is None:
            set_to_none = _TORCH_SET_TO_NONE
        self._clip_coef = None
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        e = self._engine
        for s in e.shards:
            s.grad_since_step = False
            if set_to_none:
                s.has_grad = False
        # A backward that raised never reached its end (torch runs no queued
        # callback then): what its pass gathered and held goes now, and the
        # next backward queues its own end again.
        if e._sweep_queued:
            e._sweep_queued = False
            e.free_all()
            e.end_pass()
        e._returns, e._return_bytes = [], 0
        if e._reduce is not None:
            e._reduce.discard()
        if e.tier is not None:
            # In flight to the daemon: consumed below (a prefetch for the
            # next iteration stays).
            e.tier.flush_gradients(keep_prefetch=True)
        if e.returned_since_step:
            if e.session.pending_gradients()["partitions"]:
                # (Several ranks: no automatic checkpoint at a skip; the
                # next step's agreement decides.)
                e.session.step(skip=True, auto_checkpoint=False if e.world > 1 else None)
            e.returned_since_step = False

    @torch.no_grad()
    def step(self, closure=None):
        _UncaughtWatch.seen = False  # (a sys.exit caught: training went on)
        self._step_applied = False  # (DeepSpeed's was_step_applied)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._config.get("deepspeed_loop"):
            micro = self._micro_steps
            self._micro_steps += 1
            if self._forced_boundary is not None and not self._forced_boundary:
                return loss  # (set_gradient_accumulation_boundary(False))
            if self._forced_boundary is None and self._inside_accumulation():
                return loss  # DeepSpeed's engine: the update waits for the boundary
            try:
                self._update()
            except BaseException:
                # Not updated: the call again is the boundary again (after
                # a restart the window began anew: left at 0).
                self._micro_steps = min(self._micro_steps, micro)
                raise
            return loss
        self._update()
        return loss

    def _update(self):
        e = self._engine
        start = time.perf_counter()
        self._settle()  # (the previous step's failure, a swap-in error, surfaces here)
        # A parameter whose gradient torch would hold zeroed (zero_grad with
        # set_to_none=False) and no backward reached since: torch's step
        # updates it with a zero gradient; each rank returns its slice's
        # (zeros averaged are zeros: no collective).
        # (Marked returned: a step that stops midway and is called again
        # returns none twice.)
        # In a DeepSpeed loop every trainable parameter is stepped at every
        # update, as DeepSpeed's steps its whole flat partition: one no
        # backward reached, with a zero gradient (its moments decay, and
        # its weight decay applies).
        ds = self._config.get("deepspeed_loop")
        zeros = [s for s in e.shards if s.in_optimizer and not s.grad_since_step and
                 (s.has_grad or (ds and s.param.requires_grad))]
        for i in range(0, len(zeros), e.RETURN_BATCH):
            batch = zeros[i:i + e.RETURN_BATCH]
            e._return_batch([(s, torch.zeros(s.slice_numel), None) for s in batch])
            e.returned_since_step = True
            for s in batch:
                s.grad_since_step = True
        sq_norm, nonfinite, partitions, due, pending = self._pending_everywhere(
            "all-reduce of the gradient norm")
        auto_checkpoint = due if e.world > 1 else None  # (one rank: offloadd's clock decides)
        if not partitions:  # no gradients anywhere: nothing to do, as in torch
            self._stepped()
            e.timings["step"] += time.perf_counter() - start
            return
        overflow = nonfinite > 0 or not math.isfinite(sq_norm)
        coef = 1.0
        clip = self._config["gradient_clipping"]
        if self._clip_coef is not None and not overflow:
            if pending["micro_batches"] != self._clip_micro_batches:
                raise offloadd.FailedPreconditionError(
                    "clip_grad_norm_ was called before this step's last backward: offloadd "
                    "clips the gradients the step applies, all of them, by the norm measured "
                    "then; call it after the last micro-batch's backward, before step() "
                    "(nothing was stepped: zero_grad() drops this step's gradients)")
            coef = self._clip_coef  # (the norm it was measured with may hold others')
            if clip:  # gradient_clipping after it, as a second clip would
                coef *= min(1.0, clip / (math.sqrt(sq_norm) * coef + 1e-6))
        elif clip and not overflow:
            coef = min(1.0, clip / (math.sqrt(sq_norm) + 1e-6))
        if self._static_scale:
            coef /= self._static_scale
        hyper = [self._hyper(g) for g in self.param_groups]
        first = hyper[0]
        groups = []
        for g, h in zip(self.param_groups[1:], hyper[1:]):
            ids = [e.by_param[id(p)].pid for p in g["params"]]
            if ids:
                groups.append(dict(h, ids=ids))
        # (A step applied is recorded here whatever a Ctrl-C does meanwhile:
        # its copies on the GPU invalidated, its count taken.)
        with _Uninterrupted():
            # A step the pool has no room for (the other ranks hold theirs)
            # stops where it was and resumes at the next call.
            # (half_done: a step stopped for room is partly applied, and
            # resumes at the next call: a Ctrl-C waits for its end.)
            r = e.with_room("the optimizer step's state chunks", lambda: e.session.step(
                grad_scale=coef, overflow=overflow, overlap=self._overlap, groups=groups,
                auto_checkpoint=auto_checkpoint, **first), half_done=True)
            self._stepped()
            self._clip_coef = None
            if e.tier is not None and not r["skipped"]:
                e.tier.invalidate()  # the parameters changed: copies on the GPU are stale
            e.returned_since_step = False
            # With the delayed update the model reads the step before's weights
            # until the next step, or a drain (latest_weights).
            e._weights_current = not r["delayed_update"]
            self._overlapped = bool(r["running"])
            self._step_applied = not r["skipped"]
            e.counts["steps"] += 1
            e.counts["skipped"] += bool(r["skipped"])
        if e.tier is not None:
            # A step still running (the delayed update's) reads the gradient
            # buffers the next backward writes, in the order they came:
            # each batch then waits only for its own partitions' updates.
            e.tier.step_running(self._overlapped)
            e.tier.prefetch_next()
        if self._config["loss_scaling"] is not None:
            if overflow and e.rank == 0:
                # As DeepSpeed's engine logs it; at the least scale it cannot go lower.
                min_scale = (self._config["loss_scaling"] or {}).get("min_scale", 1.0)
                _log.log(logging.WARNING if r["loss_scale"] <= min_scale else logging.INFO,
                         "OVERFLOW! step %d skipped: loss scale %g -> %g%s",
                         self.global_steps, self._loss_scale, r["loss_scale"],
                         " (its minimum, min_scale: the gradients overflow at any scale)"
                         if r["loss_scale"] <= min_scale else "")
            self._loss_scale = r["loss_scale"]
        self.last_step = dict(r, grad_norm=math.sqrt(sq_norm) if not overflow else math.inf,
                              clip_coef=coef)
        e.timings["step"] += time.perf_counter() - start

    def _pending_everywhere(self, what):
        """The gradients returned since the last step as the step takes
        them: every rank's (a collective with several ranks: each asks),
        unscaled by a static loss scale. (squared norm, non-finite elements,
        partitions with gradients, an automatic checkpoint due on some
        rank, this daemon's own answer)."""
        e = self._engine
        pending = e.session.pending_gradients()
        sq_norm, nonfinite = pending["sq_norm"], float(pending["nonfinite"])
        partitions = float(pending["partitions"])
        due = float(pending.get("auto_checkpoint_due", False))
        if e.world > 1:
            # The automatic checkpoint too: taken at this step on every rank
            # if it is due on any (each daemon's clock alone put the ranks'
            # checkpoints steps apart, with no step all of them held).
            t = torch.tensor([sq_norm, nonfinite, partitions, due], dtype=torch.float64)
            e._collective(what, lambda: dist.all_reduce(t, group=e.group))
            sq_norm, nonfinite, partitions, due = t.tolist()
        if self._static_scale:
            sq_norm /= self._static_scale * self._static_scale
        return sq_norm, nonfinite, partitions, due > 0, pending

    def _stepped(self):
        """A step took what came since the last: the next starts afresh."""
        for s in self._engine.shards:
            s.grad_since_step = False

    def drain(self):
        """With the delayed update: makes the newest weights the ones the
        model reads (they are otherwise one step behind the last step), for
        evaluation; state_dict() does this itself. The next iteration is
        then one step less stale, once. Every rank calls it."""
        self._engine.latest_weights()

    @staticmethod
    def _hyper(g):
        _check_group(g, "a param group")  # (its keys may change between steps)
        beta1, beta2 = g["betas"]
        return {"lr": float(g["lr"]), "beta1": float(beta1), "beta2": float(beta2),
                "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"]),
                "adamw": bool(g["adamw"])}

    def checkpoint(self, directory, background=False):
        """Writes this job's optimizer state (fp32 master weights, moments,
        step counts, loss scale) and working weights into `directory`, every
        rank at the same step: call it on every rank after step(). Each
        rank's is atomic and keeps the one it replaces: a crash before every
        rank committed leaves a directory that a restore refuses, naming the
        step all ranks hold (give it as zero_config's restore_steps).
        Training waits only for the step boundary; with `background`, it
        returns then (wait_checkpoint() gives the outcome). Resume with
        wrap(..., zero_config={"restore_from": directory}), with any number
        of ranks. `offloadctl export` turns it into one safetensors file."""
        e = self._engine
        e.free_all()
        e.flush_gradients()
        result = e.session.checkpoint(os.path.abspath(directory), background)
        # The module's buffers (BatchNorm's statistics: not parameters, not
        # the daemon's), rank 0's, beside it (the daemon's directory may be
        # another user's), a file a step, the one before kept as the daemon
        # keeps its checkpoint: restore_from loads them. The job's
        # checkpoint is whole once every rank's is, and they are written.
        buffers = {k: b.detach().to("cpu", copy=True)
                   for k, b in _persistent_buffers(e._model).items()} if e.rank == 0 else {}

        def write():
            if not buffers:
                return
            steps = int(result["steps"])
            _replace_file(_buffers_file(directory, steps),
                          lambda f: torch.save({"steps": steps, "buffers": buffers}, f))
            for old in glob.glob(glob.escape(_buffers_file(directory, "")) + "*.pt"):
                kept = old[len(_buffers_file(directory, "")):-len(".pt")]
                if kept.isdigit() and int(kept) < steps and int(kept) not in (
                        self._buffers_kept.get(directory, ())):
                    os.unlink(old)
            self._buffers_kept[directory] = (steps,)
        e.on_rank0(write, f"the module's buffers beside {directory}",
                   agree=e.world > 1 and not background)
        return result

    # DeepSpeed's engine's checkpoints (save_checkpoint, load_checkpoint), as
    # its users call them on the model wrap() returns with a deepspeed_config.
    # Beside offloadd's checkpoint in save_dir/tag (the daemon's directory,
    # which another user's offloadd owns under the packaged service), rank
    # 0's save_dir/tag.client_state.pt: the client_state, the update count,
    # the param groups' hyperparameters.
    _CLIENT_STATE = ".client_state.pt"

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's engine method: this job's checkpoint (checkpoint())
        in save_dir/tag (tag: "global_step<N>", N the updates so far), with
        `client_state` (rank 0's, torch.save'd beside it) and, with
        save_latest, the tag in save_dir/latest (each file replaced whole).
        Every rank calls it; a rank 0 that cannot write its files raises on
        every rank."""
        e = self._engine
        if exclude_frozen_parameters:
            raise offloadd.InvalidArgumentError(
                "save_checkpoint(exclude_frozen_parameters=True): offloadd's checkpoints hold "
                "every parameter")
        steps = self.global_steps
        tag = str(tag) if tag is not None else f"global_step{steps}"
        written = self.checkpoint(os.path.join(save_dir, tag))

        def write():
            # The param groups' hyperparameters too (an lr scheduler's
            # current lr), as DeepSpeed's optimizer state holds them.
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
            # The step every rank committed (restore_steps at the load: a
            # save into this tag that a crash cut short, some ranks' newer,
            # leaves this file and every rank's previous one).
            saved = {"client_state": client_state or {}, "global_steps": steps,
                     # The module's buffers (BatchNorm's statistics), rank 0's,
                     # as DeepSpeed's module state holds them.
                     "buffers": {k: b.detach().to("cpu", copy=True)
                                 for k, b in _persistent_buffers(e._model).items()},
                     "skipped_steps": e.counts["skipped"] + getattr(self, "_skipped_before", 0),
                     "param_groups": groups, "restore_steps": written["steps"]}
            scheduler = getattr(self, "_lr_scheduler", None)
            if scheduler is not None:  # (offloadd.deepspeed.initialize's, as DeepSpeed's)
                saved["lr_scheduler"] = scheduler.state_dict()
            _replace_file(os.path.join(save_dir, tag + self._CLIENT_STATE),
                          lambda f: torch.save(saved, f))
            if save_latest:
                _replace_file(os.path.join(save_dir, "latest"), lambda f: f.write(tag.encode()))
        e.on_rank0(write, f"{tag}{self._CLIENT_STATE} or latest in {save_dir} (save_checkpoint)")
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """DeepSpeed's engine method: the checkpoint save_checkpoint wrote
        in load_dir/tag (tag: load_dir/latest's) restored, the weights, the
        optimizer state, the step counts and the param groups'
        hyperparameters; returns (its path, the client_state saved with it),
        or (None, None) where load_dir has no latest tag, as DeepSpeed's. The
        module's buffers (rank 0's at the save: BatchNorm's statistics) are
        restored too; load_module_strict=False loads those both the model and
        the checkpoint have.
        Every rank calls it. The lr scheduler of offloadd.deepspeed's engine
        is restored with it (load_lr_scheduler_states); one of the user's
        own: save its state_dict in client_state. The pool
        holds the model's state twice while it loads; where it cannot, wrap()
        with zero_config restore_from=load_dir/tag instead."""
        if load_module_only or not load_optimizer_states or custom_load_fn is not None:
            raise offloadd.InvalidArgumentError(
                "load_checkpoint: offloadd's checkpoints restore the weights with the optimizer "
                "state (load_module_only, load_optimizer_states=False and custom_load_fn are "
                "not taken): for the weights alone, load a model.state_dict() (one "
                "save_16bit_model() saved, or `offloadctl export` of the checkpoint)")
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                warnings.warn(f"load_checkpoint: no {latest}: nothing loaded", stacklevel=2)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, str(tag))
        if not os.path.isdir(path):
            raise offloadd.NotFoundError(f"load_checkpoint: no checkpoint in {path}")
        # Read before anything changes (a file that does not load leaves the
        # job as it was).
        extra = os.path.join(load_dir, str(tag) + self._CLIENT_STATE)
        saved = torch.load(extra, map_location="cpu") if os.path.isfile(extra) else {}
        buffers = _persistent_buffers(self._engine._model)
        theirs = saved.get("buffers", {})
        for k in sorted(set(buffers) ^ set(theirs)) if "buffers" in saved else []:
            if load_module_strict:
                raise offloadd.InvalidArgumentError(
                    f"load_checkpoint: buffer '{k}' is "
                    f"{'not in the checkpoint' if k in buffers else 'not in the model'} "
                    "(load_module_strict=False loads the buffers both have)")
        for k in set(buffers) & set(theirs):
            if buffers[k].shape != theirs[k].shape:
                raise offloadd.InvalidArgumentError(
                    f"load_checkpoint: buffer '{k}' is {tuple(theirs[k].shape)} in the "
                    f"checkpoint, {tuple(buffers[k].shape)} in the model")
        step = self._engine.restore_checkpoint(path, saved.get("restore_steps"))
        with torch.no_grad():
            for k in set(buffers) & set(theirs):
                buffers[k].copy_(theirs[k])
        self._micro_steps = 0
        # The updates counted on from the checkpoint's (DeepSpeed's
        # global_steps; without the file, the restored step).
        self._steps_before = saved.get("global_steps", step) - self._engine.counts["steps"]
        self._skipped_before = saved.get("skipped_steps", 0) - self._engine.counts["skipped"]
        scheduler = getattr(self, "_lr_scheduler", None)
        if (scheduler is not None and load_lr_scheduler_states and
                saved.get("lr_scheduler") is not None):
            scheduler.load_state_dict(saved["lr_scheduler"])
        groups = saved.get("param_groups")
        if groups is not None:
            if len(groups) == len(self.param_groups):
                for mine, theirs in zip(self.param_groups, groups):
                    mine.update(theirs)
            else:
                warnings.warn(f"load_checkpoint: {len(groups)} param groups saved, "
                              f"{len(self.param_groups)} here: their hyperparameters not loaded",
                              stacklevel=2)
        return path, saved.get("client_state", {})

    def wait_checkpoint(self):
        """The outcome of this rank's background checkpoint, once written."""
        return self._engine.session.wait_checkpoint()

    def wait_overlapped(self):
        """The overlapped step still running, if one is, has ended (its
        outcome in last_finished)."""
        if self._overlapped:
            self._overlapped = False
            self.last_finished = self._engine.session.wait_step()
            if self._engine.tier is not None:
                self._engine.tier.step_running(False)

    def _settle(self):
        """Before a step, or the optimizer state read or written: the
        overlapped step has ended, and nothing of this iteration is in
        flight."""
        self.wait_overlapped()
        self._engine.free_all()
        self._engine.flush_gradients()

    def state_dict(self):
        """torch.optim.AdamW's state_dict, read from the daemon: for each
        parameter that has been stepped, its step count and both moments
        whole (fp32, on the CPU), and the param groups' hyperparameters. A
        collective: every rank calls it (each rank's daemon holds a slice of
        each moment). torch.save() it; this
        optimizer's load_state_dict() and torch.optim.AdamW's take it.
        offloadd's own checkpoints (checkpoint()) are faster and hold the
        fp32 master weights too."""
        e = self._engine
        self._settle()
        state, groups, index = {}, [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            for p in g["params"]:
                s = e.by_param[id(p)]
                step, exp_avg, exp_avg_sq = self._moments_of(s)
                if step > 0:
                    state[index] = {"step": torch.tensor(float(step)), "exp_avg": exp_avg,
                                    "exp_avg_sq": exp_avg_sq}
                index += 1
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def _moments_of(self, s):
        """(step, exp_avg, exp_avg_sq) of shard `s`, whole (gathered)."""
        step, (exp_avg, exp_avg_sq) = self._engine.read_state(s)
        return step, exp_avg, exp_avg_sq

    def load_state_dict(self, state_dict):
        """Takes a state_dict() of this optimizer or of torch.optim.AdamW
        (or Adam) for the same parameters in the same groups: each rank
        writes its slice of each parameter's moments and its step count into
        its daemon (a parameter with no state starts afresh, as in torch),
        and the groups take the saved hyperparameters (lr, betas, eps,
        weight decay). Every rank calls it. The weights are the model's
        (model.load_state_dict)."""
        e = self._engine
        groups = state_dict["param_groups"]
        # (A parameter whose state is {}, as reading torch's opt.state[p]
        # leaves it, has none: it starts afresh.)
        saved = {k: v for k, v in state_dict["state"].items() if v}
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise offloadd.InvalidArgumentError(
                "optimizer state_dict: its param groups have "
                f"{[len(g['params']) for g in groups]} parameters, this optimizer's "
                f"{[len(g['params']) for g in self.param_groups]}")
        for g in groups:
            _check_group(g, "optimizer state_dict")
        # Every shape checked before anything is written: a mismatch leaves
        # the state as it was.
        for g, mine in zip(groups, self.param_groups):
            for old, p in zip(g["params"], mine["params"]):
                st, s = saved.get(old), e.by_param[id(p)]
                for key in ("exp_avg", "exp_avg_sq") if st is not None else ():
                    if tuple(st[key].shape) != tuple(s.shape):
                        raise offloadd.InvalidArgumentError(
                            f"optimizer state_dict: {key} of '{s.name}' has shape "
                            f"{tuple(st[key].shape)}, the parameter {tuple(s.shape)}")
                # (As the daemon checks each rank's slice: checked whole
                # here, so that no rank writes before another refuses.)
                if st is not None and not (
                        bool(torch.isfinite(st["exp_avg"]).all())
                        and bool(torch.isfinite(st["exp_avg_sq"]).all())
                        and bool((st["exp_avg_sq"] >= 0).all())
                        and 0 <= float(st["step"]) < 2 ** 63):
                    raise offloadd.InvalidArgumentError(
                        f"optimizer state_dict: the state of '{s.name}' is not one a step can "
                        "take (a non-finite moment, a negative second moment, or a step count "
                        "out of range)")
        self._settle()
        delayed = e.delayed_update_on()
        if delayed:
            e.session.set_delayed_update(False)  # (switched on again below)
        try:
            for g, mine in zip(groups, self.param_groups):
                for old, p in zip(g["params"], mine["params"]):
                    self._write_moments(e.by_param[id(p)], saved.get(old))
        finally:
            if delayed:
                e.session.set_delayed_update(True)
        # The saved group as torch takes it: every key but the parameters
        # (an lr scheduler's initial_lr, a user's own, torch's flags), this
        # optimizer's adamw kept where the saved one (torch's) has none.
        for g, mine in zip(groups, self.param_groups):
            for k, v in g.items():
                if k != "params":
                    mine[k] = v

    def _write_moments(self, s, st):
        e = self._engine
        pieces, step = [], 0
        for key in ("exp_avg", "exp_avg_sq"):
            piece = torch.zeros(s.slice_numel, dtype=torch.float32)  # no state: afresh
            if st is not None:
                piece = e._my_slice(s, st[key])  # (its shape checked by load_state_dict)
            pieces.append(piece.numpy())
        if st is not None:
            step = int(float(st["step"]))
        e.session.write_moments(s.pid, step, 0, pieces[0], pieces[1])

    def close(self):
        """Waits for an overlapped step, then closes this rank's daemon
        session (the process's exit does too). Called while an exception
        propagates (a `finally`), or when the step it waits for failed, the
        job did not finish: with resume "auto", its automatic checkpoints
        stay for the restart; otherwise they go."""
        finished = sys.exc_info()[0] is None
        try:
            self.wait_overlapped()
        except BaseException:
            finished = False
            raise
        finally:
            self._engine.close(finished=finished)


_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "adamw", "params"}


class GatheredParameters:
    """DeepSpeed's zero.GatheredParameters for a wrapped model: inside the
    context the parameters have their whole values (every rank enters it:
    a collective), as they do inside their module's forward; on leaving,
    with modifier_rank (a rank of the model's process group), the named
    parameters as that rank has them become every rank's (their master
    weights and working copy), as a load_state_dict writes them, whether
    changed in place or through .data; without one (or on an exception),
    changes are dropped. Only the parameters named are gathered (as for a
    load, outside the GPU tier's slab: the others have no values inside,
    as under DeepSpeed), and the delayed update is drained first (as
    state_dict() drains it); not inside a forward, nor nested. Tensors
    offloadd does not hold are left as they are."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self._params = [p for p in (params or []) if p is not None]
        self._modifier = modifier_rank
        self._enabled = enabled
        self._engines = []

    def __enter__(self):
        if not self._enabled:
            return self
        # Each engine once, in the order of the parameters named (the same
        # on every rank: their gathers are collectives), its named ones in
        # that order.
        named, _ = _by_engine(self._params)
        self._engines = list(named)
        for e in self._engines:
            if e._forward_depth > 0 or getattr(e, "_loading", False):
                self._engines = []
                raise offloadd.FailedPreconditionError(
                    "GatheredParameters inside a forward of the wrapped model, or inside "
                    "another GatheredParameters or load: use it between iterations")
        for e in self._engines:
            e.gather_for_load(named[e])
        return self

    def __exit__(self, *exc):
        engines, self._engines = self._engines, []
        refused = []
        for e in engines:
            if e.closed:
                continue
            named = {e.by_param[id(p)].pid for p in self._params if id(p) in e.by_param}
            # Values of another shape given (p.data = a larger tensor: the
            # first rows kept silently, a smaller one a bare torch error):
            # refused on every rank, nothing written.
            resized = [f"'{e.by_param[id(p)].name}' {tuple(p.data.shape)} (its shape "
                       f"{tuple(e.by_param[id(p)].shape)})" for p in self._params
                       if id(p) in e.by_param and p.data.shape != e.by_param[id(p)].shape]
            # (Every rank asks, one whose body raised too: all drop the
            # changes together.)
            if self._modifier is not None and not e.all_ranks_ok(
                    exc[0] is None and not resized, "agreement on a GatheredParameters' values"):
                if exc[0] is None:
                    refused += resized or ["a parameter on another rank (or its block raised there)"]
                    exc = (offloadd.InvalidArgumentError,)
            if exc[0] is not None or self._modifier is None:
                # Nothing written: what the context changed is dropped.
                e._load_versions = {s.pid: s.param._version for s in e.shards
                                    if s.pid in e._load_versions}
                named = set()
            elif e.world > 1:
                src = self._modifier
                if e.group is not None and e.group is not dist.group.WORLD:
                    src = dist.distributed_c10d._get_global_rank(e.group, src)
                for p in self._params:
                    if id(p) in e.by_param:
                        e._collective("broadcast of a gathered parameter",
                                      lambda p=p: dist.broadcast(p.data, src=src, group=e.group))
            e.write_loaded(found=named)
        if refused:
            raise offloadd.InvalidArgumentError(
                "GatheredParameters: values of another shape given to " + ", ".join(refused) +
                ": offloadd holds each parameter at its shape (nothing was written; to resize "
                "one, replace its module before wrap())")
        return False


def _holds_checkpoint(directory):
    """Whether `directory` (None: none) holds a checkpoint's manifest."""
    return bool(directory) and bool(
        glob.glob(os.path.join(glob.escape(directory), "*.manifest")))


def _buffers_file(directory, steps):
    """Where optimizer.checkpoint(directory) keeps the module's buffers of
    `steps` ("" for the files' common prefix)."""
    return f"{os.path.abspath(directory)}.buffers.{steps}" + (".pt" if steps != "" else "")


def _restore_buffers(model, directory, step):
    """The module's buffers optimizer.checkpoint(directory) kept beside it
    of the step restored, into `model`; a checkpoint of another step (the
    one kept before the latest) without them, a file that does not load, or
    buffers the model has not: said, the model's own kept."""
    if not glob.glob(glob.escape(_buffers_file(directory, "")) + "*.pt"):
        return  # (a model without buffers, or a checkpoint from before)
    path = _buffers_file(directory, step)
    try:
        saved = torch.load(path, map_location="cpu")
    except Exception as exc:
        warnings.warn(f"restore_from {directory}: the module's buffers of step {step} do not "
                      f"load ({exc}): the model's own kept", stacklevel=3)
        return
    mine = _persistent_buffers(model)
    skipped = [k for k, v in saved["buffers"].items()
               if k not in mine or mine[k].shape != v.shape]
    if skipped:
        warnings.warn(f"restore_from {directory}: buffers {skipped} saved are not the model's "
                      "(or of another shape): not loaded", stacklevel=3)
    with torch.no_grad():
        for k, v in saved["buffers"].items():
            if k in mine and mine[k].shape == v.shape:
                mine[k].copy_(v)


def _persistent_buffers(model):
    """`model`'s buffers that its state_dict() holds, by their names there."""
    out = {}
    for name, m in model.named_modules():
        for k, b in m._buffers.items():
            if b is not None and k not in m._non_persistent_buffers_set:
                out[f"{name}.{k}" if name else k] = b
    return out


class _DeepSpeedSettings:
    """What DeepSpeed's engine answers about its job and its last step,
    for a model wrapped with a deepspeed_config (its methods are the
    model's too) and DeepSpeedEngine."""

    # The methods wrap() gives the model besides the optimizer's.
    ASKED = ("get_lr", "get_mom", "get_global_grad_norm", "was_step_applied",
             "train_batch_size", "train_micro_batch_size_per_gpu",
             "gradient_accumulation_steps", "gradient_clipping", "zero_optimization_stage",
             "fp16_enabled", "bfloat16_enabled", "save_16bit_model", "save_fp16_model")

    def __init__(self, batch_sizes, config, engine):
        self._batch, self._micro = batch_sizes
        self._config = config
        self._engine = engine

    @property
    def _optimizer(self):
        return self._engine._optimizer

    def get_lr(self):
        return [g["lr"] for g in self._optimizer.param_groups]

    def get_mom(self):
        return [g["betas"] for g in self._optimizer.param_groups]

    def get_global_grad_norm(self):
        """The gradient norm of the last update (before clipping; inf where
        it overflowed), None before any."""
        last = self._optimizer.last_step
        return None if last is None else last["grad_norm"]

    def was_step_applied(self):
        """Whether the last step() updated the weights (not a micro-batch
        inside the accumulation, nor a step skipped for an fp16 overflow)."""
        return self._optimizer._step_applied

    def gradient_accumulation_steps(self):
        return self._config["gradient_accumulation_steps"]

    def train_micro_batch_size_per_gpu(self):
        return self._micro

    def train_batch_size(self):
        return self._batch

    def gradient_clipping(self):
        return self._config["gradient_clipping"]

    def zero_optimization_stage(self):
        return 3

    def fp16_enabled(self):
        return self._config["working_dtype"] == "fp16"

    def bfloat16_enabled(self):
        return self._config["working_dtype"] == "bf16"

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """The model's weights (model.state_dict(), gathered whole, in its
        working dtype) saved by rank 0 as save_dir/save_filename; every rank
        calls it. Returns True. (DeepSpeed's ZeRO-3 saves only with
        stage3_gather_16bit_weights_on_model_save; offloadd always can.)"""
        e = self._engine
        state = e._model.state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in e._model.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        def write():
            os.makedirs(save_dir, exist_ok=True)
            _replace_file(os.path.join(save_dir, save_filename), lambda f: torch.save(state, f))
        e.on_rank0(write, f"{save_filename} in {save_dir} (save_16bit_model)")
        return True

    save_fp16_model = save_16bit_model  # (DeepSpeed's older name)


def _to_half(x):
    """`x` with its floating-point tensors in fp16 (through tuples, lists
    and dicts), as DeepSpeed's engine casts its inputs with auto_cast."""
    if isinstance(x, torch.Tensor):
        return x.half() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_to_half(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_half(v) for k, v in x.items()}
    return x


class DeepSpeedEngine(torch.nn.Module):
    """DeepSpeed's engine over a wrapped model: what
    offloadd.deepspeed.initialize returns, as deepspeed.initialize returns
    its DeepSpeedEngine. engine(x) runs the model (engine.module);
    backward(loss) scales the loss (fp16, accumulation); step() after every
    micro-batch updates at the accumulation boundary and then steps the lr
    scheduler where the update was applied (not for an fp16 overflow), as
    DeepSpeed's engine does; save_checkpoint/load_checkpoint hold the lr
    scheduler's state too; the counters (global_steps, global_samples,
    micro_steps, skipped_steps) and settings (train_batch_size(), get_lr(),
    ...) are DeepSpeed's."""

    def __init__(self, model, optimizer, lr_scheduler=None, client=None, config=None,
                 auto_cast=False):
        if getattr(optimizer, "_deepspeed", None) is None:
            raise offloadd.InvalidArgumentError(
                "DeepSpeedEngine runs over a model wrapped with a deepspeed_config "
                "(offloadd.deepspeed.initialize makes both)")
        super().__init__()
        self.module = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        optimizer._lr_scheduler = lr_scheduler
        self.micro_steps = 0
        self._client = client  # the client optimizer whose param groups offloadd steps
        self._auto_cast = auto_cast  # fp16.auto_cast: floating-point inputs cast to fp16

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _DeepSpeedSettings.ASKED:
                return getattr(self.optimizer._deepspeed, name)
            raise

    def forward(self, *args, **kwargs):
        if self._auto_cast:
            args, kwargs = _to_half((args, kwargs))
        return self.module(*args, **kwargs)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """The loss's backward, scaled as DeepSpeed's engine scales it;
        returns the loss divided by the accumulation steps (scale_wrt_gas),
        as DeepSpeed's does."""
        self.optimizer.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        gas = self.optimizer._config["gradient_accumulation_steps"]
        return loss / gas if scale_wrt_gas and gas > 1 else loss

    def step(self, lr_kwargs=None):
        self.micro_steps += 1
        self.optimizer.step()
        if self.optimizer._step_applied:
            if self._client is not None:
                # A torch scheduler made on the client optimizer counts
                # its steps (it warns of a scheduler stepped before any).
                self._client._step_count = getattr(self._client, "_step_count", 0) + 1
                self._client._opt_called = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))

    def is_gradient_accumulation_boundary(self):
        return self.optimizer.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Whether the next step() updates, instead of counting micro-batches
        (DeepSpeed's; None counts again)."""
        self.optimizer._forced_boundary = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        raise offloadd.FailedPreconditionError(
            "no_sync: ZeRO stage 3 partitions gradients as they come (DeepSpeed refuses it too); "
            "accumulate with gradient_accumulation_steps instead")
        yield  # (a generator)

    def destroy(self):
        """Closes the job's session (DeepSpeed's engine.destroy())."""
        self.optimizer.close()

    def dynamic_loss_scale(self):
        return self.optimizer._config["loss_scaling"] is not None

    def get_data_parallel_world_size(self):
        return self.world_size

    @property
    def dp_world_size(self):
        return self.world_size

    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True,
                     data_sampler=None, collate_fn=None, num_local_io_workers=None):
        """A data loader of `dataset` by micro-batches, as initialize()'s."""
        from offloadd import deepspeed
        return deepspeed.data_loader(
            dataset, batch_size or self.train_micro_batch_size_per_gpu(), collate_fn,
            data_sampler=data_sampler, pin_memory=pin_memory)

    def zero_grad(self, set_to_none=None):
        self.optimizer.zero_grad(set_to_none)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        return self.optimizer.save_checkpoint(save_dir, tag, client_state, save_latest,
                                              exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        return self.optimizer.load_checkpoint(
            load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
            load_module_only, custom_load_fn)

    def module_state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)

    @property
    def global_steps(self):
        return self.optimizer.global_steps

    @global_steps.setter
    def global_steps(self, steps):  # (DeepSpeed's is an attribute a script may set)
        o = self.optimizer
        o._steps_before = int(steps) - o.engine.counts["steps"]

    @property
    def global_samples(self):
        batch = self.optimizer._deepspeed.train_batch_size()
        return self.optimizer.global_steps * (batch or 0)

    @property
    def skipped_steps(self):
        o = self.optimizer
        return o.engine.counts["skipped"] + getattr(o, "_skipped_before", 0)

    @property
    def global_rank(self):
        return self.optimizer.engine.rank

    @property
    def world_size(self):
        return self.optimizer.engine.world

    @property
    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def device(self):
        return self.optimizer.engine.shards[0].device if self.optimizer.engine.shards else None


def _restore_steps(z):
    """zero_config's restore_steps: None, or a step count of restore_from's."""
    steps = z.get("restore_steps")
    if steps is None:
        return None
    if not z.get("restore_from"):
        raise offloadd.InvalidArgumentError("restore_steps needs restore_from")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise offloadd.InvalidArgumentError(
            f"restore_steps must be a step count (an int >= 0), got {steps!r}")
    return steps
_ZERO_KEYS = {"address", "session_name", "placement", "gradient_clipping",
              "gradient_accumulation_steps", "loss_scaling", "static_loss_scale",
              "delayed_update", "overlap_step", "working_dtype", "node_tunables",
              "restore_from", "restore_steps", "gradient_stats", "gpu", "reduce_bucket_elements",
              "share_weight", "resume", "state_dict"}
_GPU_KEYS = {"tier", "device", "budget_bytes", "prefetch_depth", "prefetch_elements",
             "persistence_threshold", "max_live_parameters", "max_reuse_distance",
             "staging_bytes"}


def _check_keys(section, d, allowed):
    for k in d:
        if k not in allowed:
            raise offloadd.InvalidArgumentError(
                f"{section}: unknown field '{k}' (known: {', '.join(sorted(allowed))})")


def _zero_defaults(zero_config):
    z = dict(zero_config or {})
    _check_keys("zero_config", z, _ZERO_KEYS)
    placement = dict(z.get("placement") or {})
    _check_keys("zero_config.placement", placement, {"params", "grads", "optimizer_state"})
    ga = z.get("gradient_accumulation_steps", 1)
    if isinstance(ga, bool) or not isinstance(ga, int) or ga < 1:
        raise offloadd.InvalidArgumentError(
            f"gradient_accumulation_steps must be a positive integer, got {ga!r}")
    clip = float(z.get("gradient_clipping") or 0.0)
    if clip < 0 or not math.isfinite(clip):
        raise offloadd.InvalidArgumentError(f"gradient_clipping must be >= 0, got {clip}")
    dpu = z.get("delayed_update", False)
    after = None
    if dpu is True:
        after = 0
    elif dpu is not False and dpu is not None:
        if isinstance(dpu, bool) or not isinstance(dpu, int) or dpu < 0:
            raise offloadd.InvalidArgumentError(
                "delayed_update: false, true, or the number of steps before it starts, "
                f"got {dpu!r}")
        after = dpu
    working = z.get("working_dtype", "fp32")
    if working not in _DTYPES:
        raise offloadd.InvalidArgumentError(
            f"working_dtype must be fp32, bf16 or fp16, got {working!r}")
    stats = z.get("gradient_stats", "auto")
    if stats not in ("auto", "trainer", "daemon"):
        raise offloadd.InvalidArgumentError(
            f"gradient_stats must be auto, trainer or daemon, got {stats!r}")
    gpu = dict(z.get("gpu") or {})
    _check_keys("zero_config.gpu", gpu, _GPU_KEYS)
    if gpu.get("tier", "auto") not in ("auto", True, False):
        raise offloadd.InvalidArgumentError(
            f"gpu.tier must be auto, true or false, got {gpu['tier']!r}")
    device = gpu.get("device")
    if device is not None and not (device in ("emulated", "cuda") or (
            isinstance(device, str) and re.fullmatch(r"cuda:\d+", device))):
        raise offloadd.InvalidArgumentError(
            f"gpu.device must be 'cuda', 'cuda:N' or 'emulated', got {device!r}")
    for k in _GPU_KEYS - {"tier", "device"}:
        v = gpu.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise offloadd.InvalidArgumentError(f"gpu.{k} must be an integer >= 0, got {v!r}")
    if gpu.get("budget_bytes") == 0:
        raise offloadd.InvalidArgumentError("gpu.budget_bytes must be > 0")
    share = z.get("share_weight", 1)
    if isinstance(share, bool) or not isinstance(share, int) or not 1 <= share <= 1000:
        raise offloadd.InvalidArgumentError(
            f"share_weight must be an integer in [1, 1000], got {share!r}")
    bucket = z.get("reduce_bucket_elements", 1 << 24)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise offloadd.InvalidArgumentError(
            f"reduce_bucket_elements must be a positive integer, got {bucket!r}")
    weights = z.get("state_dict", "working")
    if weights not in ("working", "master"):
        raise offloadd.InvalidArgumentError(
            f"state_dict must be 'working' or 'master', got {weights!r}")
    resume = z.get("resume", False)
    if resume not in (False, None, "auto"):
        raise offloadd.InvalidArgumentError(f"resume must be 'auto' or false, got {resume!r}")
    if resume and z.get("restore_from"):
        raise offloadd.InvalidArgumentError("resume 'auto' and restore_from exclude each other")
    static = z.get("static_loss_scale")
    if static is not None and (not isinstance(static, (int, float)) or static <= 0):
        raise offloadd.InvalidArgumentError(f"static_loss_scale must be > 0, got {static!r}")
    if static is not None and z.get("loss_scaling") is not None:
        raise offloadd.InvalidArgumentError(
            "loss_scaling (dynamic) and static_loss_scale exclude each other")
    return {
        "address": z.get("address", ""),
        "session_name": z.get("session_name", "torch"),
        "placement": placement,
        "gradient_clipping": clip,
        "gradient_accumulation_steps": ga,
        "loss_scaling": z.get("loss_scaling"),
        "static_loss_scale": float(static) if static else None,
        "delayed_update_after_steps": after,
        "overlap_step": bool(z.get("overlap_step", False)),
        "working_dtype": working,
        "gradient_stats": stats,
        "gpu": gpu,
        "reduce_bucket_elements": bucket,
        "share_weight": share,
        "node_tunables": dict(z.get("node_tunables") or {}),
        "restore_from": os.path.abspath(z["restore_from"]) if z.get("restore_from") else "",
        "restore_steps": _restore_steps(z),
        "resume": "auto" if resume else False,
        "state_dict": weights,
    }


def wrap(model, adamw_config=None, zero_config=None, *, deepspeed_config=None,
         process_group=None):
    """Partitions `model`'s parameters into the node's offloadd and returns
    (model, optimizer).

    adamw_config: torch.optim.AdamW's arguments (lr, betas, eps,
      weight_decay) and adamw (False: torch.optim.Adam's L2 decay); "params"
      may hold torch-style param groups (dicts with "params" and overrides).
    zero_config:
      address                     the daemon (default $OFFLOADD_ADDRESS or its socket)
      session_name                this job's sessions are named <session_name>/rank<r>
                                  (default "torch"); resume finds them by it
      placement                   {"params"|"grads"|"optimizer_state": "host", "nvme" or a host percent}
      gradient_clipping           global max norm (0: off)
      gradient_accumulation_steps micro-batches per step: backward() divides the loss by it
      loss_scaling                fp16 dynamic loss scaling: {} for the defaults, or
                                  initial_scale, growth_interval, growth_factor,
                                  backoff_factor, hysteresis, min_scale
      static_loss_scale           a fixed loss scale instead
      delayed_update              True, or the number of steps after which the
                                  step of iteration i overlaps iteration i+1 (one step stale;
                                  step() returns at once, as with overlap_step); state_dict()
                                  drains it first and returns the newest weights (call
                                  optimizer.drain() before evaluating for the same)
      state_dict                  what model.state_dict() returns for each parameter, on the
                                  CPU: "working" (default: the working copy, in working_dtype,
                                  gathered) or "master" (the fp32 master weights: exact where a
                                  bf16/fp16 working copy is rounded; the newest, also with the
                                  delayed update, without draining it)
      overlap_step                step() returns at once; a fetch waits for its own partition
      working_dtype               fp32 (default), bf16 or fp16: the dtype offloadd keeps the
                                  working copy in (and gathers); the master stays fp32
      gradient_stats              with one micro-batch per step, who measures each returned
                                  gradient (squared norm, non-finite count): "trainer" (torch,
                                  where the gradient is, before its copy to the host), "daemon"
                                  (reads the buffer), "auto" (default: trainer on CUDA)
      gpu                         the GPU tier, where the parameters are on a CUDA device:
                                  tier (auto: on there; true; false), device ("cuda:N", or
                                  "emulated" to run it on the CPU), budget_bytes (GPU memory for
                                  parameters; default the model's, at most 40% of what is free),
                                  prefetch_depth (modules ahead, 2), prefetch_elements,
                                  persistence_threshold, max_live_parameters (at least the
                                  largest module's), max_reuse_distance (elements, as
                                  DeepSpeed's stage3_* settings), staging_bytes
      reduce_bucket_elements      with several ranks, gradients are averaged across ranks in one
                                  collective per bucket of this many elements (full gradients,
                                  as DeepSpeed's reduce_bucket_size; default 16M: a buffer of
                                  64 MiB of fp32 on the device the collective runs on)
      share_weight                this job's weight in the node's optimizer, NVMe I/O and pool
                                  (1-1000, default 1): when several jobs step at once, each gets
                                  updates, the disk when they wait for it, and the pool's traffic
                                  when they want more room than it holds, in proportion
                                  (offloadctl share ID WEIGHT changes it live)
      node_tunables               {name: value} node-wide daemon settings to set, as
                                  offloadctl config set NAME VALUE does (values: numbers,
                                  booleans or strings such as "64MiB")
      restore_from                a directory optimizer.checkpoint() wrote: the parameters,
                                  optimizer state, steps and loss scale come from it (the
                                  model's own values are not used); any number of ranks
      restore_steps               with restore_from: its checkpoints taken after that many
                                  steps (where its ranks' latest differ, the error names
                                  the step they all hold, if any)
      resume                      "auto": go on from what this job's sessions (by session_name
                                  and rank) left in offloadd's automatic checkpoints when it
                                  died, at the newest step every rank has; model.offloadd.
                                  resumed_step says which (0: nothing to go on from, a new
                                  job). With several ranks, a crash of offloadd ends every rank
                                  with an error: restart the job (torchrun --max-restarts) and
                                  it resumes here. One rank also resumes without a restart
                                  (SessionRestored). A rank that dies leaves its checkpoints too
                                  (its sessions go unfinished); optimizer.close() or a normal
                                  exit removes them, one during an exception leaves them
    deepspeed_config: a DeepSpeed config (dict or JSON path) instead of
      zero_config, and of adamw_config where it has an optimizer section (a
      config without one takes adamw_config, as deepspeed.initialize takes a
      client optimizer); see offloadd.deepspeed. The loop then runs as DeepSpeed's:
      step() after every micro-batch updates at every
      gradient_accumulation_steps-th (zero_grad() in between keeps what
      accumulated), and the model takes backward(loss), step(),
      is_gradient_accumulation_boundary(), save_checkpoint(dir, tag,
      client_state) and load_checkpoint(dir, tag) -> (path, client_state) as
      DeepSpeed's engine does (offloadd's own checkpoints; an lr scheduler
      made on the optimizer is the user's: save its state_dict in
      client_state; initialize()'s engine keeps its own), and answers
      get_lr(), was_step_applied(), train_batch_size(), save_16bit_model()
      ... as the engine's. With fp16 or bf16 enabled the model is converted
      to it first (module.half(), .bfloat16(), as DeepSpeed's engine does),
      and each update steps every trainable parameter (one no backward
      reached with a zero gradient: DeepSpeed steps its whole partition).
      offloadd.deepspeed.initialize() returns a DeepSpeedEngine over it, as
      deepspeed.initialize does.
    """
    if deepspeed_config is not None:
        if zero_config is not None:
            raise offloadd.InvalidArgumentError(
                "pass either deepspeed_config or zero_config, not both")
        from offloadd import deepspeed
        world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        translation = deepspeed.translate(deepspeed_config, world)
        ds_adamw, zero_config = deepspeed.from_translation(translation)
        # As deepspeed.initialize: the config's optimizer, or the client's;
        # the parameters (groups) to train may come with the config's
        # (initialize's model_parameters).
        if ds_adamw and adamw_config is not None:
            if set(adamw_config) - {"params"}:
                raise offloadd.InvalidArgumentError(
                    "the DeepSpeed config has an optimizer section: pass adamw_config (beyond "
                    "its params) only for a config without one (as DeepSpeed takes a client "
                    "optimizer)")
            ds_adamw = dict(ds_adamw, **adamw_config)
        if not ds_adamw and adamw_config is None:
            raise offloadd.InvalidArgumentError(
                "the DeepSpeed config has no optimizer section: give it one, or pass "
                "adamw_config (the optimizer deepspeed.initialize would be given)")
        adamw_config = ds_adamw or adamw_config
    config = _zero_defaults(zero_config)
    # A DeepSpeed loop calls step() after every micro-batch; the engine steps
    # at the accumulation boundary only (and the model takes backward(),
    # step() and is_gradient_accumulation_boundary() as DeepSpeed's engine).
    config["deepspeed_loop"] = deepspeed_config is not None
    a = dict(adamw_config or {})
    _check_keys("adamw_config", a, _ADAM_KEYS)
    adamw = a.get("adamw", True)
    # torch.optim.AdamW's defaults, or torch.optim.Adam's (no weight decay).
    defaults = {"lr": a.get("lr", 1e-3), "betas": tuple(a.get("betas", (0.9, 0.999))),
                "eps": a.get("eps", 1e-8), "weight_decay": a.get("weight_decay",
                                                                0.01 if adamw else 0.0),
                "adamw": adamw}
    if hasattr(model, "offloadd"):
        if model.offloadd.closed:
            raise offloadd.FailedPreconditionError(_CLOSED)
        raise offloadd.InvalidArgumentError("the model is wrapped already")
    for name, q in model.named_parameters():
        if getattr(q, "_offloadd_shard", None) is not None:
            raise offloadd.InvalidArgumentError(
                f"parameter '{name}' belongs to a model wrapped already (a module shared with "
                "it, or one of its submodules): one wrap() holds a parameter; wrap the model "
                "that holds them all")
    # As torch.optim takes them: tensors, or dicts of param groups.
    groups = list(a["params"]) if "params" in a else list(model.parameters())
    # DeepSpeed's engine converts the model to fp16 or bf16 (module.half(),
    # .bfloat16()): it computes in that dtype, and its fp32 master weights
    # start from the converted values. (Undone if wrap fails.)
    unconvert = None
    if deepspeed_config is not None and config["working_dtype"] != "fp32":
        unconvert = _convert_model(model, _DTYPES[config["working_dtype"]])
    try:
        engine = _Engine(model, config, process_group)
    except offloadd.FailedPreconditionError as e:
        if unconvert is not None:
            unconvert()
        if deepspeed_config is not None and translation.nvme_path and "NVMe" in str(e):
            raise type(e)(f"{e} (the DeepSpeed config's nvme_path "
                          f"{translation.nvme_path!r} is not used: the NVMe tier is the "
                          "daemon's, its nvme.dirs)") from e
        raise
    except BaseException:
        if unconvert is not None:
            unconvert()
        raise
    try:
        optimizer = Optimizer(engine, groups, defaults, config)
    except BaseException:
        engine.abort()  # the model is as it was
        if unconvert is not None:
            unconvert()
        raise
    engine.commit()
    # First in the model's attributes: pickling or deep-copying the model
    # (torch.save(model), copy.deepcopy) meets it before any hook or
    # parameter, and refuses in words (_Engine.__reduce_ex__).
    attrs = list(model.__dict__.items())
    model.__dict__.clear()
    model.__dict__["offloadd"] = engine
    model.__dict__.update(attrs)
    if config["restore_from"]:
        # The session's step the checkpoint holds (restore_steps', or its
        # latest): what each buffers file is named by.
        steps = config["restore_steps"]
        if steps is None:
            held = offloadd.checkpoint_steps(config["restore_from"],
                                             f"{config['session_name']}/rank{engine.rank}")
            steps = held[0] if held else getattr(engine, "_restored_step", None)
        _restore_buffers(model, config["restore_from"], steps)

    # torch's Module.zero_grad clears p.grad, which offloadd leaves None (the
    # gradients are the daemon's): the model's, as the optimizer's, drops
    # those returned since the last step (a GAN's loop zeroes one net
    # between another's backward through it and its own step).
    def zero_grad(set_to_none=None, _module_zero_grad=model.zero_grad):
        if set_to_none is None:
            set_to_none = _TORCH_SET_TO_NONE
        _module_zero_grad(set_to_none)
        optimizer.zero_grad(set_to_none)
    model.zero_grad = zero_grad
    if config["deepspeed_loop"]:
        optimizer._deepspeed = _DeepSpeedSettings(translation.batch_sizes, config, engine)
        for name in ("backward", "step", "is_gradient_accumulation_boundary", "save_checkpoint",
                     "load_checkpoint") + _DeepSpeedSettings.ASKED:
            if not hasattr(model, name):
                # Looked up at each call: an lr scheduler wraps
                # optimizer.step after wrap() to count the calls.
                target = optimizer if name in Optimizer.__dict__ else optimizer._deepspeed
                setattr(model, name, functools.partial(_call_method, target, name))
            elif name not in _DeepSpeedSettings.ASKED:
                # (model.step() would be the model's own: no update.)
                warnings.warn(f"offloadd.torch.wrap: the model has its own {name}(), kept: "
                              f"call optimizer.{name}() for DeepSpeed's engine method",
                              stacklevel=2)
    return model, optimizer


def _convert_model(model, dtype):
    """`model`'s floating-point parameters and buffers in `dtype`, as
    module.half() and .bfloat16() convert them (complex ones, and integer
    ones, stay); returns what undoes it (it keeps the values as they were
    meanwhile: until wrap() returns, the model's memory 1.5 times over from
    fp32 to 16 bits). A conversion that fails part-way is undone."""
    params = [(p, p.data) for p in model.parameters()]
    buffers = [(m, k, b) for m in model.modules() for k, b in m._buffers.items()
               if b is not None]

    def undo():
        for p, data in params:
            p.data = data
        for m, k, b in buffers:
            m._buffers[k] = b
    try:
        model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    except BaseException:
        undo()
        raise
    return undo
