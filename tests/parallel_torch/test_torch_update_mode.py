"""Update mode (TopKEF(target="update")) on real Horovod workers: each rank steps on its own gradient and the
updates travel. Checked here: parity with plain Horovod where the two must agree (SGD without momentum), Adam
under the shared second moment against an independent one-step reference, the error-feedback invariant over all
ranks, bit-identical parameters on every rank, non-finite gradients on one rank (with and without AMP's
GradScaler), exact resume from a checkpoint, and what is refused."""
from typing import Callable, Dict, List, Tuple

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.core.update_mode import update_tensor_name
from horovod_topk.torch import TopKEF

from .conftest import SINGLE_RANK_SETS
from .test_torch_optimizer import OPTIONS
from .torch_harness import Net, assert_same_params, batch, differs, train

EVERYTHING = dict(ratio=1.0, min_numel=0, dense_fallback=False, target="update")
SGD = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
ADAM = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
ADAMW = lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)  # noqa: E731

# Horovod's options as gradient mode's parity test takes them (clipping and Adam differ in update mode by design)
PARITY_OPTIONS = {
    **{key: OPTIONS[key] for key in ("named", "unnamed", "groups_int", "groups_list", "two_backward_passes", "op_sum",
                                     "predivide")},
    "sgd_momentum_nesterov_decay": {"optimizer_factory": lambda params: torch.optim.SGD(
        params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)},
}


def gathered(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Every rank's ``tensor``, stacked (rank order)."""
    return hvd.allgather(tensor.detach().unsqueeze(0).contiguous(), name="test.update." + name)


def identical_across_ranks(params: Dict[str, torch.Tensor], what: str = "param") -> List[str]:
    """Names of the tensors whose values differ between ranks (bit for bit). ``what`` keeps the collectives' names
    apart for tensors of other shapes under the same names (Horovod caches a name's shape)."""
    out = []
    for name, value in params.items():
        bits = value.view(torch.int16) if value.dtype == torch.bfloat16 else value  # Horovod gathers no bfloat16
        every = gathered(bits, f"same.{what}.{name}")
        if not all(torch.equal(every[0], every[r]) for r in range(1, every.shape[0])):
            out.append(name)
    return out


@pytest.mark.parametrize("option", list(PARITY_OPTIONS))
def test_sgd_at_ratio_one_matches_plain_horovod(option):
    """SGD's update (momentum, Nesterov and weight decay included) is linear in the gradient: the average of the
    local updates is the update of the averaged gradient."""
    kwargs = {"optimizer_factory": SGD, **PARITY_OPTIONS[option]}
    plain = train(hvd.Compression.none, **kwargs)
    compressor = TopKEF(**EVERYTHING)  # second_moment="local" (the default): SGD steps on each rank's own gradient
    ours = train(compressor, **kwargs)
    initial = train(hvd.Compression.none, steps=0, **kwargs)
    assert_same_params(ours, plain)
    assert "fc1.weight" in differs(plain, initial)
    assert identical_across_ranks(ours) == []
    stats = compressor.stats()
    assert stats["tensors_compressed"] >= 8 and stats["bytes_sent"] > 0
    assert all(name.startswith("update.") for name, _ in compressor.registry)


def test_process_set_of_one_rank_steps_on_its_own_gradient_alone():
    """A process set of one rank: its update is its own, nothing waits on the other rank."""
    mine = SINGLE_RANK_SETS[hvd.rank()]
    ours = train(TopKEF(**EVERYTHING, second_moment="local"), optimizer_factory=SGD, process_set=mine)
    alone = train(hvd.Compression.none, optimizer_factory=SGD, process_set=mine)
    assert_same_params(ours, alone)


FACTORIES = {
    "adam": (ADAM, 0.0, False),
    "adamw": (ADAMW, 0.1, True),
    "adam_l2": (lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.1), 0.1, False),
    "adam_decoupled": (lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.1,
                                                       decoupled_weight_decay=True), 0.1, True),
}


