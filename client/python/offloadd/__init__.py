"""offloadd's Python client: sessions, partitions in shared memory, steps.

    import offloadd, torch
    client = offloadd.Client()                      # $OFFLOADD_ADDRESS or the default socket
    session = client.open_session("rank0")
    p = session.register("w", 1024)                 # held: write the initial values
    torch.frombuffer(p.params, dtype=torch.float32).copy_(initial)
    session.release([p.id])
    g, = session.fetch([p.id], grads=True)          # hold with the gradient buffer
    torch.frombuffer(g.grads, dtype=torch.float32).copy_(grad)
    session.return_gradients(g)
    session.release([g.id])
    session.step(lr=1e-3, weight_decay=0.01)

Partition memory is shared, not copied: `params` and `grads` are memoryviews
over the daemon's arena, valid while the session holds the partition.
Errors are offloadd.Error (with .code) or a subclass: UnavailableError,
ResourceExhaustedError, InvalidArgumentError, FailedPreconditionError,
NotFoundError, PermissionDeniedError, DataLossError.

The GPU tier (offloadd.torch uses it where the model is on a GPU):
open_device("cuda:0" or "emulated") and GpuTier(session, device, ...) put a
session's parameters on the device ahead of use and copy its gradients back
on streams of their own (client/gpu_tier.h).
"""
from ._offloadd import (  # noqa: F401
    Client,
    DataLossError,
    Device,
    GpuTier,
    Error,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    Partition,
    PermissionDeniedError,
    ResourceExhaustedError,
    Session,
    UnavailableError,
    built_with_cuda,
    checkpoint_steps,
    open_device,
)
