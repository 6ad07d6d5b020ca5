"""One trainer rank for tests/torch_wrap_test.py: trains the demo GPT through
offloadd.torch.wrap (or in-process torch.optim.AdamW as the reference) and
writes the loss of every step as JSON.

usage: torch_wrap_worker.py SCENARIO_JSON RANK WORLD INIT_FILE OUT_JSON
The daemon's address comes from $OFFLOADD_ADDRESS."""
import contextlib
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "client", "python", "demo"))
import gpt  # noqa: E402


class TorchEncoderLM(torch.nn.Module):
    """A language model of torch's own transformer layers, whose attention
    reads out_proj.weight without calling out_proj (scenario model
    "torch_encoder")."""

    def __init__(self, vocab, context, dim, layers):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1))

    def forward(self, x, y):
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = self.encoder(h, mask=self.mask[: x.shape[1], : x.shape[1]])
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))


class UniformLM(torch.nn.Module):
    """Every parameter vocab x vocab (scenario model "uniform"): ranks that
    gather different parameters at once do so in collectives of one size,
    which nothing but offloadd's own check tells apart."""

    def __init__(self, vocab, layers):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(vocab, vocab, bias=False) for _ in range(layers)])
        self.head = torch.nn.Linear(vocab, vocab, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class RankBranchLM(torch.nn.Module):
    """A model whose loss takes a different module's output on each rank
    (same shapes; both run in every forward, so the ranks gather alike and
    their backwards differ): what DistributedDataParallel refuses (scenario
    model "rank_branch")."""

    def __init__(self, vocab, dim, rank):
        super().__init__()
        self.rank = rank
        self.emb = torch.nn.Embedding(vocab, dim)
        self.a = torch.nn.Linear(dim, dim)
        self.b = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x, y):
        # (Detached: a's and b's backwards need no weights, so nothing is
        # gathered again in backward, where the ranks would differ first.)
        h = self.emb(x).detach()
        ha, hb = self.a(h), self.b(h)
        h = torch.tanh(ha if self.rank == 0 else hb)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))


