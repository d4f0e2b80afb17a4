"""What each DDP worker runs (tests/ddp/harness.py starts them). Module-level functions, so that spawned workers
can import them; each takes (rank, world_size, ...) and returns plain tensors and numbers for the test to check."""
# no "from __future__ import annotations": DDP checks a hook's annotations as objects

import copy
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_topk.core.autodensity import HALF, INT8
from horovod_topk.torch.ddp import TopKEFState, gather_state, restore_state, topk_ef_hook


class Net(torch.nn.Module):
    """Registered a, b, c, d but used a, c, b, d: gradients become ready in another order than DDP's first buckets
    assume (the reverse of registration), so DDP rebuilds its buckets after the first iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 256)
        self.b = torch.nn.Linear(256, 256)
        self.c = torch.nn.Linear(256, 256)
        self.d = torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        x = torch.relu(self.c(x))
        x = torch.relu(self.b(x))
        return self.d(x)


def make_model(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 8, (16,), generator=g)


def train_step(ddp: Any, opt: Any, rank: int, step: int, dtype: torch.dtype = torch.float32, micro_batches: int = 1):
    """One optimizer step; with ``micro_batches`` > 1 the first ones accumulate under ddp.no_sync()."""
    opt.zero_grad()
    for m in range(micro_batches):
        x, y = batch(rank, step, dtype, m)
        if m < micro_batches - 1:
            with ddp.no_sync():
                F.cross_entropy(ddp(x), y).backward()
        else:
            F.cross_entropy(ddp(x), y).backward()
    opt.step()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def all_equal_across_ranks(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out)


def ddp_of(model: torch.nn.Module, state: Optional[TopKEFState], **ddp_options: Any) -> DDP:
    ddp = DDP(model, **ddp_options)
    if state is not None:
        ddp.register_comm_hook(state, topk_ef_hook)
    return ddp


# ---- workers ---------------------------------------------------------------------------------------------------
def parity(rank: int, world_size: int, ddp_options: Dict[str, Any], micro_batches: int) -> Dict[str, Any]:
    """DDP's default reduction and the hook at ratio 1.0 side by side: parameters after Adam steps."""
    plain, hooked = make_model(), make_model()
    state = TopKEFState(ratio=1.0, min_numel=0)
    ddp_plain, ddp_hooked = ddp_of(plain, None, **ddp_options), ddp_of(hooked, state, **ddp_options)
    opt_plain, opt_hooked = torch.optim.Adam(plain.parameters(), 1e-2), torch.optim.Adam(hooked.parameters(), 1e-2)
    for step in range(4):
        train_step(ddp_plain, opt_plain, rank, step, micro_batches=micro_batches)
        train_step(ddp_hooked, opt_hooked, rank, step, micro_batches=micro_batches)
    stats = state.stats()
    return {"plain": flat_params(plain), "hooked": flat_params(hooked), "bytes_sent": stats["bytes_sent"],
            "bytes_dense": stats["bytes_dense"]}