def first_step(compressor: TopKEF, optimizer_factory: Callable
               ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """One step of Net from its initial parameters: (the initial parameters, the parameters after the step, every
    rank's gradient per parameter as the step saw it, stacked in rank order, float64)."""
    grads: Dict[str, torch.Tensor] = {}

    def capture(model: nn.Module) -> None:
        for name, p in model.named_parameters():
            grads[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)

    initial = train(hvd.Compression.none, steps=0)
    after = train(compressor, steps=1, optimizer_factory=optimizer_factory, on_synchronized=capture)
    every = {name: gathered(grads[name], "grad." + name).double() for name in sorted(initial)}
    return initial, after, every


@pytest.mark.parametrize("block", [1, 4, 256])
@pytest.mark.parametrize("factory", list(FACTORIES))
def test_shared_second_moment_first_step_matches_an_independent_reference(block, factory):
    """Step 1 of Adam from a fresh state: m/(1 - b1) = g_i and v/(1 - b2) = s, the ranks' mean of their squared
    gradients averaged over each block; so the averaged update is lr * mean_i(g_i) / (sqrt(s) + eps) (+ AdamW's
    decay lr * wd * p). Adam's L2 decay joins the gradient, in both moments: g_i + wd * p."""
    lr, eps = 0.01, 1e-8
    make, wd, decoupled = FACTORIES[factory]
    initial, ours, grads = first_step(TopKEF(**EVERYTHING, second_moment="shared", second_moment_block=block), make)
    for name, p0 in initial.items():
        every = grads[name]
        if not decoupled:
            every = every + wd * p0.double()
        mean_grad = every.mean(0).reshape(-1)
        squares = every.square().mean(0).reshape(-1)
        s = torch.cat([chunk.mean().expand(len(chunk)) for chunk in squares.split(block)])
        decay = lr * wd * p0.double().reshape(-1) if decoupled else 0.0
        expected = p0.double().reshape(-1) - lr * mean_grad / (s.sqrt() + eps) - decay
        torch.testing.assert_close(ours[name].double().reshape(-1), expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def _adam_local_update(state: dict, first_moment: torch.Tensor, before: torch.Tensor, lr: float, betas, eps: float,
                       block: int) -> torch.Tensor:
    """This rank's update recomputed from the state the step left behind (an independent formula)."""
    step = int(state["step"])
    m_hat = first_moment.double().view_as(before) / (1 - betas[0] ** step)
    v = state["shared_exp_avg_sq"].double().repeat_interleave(block)[: before.numel()].view_as(before)
    return lr * m_hat / ((v / (1 - betas[1] ** step)).sqrt() + eps)


def assert_error_feedback_invariant(model: nn.Module, opt, compressor: TopKEF,
                                    local_update: Callable[[str, torch.Tensor, torch.Tensor, int], torch.Tensor],
                                    steps: int = 4) -> None:
    """Over all ranks, every step: sum of new residuals + P * applied == sum of (old residuals + local updates),
    each rank's local update recomputed by ``local_update(name, parameter, before, step)`` from the state the step
    left; then every rank's parameters are bit-identical and something stayed behind in the residuals."""
    world = hvd.size()
    for step in range(steps):
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        old = {n: _residual(compressor, n, p.numel()) for n, p in before.items()}
        opt.step()
        for name, p in model.named_parameters():
            update = local_update(name, p, before[name], step)
            applied = (before[name] - p.detach()).double()
            left = hvd.allreduce(_residual(compressor, name, p.numel()), op=hvd.Sum, name=f"test.inv.l.{step}.{name}")
            right = hvd.allreduce(old[name] + update.reshape(-1), op=hvd.Sum, name=f"test.inv.r.{step}.{name}")
            # applied is read back from float32 parameters: P times their rounding (|p| < 8: 2**-21) is allowed
            torch.testing.assert_close(left + world * applied.reshape(-1), right, rtol=1e-5, atol=world * 2**-21,
                                       msg=lambda m: f"step {step}, {name}: {m}")
    assert identical_across_ranks({n: p.detach() for n, p in model.named_parameters()}) == []
    assert compressor.stats()["residual_norm"] > 0  # a ratio below 1 left something behind


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_error_feedback_invariant_and_identical_parameters_with_adam(exchange):
    lr, betas, eps, block = 0.01, (0.9, 0.999), 1e-8, 16
    torch.manual_seed(0)
    model = Net()
    compressor = TopKEF(ratio=0.05, min_numel=0, dense_fallback=False, target="update", exchange=exchange,
                        second_moment="shared", second_moment_block=block)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=eps),
                                   named_parameters=model.named_parameters(), compression=compressor)

    def local_update(name: str, p: torch.Tensor, before: torch.Tensor, step: int) -> torch.Tensor:
        first_moment = compressor.registry.records[update_tensor_name(name)].momentum
        return _adam_local_update(opt.state[p], first_moment, before, lr, betas, eps, block)

    assert_error_feedback_invariant(model, opt, compressor, local_update)