def train(sc, rank, world, use_offloadd):
    torch.manual_seed(sc.get("seed", 0))
    device = torch.device(sc.get("device", "cpu"))
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    text = gpt.Text(sc.get("text", "/usr/share/common-licenses/GPL-3"))
    if sc.get("model") == "torch_encoder":
        model = TorchEncoderLM(text.vocab, sc["context"], sc["dim"], sc["layers"]).to(device)
    elif sc.get("model") == "rank_branch":
        model = RankBranchLM(text.vocab, sc["dim"], rank).to(device)
    elif sc.get("model") == "uniform":
        model = UniformLM(text.vocab, sc["layers"]).to(device)
    else:
        model = gpt.GPT(text.vocab, sc["context"], dim=sc["dim"], layers=sc["layers"],
                        heads=2).to(device)
    adamw = {"lr": sc["lr"], "weight_decay": sc["weight_decay"]}
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    groups = [{"params": decay}, {"params": other, "weight_decay": 0.0}]
    if sc.get("one_group"):
        groups = [{"params": list(model.parameters())}]
    ga = sc.get("accumulation", 1)
    clip = sc.get("clip", 0.0)
    if use_offloadd:
        import offloadd.torch
        time.sleep(sc.get("start_delays", [0] * world)[rank])  # ranks opening apart
        zero = dict(sc.get("zero", {}))
        # (With torch_clip, the loop clips as a torch loop does.)
        zero.setdefault("gradient_clipping", 0.0 if sc.get("torch_clip") else clip)
        zero.setdefault("gradient_accumulation_steps", ga)
        if "deepspeed" in sc:
            model, opt = offloadd.torch.wrap(model, deepspeed_config=sc["deepspeed"])
        else:
            model, opt = offloadd.torch.wrap(model, dict(adamw, params=groups), zero)
    else:
        opt = torch.optim.AdamW(groups, **adamw)
    if sc.get("gathered_init"):
        # Hugging Face's initialisation under ZeRO-3: module by module, what
        # rank 0 writes inside GatheredParameters(modifier_rank=0) becomes
        # every rank's (the others write something else, dropped).
        blocks = [model.blocks[0].qkv, model.blocks[0].fc]
        for i, m in enumerate(blocks):
            params = list(m.parameters())
            if use_offloadd:
                import offloadd.deepspeed
                ctx = offloadd.deepspeed.zero.GatheredParameters(params, modifier_rank=0)
            else:
                ctx = contextlib.nullcontext()
            with ctx, torch.no_grad():
                g = torch.Generator().manual_seed(10 + i)
                for q in params:
                    if rank == 0:
                        q.copy_(torch.randn(q.shape, generator=g) * 0.05)
                    else:
                        q.fill_(1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    batch = sc["batch"]
    lo, hi = rank * batch // world, (rank + 1) * batch // world
    # Resuming from a checkpoint at step `start`: the same batches and
    # learning rates as an uninterrupted run from there.
    start = sc.get("start_step", 0)
    if use_offloadd and sc.get("zero", {}).get("resume") == "auto":
        start = model.offloadd.resumed_step  # what the ranks' automatic checkpoints share
        print(f"rank {rank}: resumed at step {start} from {model.offloadd.resumed_from!r}",
              flush=True)
    for _ in range(start):
        for _ in range(ga):
            text.batch(batch, sc["context"], gen)
        sched.step()
    checkpoint_state = None
    for step in range(start, sc["steps"]):
        total = 0.0
        if sc.get("state_dict_on_rank0_at") == step and rank == 0:
            model.state_dict()  # (as a save on rank 0 only; a collective)
        for micro in range(ga):
            x, y = text.batch(batch, sc["context"], gen)
            loss = model(x[lo:hi].to(device), y[lo:hi].to(device))
            if sc.get("kill_at_step") == step and rank == sc.get("kill_rank", 1):
                os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step, before backward
            if use_offloadd and sc.get("deepspeed_loop"):
                # As DeepSpeed users write it: the engine's backward and
                # step after every micro-batch (the update at the boundary).
                boundary = model.is_gradient_accumulation_boundary()
                model.backward(loss)
                model.step()
                if boundary:
                    norms.append(opt.last_step["grad_norm"])
            elif use_offloadd:
                opt.backward(loss)
            else:
                (loss / ga).backward()
            total += loss.item() / ga
        if use_offloadd and sc.get("deepspeed_loop"):
            pass  # (stepped at the boundary above)
        elif use_offloadd and sc.get("torch_clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                model.parameters(), clip if clip else float("inf"))))
            opt.step()
        elif use_offloadd:
            opt.step()
            norms.append(opt.last_step["grad_norm"])
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                model.parameters(), clip if clip else float("inf"))))
            opt.step()
        opt.zero_grad()
        if sc.get("hold_at_step") == step:
            # Stays here (its session open) until the test kills it.
            with open(f"{sc['hold_marker']}.{rank}", "w"):
                pass
            time.sleep(3600)
        time.sleep(sc.get("step_sleep", 0))
        if sc.get("checkpoint_at") == step:
            opt.checkpoint(sc["checkpoint_dir"])
            checkpoint_state = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
        sched.step()
        if world > 1:
            t = torch.tensor([total])
            dist.all_reduce(t)
            total = t.item() / world
        losses.append(total)
    # A fixed evaluation batch, on the final weights.
    with torch.no_grad():
        x, y = text.batch(64, sc["context"], torch.Generator().manual_seed(99))
        final = model(x.to(device), y.to(device)).item()
    state = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
    optimizer_state = None
    if sc.get("optimizer_state"):  # torch's format, whichever optimizer ran
        osd = opt.state_dict()
        optimizer_state = {
            "lrs": [g["lr"] for g in osd["param_groups"]],
            "state": {str(i): {"step": float(st["step"]),
                               "exp_avg": st["exp_avg"].flatten().tolist(),
                               "exp_avg_sq": st["exp_avg_sq"].flatten().tolist()}
                      for i, st in osd["state"].items()}}
    counts = dict(model.offloadd.counts) if use_offloadd else {}
    gpu_stats = model.offloadd.gpu_stats() if use_offloadd else None
    if use_offloadd and not sc.get("no_close"):  # no_close: the exit closes it
        opt.close()
    return {"start": start, "losses": losses, "norms": norms, "final": final, "state": state,
            "checkpoint_state": checkpoint_state, "counts": counts, "gpu": gpu_stats,
            "optimizer_state": optimizer_state}


def main():
    sc = json.loads(sys.argv[1])
    rank, world, init, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    if world > 1:
        backend = "nccl" if sc.get("device") == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="file://" + init, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=30))
    result = train(sc, rank, world, use_offloadd=not sc.get("reference", False))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
