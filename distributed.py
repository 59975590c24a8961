"""
Several processes and resumable runs: what train.py needs beyond one process that runs to the end.

    torchrun --nproc_per_node=2 train.py ...     # setup_distributed joins the process group
    python train.py ...  (again, after a kill)   # load_state continues from the last saved state

Several processes: who am I (world), the wrapped model (parallelize: DDP, or FSDP2 with --fsdp), the
global mean of a value (global_mean), the gathered weights (whole_model), and stopping on a signal at
the same step everywhere (Stopper). Resume: one safetensors state file per stage (state_path,
save_state, load_state), replaced atomically.
"""
import json
import os
import signal
import types

import torch
import torch.distributed as dist

import cli

# ----------------------------------------------------------------------------------------------------
# several processes (torchrun): who am I, the wrapped model, and agreeing on one value


def world():
    """(rank, number of processes): (0, 1) unless torchrun started us and setup_distributed ran."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1



def setup_distributed(args):
    """Join the process group when torchrun started us (it sets WORLD_SIZE, RANK and LOCAL_RANK).

    One GPU per process (cuda:LOCAL_RANK) with NCCL; with --device cpu, gloo (how the tests run).
    Returns (whether it created the group: a caller that made one keeps it, the group for the per-step
    stop flag: gloo beside NCCL, so that agreeing on it never waits for the GPU; None = the default group).
    """
    n = int(os.environ.get("WORLD_SIZE", "1"))
    if n == 1:
        return False, None
    if args.batch_size % n:
        cli.fail(f"--batch-size {args.batch_size} is the global batch and must split evenly "
                 f"over the {n} processes; use a multiple of {n}")
    local = int(os.environ["LOCAL_RANK"])
    if args.device.startswith("cuda"):
        if local >= torch.cuda.device_count():
            cli.fail(f"process {local} has no GPU of its own ({torch.cuda.device_count()} visible); "
                     "use --nproc_per_node at most the number of GPUs")
        args.device = f"cuda:{local}"
        torch.cuda.set_device(args.device)
    if dist.is_initialized():
        return False, None
    if args.device.startswith("cuda"):
        dist.init_process_group("nccl", device_id=torch.device(args.device))
        return True, dist.new_group(backend="gloo")
    dist.init_process_group("gloo")
    return True, None




class Stopper:
    """A stop request from SIGTERM/SIGINT: on_signal (the handler main installs) records it, and the
    training loop asks agree() at every step boundary, then saves its state and exits.

    All processes must stop at the same step, or the ones that go on would wait forever in a collective
    the others left. (torchrun passes a signal to every worker, but each notices it at a different moment.)
    """

    def __init__(self, group=None):
        self.signum = 0      # the signal received, 0 while none has come
        self.group = group   # the process group agree() reduces over (setup_distributed's second value)

    def on_signal(self, signum, frame):
        self.signum = signum
        if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def agree(self):
        """The signal any process received (0: none): the same value on every process."""
        if world()[1] == 1:
            return self.signum
        flag = torch.tensor([self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)


def global_mean(t):
    """The mean of t over all processes as the value, with the gradient of this process's own t.

    For the sparsity penalty 20 * |s* - rate| this matters: the penalty is not linear, so the mean of
    per-process penalties is not the penalty of the global batch. With this, each process back-propagates
    penalty'(global rate) * d(own rate), and DDP/FSDP's gradient averaging turns that into the exact
    gradient one process would get for the whole batch.
    """
    if world()[1] == 1:
        return t
    total = t.detach().clone()
    dist.all_reduce(total)
    return t + (total / world()[1] - t.detach())


def processes(args):
    """' on 2 processes (DDP)' under torchrun, for the log lines; nothing on one process."""
    n = world()[1]
    return f" on {n} processes ({'FSDP2' if getattr(args, 'fsdp', False) else 'DDP'})" if n > 1 else ""


def build_device(args):
    """Where a model is built: its GPU, or the CPU under FSDP2, which then moves only each shard over."""
    return "cpu" if getattr(args, "fsdp", False) and world()[1] > 1 else args.device


def parallelize(model, args):
    """The module a training step calls: the model itself on one process; under torchrun DDP (each
    process holds the whole model, gradients are averaged) or, with --fsdp, FSDP2 (each holds a shard of
    every tensor; a block's weights are gathered just for its forward and backward)."""
    n = world()[1]
    if n == 1:
        return model
    if getattr(args, "fsdp", False):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.5 has it under its older name
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda" if args.device.startswith("cuda") else "cpu", (n,))
        for layer in model.layers:  # one unit per block (its routers and LoRA included), then the rest
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[torch.device(args.device).index] if args.device.startswith("cuda") else None)