def _residual(compressor: TopKEF, name: str, numel: int) -> torch.Tensor:
    record = compressor.registry.records.get(update_tensor_name(name))
    if record is None or record.residual is None:
        return torch.zeros(numel, dtype=torch.float64)
    return record.residual.double().clone()


@pytest.mark.parametrize("case", ["float16", "bfloat16", "compact", "sparse_allreduce", "local_adamw", "clip",
                                  "calibrated", "calibrated_bfloat16"])
def test_parameters_stay_bit_identical_on_every_rank(case):
    options = dict(ratio=0.05, target="update", second_moment="shared")
    if case.startswith("calibrated"):
        options.update(second_moment="calibrated")
        case = case.replace("calibrated", "").lstrip("_") or "calibrated"
    kwargs: dict = {"optimizer_factory": ADAMW, "steps": 5}
    if case in ("float16", "bfloat16"):
        kwargs["dtype"] = getattr(torch, case)
        kwargs["optimizer_factory"] = lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4)
    elif case == "compact":
        options.update(index_bits=16, value_dtype="float8")
    elif case == "sparse_allreduce":
        options.update(exchange="sparse_allreduce", min_numel=0, dense_fallback=False)
    elif case == "local_adamw":
        options.update(second_moment="local")
    elif case == "clip":
        kwargs["clip"] = 0.5  # clips each rank's own gradient (the only one it has)
    initial = train(hvd.Compression.none, steps=0, dtype=kwargs.get("dtype", torch.float32))
    ours = train(TopKEF(**options), **kwargs)
    assert identical_across_ranks(ours) == []
    assert "fc1.weight" in differs(ours, initial)
    assert all(bool(torch.isfinite(v).all()) for v in ours.values())


@pytest.mark.parametrize("second_moment", ["shared", "local", "calibrated"])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(second_moment):
    torch.manual_seed(0)
    model = Net()
    compressor = TopKEF(ratio=0.05, target="update", second_moment=second_moment)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=compressor)
    snapshots = []
    for step in range(3):
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        if step == 1 and hvd.rank() == 1:
            model.fc1.weight.grad[0, 0] = float("inf")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state_before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
        for n in state_before:  # this rank's first moment (shared second moment) lives in the compressor
            record = compressor.registry.records.get(update_tensor_name(n))
            if record is not None and record.momentum is not None:
                state_before[n]["first_moment"] = record.momentum.clone()
        opt.step()
        snapshots.append((before, state_before))
    after_skip = snapshots[2][0]
    assert_same_params(after_skip, snapshots[1][0])  # step 1 changed no parameter on any rank
    for name, p in model.named_parameters():
        for key, value in snapshots[2][1][name].items():
            assert torch.equal(value, snapshots[1][1][name][key]), (name, key)  # nor any optimizer state
    assert differs({n: p.detach() for n, p in model.named_parameters()}, after_skip)  # step 2 trained again
    assert all(bool(torch.isfinite(r.residual).all()) for _, r in compressor.registry if r.residual is not None)
    assert identical_across_ranks({n: p.detach() for n, p in model.named_parameters()}) == []
    assert compressor.stats()["nonfinite_steps"] == (1 if hvd.rank() == 1 else 0)
    assert opt.topk_update_step.skipped_steps == 1