def recording_hook(log: List[Dict[str, Any]]):
    """topk_ef_hook, recording per bucket: member names, the local gradients, and each member's residual before
    and after (zeros where it has none) and the averaged result, for the error-feedback invariant."""

    def residual(state: TopKEFState, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        record = state.registry.records.get(name)
        if record is None or record.residual is None:
            return torch.zeros(numel, dtype=dtype)
        return record.residual.detach().clone().to(dtype)

    def hook(state: TopKEFState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        names = [state.name_of(p) for p in bucket.parameters()]
        sizes = [g.numel() for g in bucket.gradients()]
        entry = {"names": names, "grads": list(buffer.detach().clone().split(sizes)),
                 "before": [residual(state, n, s, buffer.dtype) for n, s in zip(names, sizes)]}
        log.append(entry)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            out = fut.value()
            entry["out"] = list(out.detach().clone().split(sizes))
            entry["after"] = [residual(state, n, s, out.dtype) for n, s in zip(names, sizes)]
            return out

        had_grid = [state.registry.records[n].int8_reference > 0.0 if n in state.registry.records else False
                    for n in names]
        future = topk_ef_hook(state, bucket)
        # per member, whether ratio="auto"'s fp16 carried it (decided, if due, at the step's first bucket, in the
        # call): fp16 in force, or int8 in force and the member without a grid yet (its first int8 step goes fp16)
        ratio = state.auto.ratio if state.auto is not None else None
        entry["half"] = [ratio == HALF or (ratio == INT8 and not grid) for grid in had_grid]
        entry["int8"] = ratio == INT8
        return future.then(done)

    return hook


def invariant(rank: int, world_size: int, ratio: float, micro_batches: int, steps: int,
              ddp_options: Dict[str, Any], options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Train a float64 model through the recording hook; return every bucket's record and the final parameters.
    ``options``: more TopKConfig options (the compact encoding, warm-up, telemetry)."""
    model = make_model(torch.float64)
    state = TopKEFState(ratio=ratio, min_numel=64, **(options or {}))
    log: List[Dict[str, Any]] = []
    ddp = DDP(model, **ddp_options)
    ddp.register_comm_hook(state, recording_hook(log))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ends = []  # where each step's bucket calls end in the log
    for step in range(steps):
        train_step(ddp, opt, rank, step, torch.float64, micro_batches)
        ends.append(len(log))
    params = flat_params(model)
    return {"log": log, "ends": ends, "params": params, "same": all_equal_across_ranks(params), "stats": state.stats()}


def bucket_layouts(rank: int, world_size: int, configurations: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The same training under several DDP bucket set-ups (cap, static graph, gradients as bucket views): each
    member is selected on its own, so the parameters must come out bit-identical."""
    results = []
    for ddp_options in configurations:
        model = make_model()
        state = TopKEFState(ratio=0.05, min_numel=64)
        ddp = ddp_of(model, state, **ddp_options)
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        for step in range(5):
            train_step(ddp, opt, rank, step)
        results.append(flat_params(model))
    return {"params": results}


def grouped_against_alone(rank: int, world_size: int, bucket_cap_mb: float) -> Dict[str, Any]:
    """The same Adam training twice: the allgather members of each bucket selected by one run of the grouped
    kernels (the test sets HOROVOD_TOPK_SELECTION=triton), then member by member; parameters and bucket stats."""
    from horovod_topk.torch import bucket_select

    groupable = bucket_select.groupable
    results = []
    try:
        for grouped in (True, False):
            bucket_select.groupable = groupable if grouped else (lambda *args: False)
            model = make_model()
            state = TopKEFState(ratio=0.05, min_numel=64)
            ddp = ddp_of(model, state, bucket_cap_mb=bucket_cap_mb)
            opt = torch.optim.Adam(model.parameters(), 1e-2)
            for step in range(4):
                train_step(ddp, opt, rank, step)
            params = flat_params(model)
            results.append({"params": params, "same": all_equal_across_ranks(params),
                            "buckets": state.stats()["buckets"]})
    finally:
        bucket_select.groupable = groupable
    return {"grouped": results[0], "alone": results[1]}


class _RerunAsReplay:
    """A stand-in for a CUDA graph on the CPU (where nothing can be captured): recording runs the work once (a
    capture runs nothing, the replay right after it does: that replay is skipped), a replay runs the recorded work
    again -- its collectives included, as a graph's replay issues them -- over the tensors it was recorded with."""

    def __init__(self, work: Any) -> None:
        self.work, self.recorded = work, True

    def replay(self) -> None:
        if self.recorded:
            self.recorded = False
            return
        self.work()


def _record_by_rerun(graphs: Any, key: Any, work: Any, device: Any) -> Any:
    outputs = work()
    graphs._graphs[key] = found = (_RerunAsReplay(work), outputs)
    return found


def whole_bucket_graphs(rank: int, world_size: int, bucket_cap_mb: float, load_at: int,
                        ddp_options: Dict[str, Any]) -> Dict[str, Any]:
    """The same Adam training twice: each steady bucket's whole step replayed as one graph (torch.bucket_graph, with
    graph recording stood in for by re-running the recorded work), then the usual path; a checkpoint loaded into
    the same state at step ``load_at`` (the records replaced: full steps, then new graphs). Parameters, the
    records' counters and residuals, and how many whole steps replayed."""
    from horovod_topk.torch import bucket_graph, group_graphs

    asked, possible, record = bucket_graph.asked, bucket_graph.possible, group_graphs.GroupGraphs._record
    results = []
    try:
        for whole in (True, False):
            bucket_graph.asked = lambda device, _whole=whole: _whole
            bucket_graph.possible = lambda group: True  # Gloo's collectives, re-run by the stand-in
            group_graphs.GroupGraphs._record = _record_by_rerun if whole else record
            model = make_model()
            state = TopKEFState(ratio=0.05, min_numel=64, named_parameters=model.named_parameters())
            ddp = ddp_of(model, state, bucket_cap_mb=bucket_cap_mb, **ddp_options)
            opt = torch.optim.Adam(model.parameters(), 1e-2)
            graphs: List[Any] = []
            original_step = bucket_graph.BucketGraph.step

            def step_and_keep(self, *args, _graphs=graphs, _original=original_step):
                if self not in _graphs:
                    _graphs.append(self)
                return _original(self, *args)

            bucket_graph.BucketGraph.step = step_and_keep
            try:
                for step in range(9):
                    if step == load_at:
                        state.load_state_dict(state.state_dict())
                    train_step(ddp, opt, rank, step)
            finally:
                bucket_graph.BucketGraph.step = original_step
            params = flat_params(model)
            records = state.registry.records
            results.append({
                "params": params, "same": all_equal_across_ranks(params),
                "counters": {n: (r.steps, r.bytes_sent, r.bytes_dense, int(r.nonfinite_steps))
                             for n, r in records.items()},
                "residuals": {n: r.residual.clone() for n, r in records.items() if r.residual is not None},
                "graphs": len(graphs), "replays": sum(g.graphs.replays for g in graphs),
                "buckets": state.stats()["buckets"]})
    finally:
        bucket_graph.asked, bucket_graph.possible, group_graphs.GroupGraphs._record = asked, possible, record
    return {"whole": results[0], "usual": results[1]}


def resume(rank: int, world_size: int, named: bool) -> Dict[str, Any]:
    """6 steps straight, against 3 steps, a checkpoint (model, optimizer, TopKEFState per rank), fresh objects that
    load it, and 3 more steps."""

    def fresh():
        model = make_model()
        state = TopKEFState(ratio=0.05, min_numel=64,
                            named_parameters=model.named_parameters() if named else None)
        ddp = ddp_of(model, state, bucket_cap_mb=0.3)
        return model, state, ddp, torch.optim.Adam(model.parameters(), 1e-2)

    model, state, ddp, opt = fresh()
    for step in range(6):
        train_step(ddp, opt, rank, step)
    straight = flat_params(model)

    model, state, ddp, opt = fresh()
    for step in range(3):
        train_step(ddp, opt, rank, step)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "topk": state.state_dict()})
    model, state, ddp, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["topk"])
    for step in range(3, 6):
        train_step(ddp, opt, rank, step)
    return {"straight": straight, "resumed": flat_params(model), "names": sorted(saved["topk"]["tensors"])}