def whole(t):
    """FSDP2 keeps a shard of each tensor (a DTensor) on every process; gather it (all processes call)."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()


def whole_model(model):
    """The model as save_checkpoint reads it (.config, .state_dict()), with FSDP2's shards gathered on
    rank 0. Every process must call it; the others get an empty state (only rank 0 writes)."""
    sd = model.state_dict()
    if not any(hasattr(v, "full_tensor") for v in sd.values()):
        return model
    rank0 = world()[0] == 0
    full = {}
    for k, v in sd.items():
        v = whole(v)
        if rank0:
            full[k] = v.cpu()
    return types.SimpleNamespace(config=model.config, state_dict=lambda: full)


def barrier():
    if world()[1] > 1:
        dist.barrier()


# ----------------------------------------------------------------------------------------------------
# resumable state: one safetensors file per stage, replaced atomically


def state_path(run):
    """out/base -> out/base.state.safetensors (kept only while that stage is unfinished)."""
    return run.rstrip("/") + ".state.safetensors"


def save_state(path, names, params, opt, gen, meta):
    """Everything a run needs to continue exactly: the trainable tensors, their AdamW moments and step
    counts, the batch sampler's generator (the data position), and in the JSON metadata the step, the
    settings and the loss history. The frozen backbone is not here: it is reloaded from its checkpoint.

    One file written to path.tmp, flushed to disk, then renamed over path: a kill at any moment leaves
    the previous state whole, and a .tmp is never read. Every process takes part (FSDP2 gathers its
    shards); only rank 0 writes.
    """
    from safetensors.torch import save_file
    rank0 = world()[0] == 0
    tensors = {"batch_generator": gen.get_state()}
    for name, p in zip(names, params):
        for key, t in [("param", p)] + [(f"opt.{k}", v) for k, v in opt.state.get(p, {}).items()]:
            t = whole(t)
            if rank0:
                tensors[f"{key}.{name}"] = t.cpu().contiguous()
    if not rank0:
        return
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, tmp, metadata={"state": json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)  # and the rename itself
    os.close(fd)


def load_state(path, names, params, opt, gen, run):
    """Fill params, AdamW and the batch generator from a state file; returns its metadata."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        cli.fail(f"cannot read the saved state {path} ({e}); pass --no-resume to start over")
    for k, v in run.items():
        if meta["run"].get(k) != v:
            cli.fail(f"{path} holds a run with {k} = {meta['run'].get(k)}, this one has {v}; "
                     "use the same settings to resume it, or pass --no-resume to start over")

    def placed(p, t):  # a sharded parameter (FSDP2) gets its moments sharded the same way
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(t.to(p.device), p.device_mesh, p.placements)
        return t.to(p.device)

    by_name = dict(zip(names, params))
    name_of = {id(p): name for name, p in by_name.items()}
    with torch.no_grad():
        for name, p in by_name.items():
            t = tensors.get(f"param.{name}")
            if t is None or tuple(t.shape) != tuple(p.shape):
                cli.fail(f"{path} does not hold {name} with shape {tuple(p.shape)}: it belongs to "
                 "another model; pass --no-resume to start over")
            p.copy_(placed(p, t))
    sd = opt.state_dict()  # AdamW's own format: parameters numbered in param-group order
    order = [p for g in opt.param_groups for p in g["params"]]
    index = {name_of[id(p)]: i for i, p in enumerate(order)}
    sd["state"] = {}
    for key, t in tensors.items():
        if key.startswith("opt."):
            _, k, name = key.split(".", 2)
            i = index[name]
            sd["state"].setdefault(i, {})[k] = t if k == "step" else placed(order[i], t)
    opt.load_state_dict(sd)
    gen.set_state(tensors["batch_generator"])
    return meta