def test_amp_grad_scaler_skips_the_same_step_on_every_rank():
    """GradScaler looks at this rank's gradients: synchronize() has made them non-finite on every rank when any
    rank's were, so every rank skips the step (no collective left unmatched) and lowers its scale alike."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=TopKEF(ratio=0.05, target="update"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    moved = []
    for step in range(3):
        opt.zero_grad()
        x, tokens, y = batch(step)
        scaler.scale(nn.functional.cross_entropy(model(x, tokens, True), y)).backward()
        if step == 1 and hvd.rank() == 0:
            model.fc2.weight.grad[0, 0] = float("nan")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        moved.append(bool(differs({n: p.detach() for n, p in model.named_parameters()}, before)))
    scales = gathered(torch.tensor([scaler.get_scale()]), "scale")
    assert moved == [True, False, True]
    assert scales[0].item() == scales[1].item() == 512.0
    assert identical_across_ranks({n: p.detach() for n, p in model.named_parameters()}) == []


@pytest.mark.parametrize("second_moment", ["shared", "calibrated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_resumes_exactly(dtype, second_moment):
    """Each rank saves its own model, optimizer state and TopKEF state (its residuals and first moments); a new
    model/optimizer/compressor loading them continues bit for bit as the uninterrupted run -- bfloat16 parameters
    too (the computed second moment's state stays float32 through the optimizer's load). The calibrated sketch's
    signs follow the optimizer's step, so the resumed run draws the same ones."""
    kept = {"shared": ("shared_exp_avg_sq",), "calibrated": ("exp_avg", "exp_avg_sq")}[second_moment]

    def run(steps: range, state=None):
        torch.manual_seed(0)
        model = Net().to(dtype)
        compressor = TopKEF(ratio=0.05, target="update", second_moment=second_moment)
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=compressor)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            compressor.load_state_dict(state["topk"])
        saved = None
        for step in steps:
            opt.zero_grad()
            x, tokens, y = batch(step, dtype)
            nn.functional.cross_entropy(model(x, tokens, step % 2 == 0).float(), y).backward()
            opt.step()
            assert all(s[key].dtype == torch.float32 for s in opt.state.values() for key in kept)
            if step == 1:
                import copy

                saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                       "topk": compressor.state_dict()})
        return {n: p.detach().clone() for n, p in model.named_parameters()}, saved

    straight, saved = run(range(5))
    resumed, _ = run(range(2, 5), saved)
    assert differs(straight, resumed) == []