def save_all_ranks(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """3 steps, then gather_state: one checkpoint of every rank's residuals, written by rank 0."""
    model = make_model()
    state = TopKEFState(ratio=0.05, min_numel=64, named_parameters=model.named_parameters())
    ddp = ddp_of(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        train_step(ddp, opt, rank, step)
    checkpoint = gather_state(state)
    if rank == 0:
        torch.save({"topk": checkpoint, "model": model.state_dict()}, path)
    return {"residuals": {n: r.residual.clone() for n, r in state.registry if r.residual is not None}}


def load_all_ranks(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """restore_state of a checkpoint made on another number of ranks, then 2 more steps."""
    model = make_model()
    saved = torch.load(path, weights_only=False) if rank == 0 else None
    model_state = [saved["model"] if saved else None]
    dist.broadcast_object_list(model_state, src=0)
    model.load_state_dict(model_state[0])
    state = TopKEFState(ratio=0.05, min_numel=64, named_parameters=model.named_parameters())
    restore_state(state, saved["topk"] if saved else None)
    loaded = {n: r.residual.clone() for n, r in state.registry if r.residual is not None}
    ddp = ddp_of(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3, 5):
        train_step(ddp, opt, rank, step)
    params = flat_params(model)
    return {"loaded": loaded, "same": all_equal_across_ranks(params)}


def mismatch(rank: int, world_size: int, first: Optional[Dict[str, Any]] = None,
             others: Optional[Dict[str, Any]] = None) -> str:
    """Rank 0 is configured with ``first``, the others with ``others`` (by default another ratio): every rank must
    raise, naming what differs, instead of hanging."""
    model = make_model()
    options = (first or {"ratio": 0.01}) if rank == 0 else (others or {"ratio": 0.02})
    ddp = ddp_of(model, TopKEFState(**options))
    x, y = batch(rank, 0)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except Exception as error:  # DDP re-raises the hook's RankMismatch from backward()
        return f"{type(error).__name__}: {error}"
    return "no error"


def poison_on(model: Net, rank: int, at_step: int) -> List[int]:
    """Put a NaN into rank 1's gradient of c.weight on step ``at_step``; returns the box the caller writes the
    current step into."""
    step_box = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if rank == 1 and step_box[0] == at_step:
            grad = grad.clone()
            grad[0, 0] = float("nan")
        return grad

    model.c.weight.register_hook(poison)
    return step_box


def nonfinite(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1's gradient of c.weight holds a NaN on step 2: sent as such (every rank's c.weight becomes NaN there,
    as dense DDP's would), never in a residual; its bucket-mates' residuals carry on as usual."""
    model = make_model()
    state = TopKEFState(ratio=0.05, min_numel=64, named_parameters=model.named_parameters())
    ddp = ddp_of(model, state)
    step_box = poison_on(model, rank, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads: Dict[str, Any] = {}
    for step in range(3):
        step_box[0] = step
        opt.zero_grad()
        x, y = batch(rank, step)
        F.cross_entropy(ddp(x), y).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    residuals = {n: r.residual.clone() for n, r in state.registry if r.residual is not None}
    return {"grads": grads, "residuals": residuals, "nonfinite_steps": state.stats()["nonfinite_steps"]}


def smoke(rank: int, world_size: int) -> Dict[str, Any]:
    """A few steps at ratio 0.01: parameters equal on every rank, fewer bytes than dense."""
    model = make_model()
    state = TopKEFState(ratio=0.01)
    ddp = ddp_of(model, state)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for step in range(3):
        train_step(ddp, opt, rank, step)
    return {"same": all_equal_across_ranks(flat_params(model)), "ratio": state.stats()["compression_ratio"]}