def test_the_second_moment_is_calibrated_where_it_can_be_computed_and_each_ranks_own_elsewhere():
    model = Net()

    def mode(optimizer, **options):
        opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                       compression=TopKEF(target="update", **options))
        return opt.topk_update_step.second_moment

    params = list(model.parameters())
    assert mode(torch.optim.AdamW(params, lr=0.1)) == "calibrated"  # the default, "auto"
    assert mode(torch.optim.Adam(params, lr=0.1, weight_decay=0.1)) == "calibrated"
    assert mode(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == "local"
    assert mode(torch.optim.Adam(params, lr=0.1, amsgrad=True)) == "local"  # not computed: the user's own optimizer
    assert mode(torch.optim.AdamW(params, lr=0.1), second_moment="local") == "local"
    assert mode(torch.optim.AdamW(params, lr=0.1), second_moment="shared") == "shared"
    with pytest.raises(ValueError, match="SGD"):
        mode(torch.optim.SGD(params, lr=0.1), second_moment="shared")
    with pytest.raises(ValueError, match="amsgrad"):
        mode(torch.optim.Adam(params, lr=0.1, amsgrad=True), second_moment="calibrated")


def test_the_default_target_exchanges_adams_updates_and_sgds_gradients():
    """target="auto" (the default): update mode for Adam/AdamW, gradient mode for SGD and for op=hvd.Sum (which
    update mode refuses for Adam); one TopKEF object serves both kinds of optimizer, each in its own mode, and
    trains them with identical parameters on every rank."""
    torch.manual_seed(0)
    first, second = Net(), Net()
    compressor = TopKEF(ratio=0.05, min_numel=256)
    adam = hvd.DistributedOptimizer(torch.optim.AdamW(first.parameters(), lr=0.01),
                                    named_parameters=first.named_parameters(), compression=compressor)
    sgd = hvd.DistributedOptimizer(torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=second.named_parameters(), compression=compressor)
    assert adam.topk_update_step.second_moment == "calibrated" and not hasattr(sgd, "topk_update_step")
    summed = hvd.DistributedOptimizer(torch.optim.Adam(Net().parameters(), lr=0.01), op=hvd.Sum,
                                      compression=TopKEF(ratio=0.05))
    assert not hasattr(summed, "topk_update_step")
    for step in range(3):
        for model, opt in ((first, adam), (second, sgd)):
            opt.zero_grad()
            x, tokens, y = batch(step)
            nn.functional.cross_entropy(model(x, tokens, True), y).backward()
            opt.step()
    names = {name for name, _ in compressor.registry}
    assert any(n.startswith("update.") for n in names)  # the AdamW's updates travelled
    assert any(not n.startswith("update.") and "fc1.weight" in n for n in names)  # the SGD's gradients did
    for model in (first, second):
        assert identical_across_ranks({n: p.detach() for n, p in model.named_parameters()}) == []


@pytest.mark.parametrize("second_moment, keys", [("shared", ("shared_exp_avg_sq", "step")),
                                                  ("calibrated", ("exp_avg", "exp_avg_sq", "step"))])
def test_broadcast_optimizer_state_at_start_up_creates_update_modes_state(second_moment, keys):
    """The usual Horovod start-up broadcast: update mode's keys at step 0 on every rank (not Adam's after a step on
    zero gradients), then training keeps every rank's parameters identical."""
    torch.manual_seed(hvd.rank())  # different initial weights: the broadcasts must make them equal
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=TopKEF(target="update", second_moment=second_moment))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert {tuple(sorted(s)) for s in opt.state.values()} == {keys}
    assert all(float(s["step"]) == 0 for s in opt.state.values())
    for step in range(3):
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        opt.step()
    assert all(float(s["step"]) == 3 for s in opt.state.values())
    assert identical_across_ranks({n: p.detach() for n, p in model.named_parameters()}) == []


def test_a_scheduler_on_the_distributed_optimizer_drives_the_shared_step():
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=TopKEF(**EVERYTHING, second_moment="shared"))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)  # lr 0 from the second step on
    moved = []
    for step in range(3):
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        scheduler.step()
        moved.append(bool(differs({n: p.detach() for n, p in model.named_parameters()}, before)))
    assert moved == [True, False, False]  # everything is sent at ratio 1; from the second step on lr is 0


def gradient_mode_adam_state(steps: int = 2) -> dict:
    """The optimizer state_dict of Adam after ``steps`` steps of gradient mode (the same on every rank)."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=TopKEF(ratio=0.05, target="gradient"))
    for step in range(steps):
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        opt.step()
    return opt.state_dict()


def test_a_gradient_mode_adam_state_loaded_on_rank_0_is_adopted_by_every_rank():
    """The usual resume: rank 0 loads, broadcast_optimizer_state sends; Adam's second moment becomes the shared
    one (per block), its first moment every rank's."""
    saved = gradient_mode_adam_state()
    model = Net()  # a new job's model (the old optimizer's hooks stay on the old one)
    compressor = TopKEF(ratio=0.05, target="update", second_moment="shared", second_moment_block=4)
    update = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(), compression=compressor)
    if hvd.rank() == 0:
        update.load_state_dict(saved)
    hvd.broadcast_optimizer_state(update, root_rank=0)
    names = {p: n for n, p in model.named_parameters()}
    for p, state in update.state.items():
        assert set(state) == {"step", "shared_exp_avg_sq"} and float(state["step"]) == 2
        first = compressor.registry.records[update_tensor_name(names[p])].momentum
        index = next(i for i, q in enumerate(q for g in update.param_groups for q in g["params"]) if q is p)
        torch.testing.assert_close(first.view_as(p), saved["state"][index]["exp_avg"])
        blocks = saved["state"][index]["exp_avg_sq"].reshape(-1).split(4)
        torch.testing.assert_close(state["shared_exp_avg_sq"], torch.stack([b.mean() for b in blocks]))
    moments = {names[p]: s["shared_exp_avg_sq"] for p, s in update.state.items()}
    assert identical_across_ranks(dict(sorted(moments.items())), "second_moment") == []  # one order on every rank
    for step in range(2):
        update.zero_grad()
        x, tokens, y = batch(step + 2)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        update.step()
    assert identical_across_ranks({n: p.detach() for n, p in model.named_parameters()}) == []


def test_op_sum_with_adam_and_sparse_gradients_are_refused_by_name():
    model = Net(sparse_embedding=True)
    for normalising in (torch.optim.Adam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adafactor):
        with pytest.raises(ValueError, match=f"op=hvd.Sum would apply the sum of P normalised {normalising.__name__}"):
            hvd.DistributedOptimizer(normalising(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                                     compression=TopKEF(target="update"), op=hvd.Sum)
    with pytest.raises(ValueError, match="sparse_as_dense"):
        train(TopKEF(target="update"), sparse_embedding=True, optimizer_factory=SGD, steps=1)


def test_sparse_gradients_with_sparse_as_dense_train_as_plain_horovod_does():
    """sparse_as_dense=True: Horovod hands the (local) sparse gradient back sparse; update mode makes it dense, so
    SGD at ratio 1 on a model with a sparse embedding equals plain Horovod's training with the same option."""
    kwargs = {"optimizer_factory": SGD, "sparse_embedding": True, "sparse_as_dense": True}
    plain = train(hvd.Compression.none, **kwargs)
    ours = train(TopKEF(**EVERYTHING), **kwargs)
    assert_same_params(ours, plain)
    assert "embed.weight" in differs(ours, train(hvd.Compression.none, steps=0, sparse_embedding=True))


def test_a_parameter_frozen_after_wrapping_stays_identical_on_every_rank():
    """A parameter that stops requiring gradients after the optimizer was wrapped still gets a zero gradient from
    Horovod and moves by each rank's own momentum: its update travels like the others, so the ranks' copies stay
    bit-identical (with it left out, each rank's momentum moved its own copy)."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=TopKEF(ratio=0.05, target="update"))
    before_freeze = None
    for step in range(4):
        if step == 2:
            model.fc1.weight.requires_grad_(False)
            before_freeze = model.fc1.weight.detach().clone()
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, False), y).backward()
        opt.step()
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert identical_across_ranks(params, "frozen") == []
    assert not torch.equal(params["fc1.weight"], before_freeze)  # momentum moved it: the case is exercised


def test_a_float64_model_keeps_steps_below_float32_resolution():
    """The local update is subtracted in the parameters' own float64: a step far below float32's resolution at the
    parameter's magnitude is not rounded away (or doubled) before it travels."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64).double()
    with torch.no_grad():
        layer.weight.fill_(1.0)
        layer.bias.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), named_parameters=layer.named_parameters(),
                                   compression=TopKEF(**EVERYTHING))
    opt.zero_grad()
    layer.weight.grad = torch.full_like(layer.weight, 3e-9 * (hvd.rank() + 1))
    layer.bias.grad = torch.zeros_like(layer.bias)
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    expected = 1.0 - 3e-9 * (1 + hvd.size()) / 2  # the averaged step, in float64
    torch.testing.assert_close(layer.weight.detach(), torch.full_like(layer.weight, expected), rtol=0, atol=1e-15)


@pytest.mark.parametrize("options", [
    {"second_moment": "calibrated"},
    {"second_moment": "calibrated", "exchange": "sparse_allreduce", "min_numel": 0, "dense_fallback": False},
    {"second_moment": "shared", "index_bits": 16, "value_dtype": "float8"},
    {"second_moment": "local", "warmup_steps": 2},
])
def test_updates_in_buckets_train_as_the_per_tensor_exchange(options):
    """The updates travel in one bucket per step (one collective for its compressed members) and the parameters,
    residuals and bytes are those of the per-tensor exchange, bit for bit."""
    kwargs: dict = {"optimizer_factory": ADAMW, "steps": 5}
    bucketed = TopKEF(ratio=0.05, target="update", bucket_bytes=1 << 20, **options)
    per_tensor = TopKEF(ratio=0.05, target="update", bucket_bytes=0, **options)
    ours = train(bucketed, **kwargs)
    theirs = train(per_tensor, **kwargs)
    assert differs(ours, theirs) == []
    for name, record in per_tensor.registry.records.items():
        mine = bucketed.registry.records[name]
        if record.residual is not None:
            assert torch.equal(mine.residual, record.residual), name
    assert bucketed.stats()["bytes_sent"] == per_tensor.stats()["bytes_sent"]
    buckets = bucketed.stats()["buckets"]
    compressed = sum(1 for _, record in per_tensor.registry if record.exchange)
    assert buckets["buckets"] == 1 and compressed >= 2
    if "warmup_steps" not in options:  # every step: one collective carries every compressed member
        assert buckets["collectives"] == 5 and buckets["tensors"] == 5 * compressed
    assert buckets["flushed_incomplete"] == 0
    assert "buckets" not in per_tensor.stats()
    assert identical_across_ranks(ours, "bucketed") == []


@pytest.mark.parametrize("factory", ["adam_l2", "adamw"])
@pytest.mark.parametrize("second_moment", ["shared", "calibrated"])
def test_the_second_moments_statistics_travel_with_the_non_finite_count_unless_the_gradients_change(
        second_moment, factory):
    """A step waits for one collective before its local update: synchronize()'s non-finite count and the computed
    second moment's statistics share one allreduce. Changing a gradient between synchronize() and step() (as
    clipping or unscaling does) makes step() reduce the statistics of the changed gradients; both ways train bit for
    bit as the same change made during backward."""
    make = FACTORIES[factory][0]
    mask = torch.ones(64, 32)
    mask[: 16 * (1 + hvd.rank())] = 3.0  # changes the tensor's sketch and block means, not only their scale

    def run(change_after_synchronize: bool) -> Tuple[Dict[str, torch.Tensor], List[List[str]]]:
        torch.manual_seed(0)
        model = Net()
        if not change_after_synchronize:
            model.fc1.weight.register_hook(lambda g: g * mask)
        opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                       compression=TopKEF(ratio=0.1, target="update", second_moment=second_moment))
        local = opt.topk_update_step.local
        reduce, names = local._allreduce_sum, []

        def recorded(values: torch.Tensor, name: str) -> torch.Tensor:
            names[-1].append(name)
            return reduce(values, name)

        local._allreduce_sum = recorded
        for step in range(3):
            names.append([])
            opt.zero_grad()
            x, tokens, y = batch(step)
            nn.functional.cross_entropy(model(x, tokens, True), y).backward()
            opt.synchronize()
            if change_after_synchronize:
                model.fc1.weight.grad.mul_(mask)
            with opt.skip_synchronize():
                opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, names

    during_backward, one_collective = run(change_after_synchronize=False)
    after_synchronize, two_collectives = run(change_after_synchronize=True)
    statistics = {"shared": "topk.update.moments", "calibrated": "topk.update.noise_share"}[second_moment]
    merged = "topk.update.nonfinite_and_" + statistics.rsplit(".", 1)[-1]
    assert one_collective == [[merged]] * 3
    assert two_collectives == [[merged, statistics]] * 3
    assert_same_params(after_synchronize, during_backward, rtol=0, atol=0)
    assert identical_across_ranks(after_synchronize, "after_synchronize") == []
