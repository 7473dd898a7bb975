"""The tensor-parallel layers on CPU tensors over gloo: an MLP of a ColumnParallelLinear and a
RowParallelLinear on 2 and 4 ranks, with and without sequence parallelism, against one process's
float64 torch.nn.Linear pair; their initialisation against torch.nn.Linear's; argument checks."""

import copy
import itertools
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import meshla.torch as mt

SEQ_PER_RANK, BATCH, HIDDEN, FFN_PER_RANK = 3, 2, 8, 6
MODES = ((False, False), (True, False), (True, True))  # (sequence_parallel, recompute_gathered)


def _whole_problem(seed, size):
    """The whole MLP (float32 torch.nn.Linear pair), its input [s, b, h] and the loss weights."""
    torch.manual_seed(seed)
    fc1 = torch.nn.Linear(HIDDEN, FFN_PER_RANK * size)
    fc2 = torch.nn.Linear(FFN_PER_RANK * size, HIDDEN)
    x = torch.randn(SEQ_PER_RANK * size, BATCH, HIDDEN)
    g = torch.randn(SEQ_PER_RANK * size, BATCH, HIDDEN)
    return fc1, fc2, x, g


def _mlp_worker(rank, size, seed, results):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        fc1, fc2, x, g = _whole_problem(seed, size)
        own = slice(rank * SEQ_PER_RANK, (rank + 1) * SEQ_PER_RANK)
        for (sp, recompute), compiled in itertools.product(MODES, (False, True)):
            col = mt.ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=sp,
                                                      recompute_gathered=recompute)
            row = mt.RowParallelLinear.from_linear(fc2, group, sequence_parallel=sp)

            def mlp(x):
                hidden = col(x)
                return hidden, row(F.gelu(hidden))

            # Compiled whole (fullgraph: no break around the ops, whose fake shapes are tp's, with
            # symbolic sizes), forward and backward, by AOTAutograd without code generation.
            run = (torch.compile(mlp, backend="aot_eager", fullgraph=True, dynamic=True)
                   if compiled else mlp)
            x_in = (x[own] if sp else x).clone().requires_grad_()
            hidden, y = run(x_in)
            loss = (y * (g[own] if sp else g)).sum()
            params = [col.weight, col.bias, row.weight, row.bias]
            grads = torch.autograd.grad(loss, [x_in, *params])
            results[(rank, sp, recompute, compiled)] = {
                "hidden_shape": tuple(hidden.shape), "y": y.detach(),
                "grads": [t.detach() for t in grads],
                "params": [p.detach().clone() for p in params],
            }

        for sp, recompute in MODES:
            # fuse_wgrad_accumulation: the weights' gradients go to their main_grad, on top of
            # what is there; Megatron's mark is on one of the two.
            col = mt.ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=sp,
                                                      recompute_gathered=recompute,
                                                      fuse_wgrad_accumulation=True)
            row = mt.RowParallelLinear.from_linear(fc2, group, sequence_parallel=sp,
                                                   fuse_wgrad_accumulation=True)
            layers = (col, row)
            generator = torch.Generator().manual_seed(seed + rank)
            priors = [torch.randn(layer.weight.shape, generator=generator) for layer in layers]
            for layer, prior in zip(layers, priors):
                layer.weight.main_grad = prior.clone()
            row.weight.grad_added_to_main_grad = False
            x_in = (x[own] if sp else x).clone().requires_grad_()
            y = row(F.gelu(col(x_in)))
            (y * (g[own] if sp else g)).sum().backward()
            results[(rank, sp, recompute, "fused")] = {
                "added": [layer.weight.main_grad - prior for layer, prior in zip(layers, priors)],
                "weight_grads": [None if layer.weight.grad is None else
                                 tuple(layer.weight.grad.shape) for layer in layers],
                "mark": row.weight.grad_added_to_main_grad,
                "grads": [x_in.grad, col.bias.grad, row.bias.grad],
            }

        # Drawn as torch.nn.Linear draws, from the same state on every rank: the shards of the
        # layer torch.nn.Linear would have made.
        torch.manual_seed(seed + 1)
        drawn = [mt.ColumnParallelLinear(HIDDEN, FFN_PER_RANK * size, group),
                 mt.RowParallelLinear(FFN_PER_RANK * size, HIDDEN, group)]
        generator = torch.Generator().manual_seed(seed + 2)
        drawn[1].reset_parameters(generator)
        results[(rank, "drawn")] = [[layer.weight.detach(), layer.bias.detach()]
                                    for layer in drawn]

        row = mt.RowParallelLinear(FFN_PER_RANK * size, HIDDEN, group, sequence_parallel=True)
        try:
            row(torch.randn(size + 1, BATCH, FFN_PER_RANK))
            results[(rank, "error")] = None
        except ValueError as e:
            results[(rank, "error")] = str(e)
    finally:
        dist.destroy_process_group()


def _rel(x, y):
    return ((x.double() - y).norm() / y.norm()).item()


@pytest.mark.parametrize("size", [2, 4])
def test_mlp_matches_the_whole_layers(gloo_env, size):
    results = mp.Manager().dict()
    seed = torch.randint(0, 2**31, ()).item()
    mp.spawn(_mlp_worker, args=(size, seed, results), nprocs=size, join=True)

    fc1, fc2, x, g = _whole_problem(seed, size)
    fc1, fc2 = fc1.double(), fc2.double()
    x, g = x.double().requires_grad_(), g.double()
    y = fc2(F.gelu(fc1(x)))
    params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    want = torch.autograd.grad((y * g).sum(), [x, *params])
    ffn = FFN_PER_RANK * size

    for rank in range(size):
        cols = slice(rank * FFN_PER_RANK, (rank + 1) * FFN_PER_RANK)
        own = slice(rank * SEQ_PER_RANK, (rank + 1) * SEQ_PER_RANK)
        # This rank's shards of each parameter (and of its gradient); the row bias is whole.
        shards = [lambda t: t[cols], lambda t: t[cols], lambda t: t[:, cols], lambda t: t]
        for (sp, recompute), compiled in itertools.product(MODES, (False, True)):
            got = results[(rank, sp, recompute, compiled)]
            case = (rank, sp, recompute, compiled, seed)
            seq = slice(None) if not sp else own
            assert got["hidden_shape"] == (SEQ_PER_RANK * size, BATCH, FFN_PER_RANK), case
            assert got["y"].shape == y[seq].shape, case
            assert _rel(got["y"], y[seq].detach()) < 1e-5, case
            for shard, p, mine in zip(shards, params, got["params"]):
                assert torch.equal(mine.double(), shard(p.detach())), case
            assert got["grads"][0].shape == x[seq].shape, case
            assert _rel(got["grads"][0], want[0][seq]) < 1e-5, case
            for name, shard, mine, whole in zip(("w1", "b1", "w2", "b2"), shards,
                                                got["grads"][1:], want[1:]):
                assert mine.shape == shard(whole).shape, (case, name)
                assert _rel(mine, shard(whole)) < 1e-5, (case, name)
        for sp, recompute in MODES:
            fused = results[(rank, sp, recompute, "fused")]
            case = (rank, sp, recompute, "fused", seed)
            seq = slice(None) if not sp else own
            for mine, shard, whole in zip(fused["added"], shards[::2], want[1::2]):
                assert _rel(mine, shard(whole)) < 1e-5, case
            # No .grad where unmarked; marked: the mark set, a placeholder of the weight's shape.
            assert fused["weight_grads"] == [None, tuple(shards[2](want[3]).shape)], case
            assert fused["mark"] is True, case
            for mine, whole in zip(fused["grads"], (want[0][seq], shards[1](want[2]), want[4])):
                assert _rel(mine, whole) < 1e-5, case

        torch.manual_seed(seed + 1)
        column = torch.nn.Linear(HIDDEN, ffn)
        generator = torch.Generator().manual_seed(seed + 2)
        row = torch.nn.Linear(ffn, HIDDEN)
        row.weight.data = torch.nn.init.kaiming_uniform_(torch.empty(HIDDEN, ffn),
                                                         a=5**0.5, generator=generator)
        row.bias.data = torch.empty(HIDDEN).uniform_(-ffn**-0.5, ffn**-0.5,
                                                     generator=generator)
        (cw, cb), (rw, rb) = results[(rank, "drawn")]
        assert torch.equal(cw, column.weight.detach()[cols])
        assert torch.equal(cb, column.bias.detach()[cols])
        assert torch.equal(rw, row.weight.detach()[:, cols]) and torch.equal(rb, row.bias)
        assert results[(rank, "error")] == (
            f"RowParallelLinear: sequence_parallel scatters x's first dimension, but "
            f"x.shape=[{size + 1}, {BATCH}, {FFN_PER_RANK}] has {size + 1} there, not divisible "
            f"by tp_size={size}")


def test_layers_check_their_arguments(world1):
    with pytest.raises(ValueError, match=r"group must be a meshla.torch.TPGroup, got NoneType"):
        mt.ColumnParallelLinear(4, 6, None)
    with pytest.raises(ValueError, match=r"in_features=0 and out_features=6 must be positive"):
        mt.RowParallelLinear(0, 6, world1)
    with pytest.raises(ValueError, match=r"recompute_gathered=True needs sequence_parallel=True"):
        mt.ColumnParallelLinear(4, 6, world1, recompute_gathered=True)
    with pytest.raises(ValueError, match=r"backend='fast' is not one of"):
        mt.RowParallelLinear(4, 6, world1, backend="fast")
    with pytest.raises(ValueError, match=r"device=cuda:0 but the group's communicator uses cpu"):
        mt.ColumnParallelLinear(4, 6, world1, device="cuda:0")
    with pytest.raises(ValueError, match=r"linear must be a torch.nn.Linear, got Conv1d"):
        mt.RowParallelLinear.from_linear(torch.nn.Conv1d(4, 6, 1), world1)
    with pytest.raises(ValueError, match=r"from_linear: dtype= comes from linear"):
        mt.RowParallelLinear.from_linear(torch.nn.Linear(4, 6), world1, dtype=torch.float16)
    col = mt.ColumnParallelLinear(4, 6, world1, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"x must be a tensor \[s, \.\.\., 4\] \(sequence first\)"
                                         r", got \[4\]"):
        col(torch.randn(4))
    row = mt.RowParallelLinear(4, 6, world1)
    with pytest.raises(ValueError, match=r"x must be a tensor \[\.\.\., 4\], got \[2, 5\]"):
        row(torch.randn(2, 5))


def test_fused_wgrad_accumulation_refuses_what_it_cannot_do(world1):
    """fuse_wgrad_accumulation: a missing or mismatched main_grad is named with the shapes at the
    backward; an autocast copy of a trained weight (which has no main_grad) and torch.compile's
    fullgraph are refused at the forward; a frozen weight is left alone."""
    x = torch.randn(3, 4, requires_grad=True)
    for cls in (mt.ColumnParallelLinear, mt.RowParallelLinear):
        layer = cls(4, 6, world1, fuse_wgrad_accumulation=True)
        assert "fuse_wgrad_accumulation=True" in repr(layer)
        with pytest.raises(ValueError, match=r"fuse_wgrad_accumulation=True\): the weight needs a "
                                             r"\.main_grad of torch\.float32, shape \[6, 4\], on "
                                             r"cpu, before the backward \(Megatron-FSDP.s: from "
                                             r"get_main_grad\(\)\); it has none"):
            layer(x).sum().backward()
        layer.weight.main_grad = torch.zeros(4, 6)
        with pytest.raises(ValueError, match=r"it has torch\.float32 \[4, 6\] on cpu"):
            layer(x).sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(ValueError, match=r"b is torch\.float32 but the call computes in "
                                                 r"torch\.bfloat16 \(torch\.autocast\)"):
                layer(x)
            layer.weight.requires_grad_(False)
            layer(x).sum().backward()  # frozen: nothing to accumulate, nothing refused
            layer.weight.requires_grad_(True)
        torch._dynamo.reset()
        with pytest.raises((NotImplementedError, RuntimeError), match=r"runs eagerly only"):
            torch.compile(layer, backend="aot_eager", fullgraph=True)(x)


def test_fused_wgrad_accumulation_follows_megatron(world1):
    """fuse_wgrad_accumulation under non-reentrant activation checkpointing (whose saved tensors
    are detached copies, without main_grad), with a main_grad in the weight's dtype, and with
    Megatron's zero_out_wgrad (tied weights, whose placeholder .grad its DDP adds: zeros)."""
    for cls in (mt.ColumnParallelLinear, mt.RowParallelLinear):
        for dtype in (torch.float32, torch.bfloat16):
            layer = cls(4, 6, world1, fuse_wgrad_accumulation=True, dtype=dtype)
            reference = torch.nn.Linear(4, 6, dtype=torch.float64)
            with torch.no_grad():
                reference.weight.copy_(layer.weight)
                reference.bias.copy_(layer.bias)
            prior = torch.randn(6, 4).to(dtype)
            layer.weight.main_grad = prior.clone()
            layer.weight.grad_added_to_main_grad = False
            layer.weight.zero_out_wgrad = True
            x = torch.randn(5, 4).to(dtype)
            y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            g = torch.randn(5, 6).to(dtype)
            (y * g).sum().backward()
            (reference(x.double()) * g.double()).sum().backward()
            added = layer.weight.main_grad.double() - prior.double()
            assert _rel(added, reference.weight.grad) < (1e-5 if dtype == torch.float32 else 2e-2)
            assert layer.weight.grad_added_to_main_grad is True
            assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))


class _FsdpWeight:
    """What Megatron-FSDP gives a parameter: ``__fsdp_param__`` and ``get_main_grad()``, which
    hands out the buffer (here: counting the calls)."""

    def __init__(self, weight, buffer):
        self.buffer, self.calls = buffer, 0
        weight.__fsdp_param__ = True
        weight.get_main_grad = self

    def __call__(self):
        self.calls += 1
        return self.buffer


def test_fused_wgrad_accumulation_follows_megatron_fsdp(world1):
    """Megatron-FSDP's parameters: the main_grad is asked of get_main_grad() at the backward, and
    overwrite_main_grad makes the gradient replace the buffer's contents (a NaN there is not read)
    instead of adding to them."""
    for cls, overwrite in itertools.product((mt.ColumnParallelLinear, mt.RowParallelLinear),
                                            (False, True)):
        layer = cls(4, 6, world1, fuse_wgrad_accumulation=True)
        reference = torch.nn.Linear(4, 6, dtype=torch.float64)
        with torch.no_grad():
            reference.weight.copy_(layer.weight)
            reference.bias.copy_(layer.bias)
        prior = torch.full((6, 4), float("nan")) if overwrite else torch.randn(6, 4)
        fsdp = _FsdpWeight(layer.weight, prior.clone())
        layer.weight.overwrite_main_grad = overwrite
        x = torch.randn(5, 4)
        g = torch.randn(5, 6)
        (layer(x) * g).sum().backward()
        (reference(x.double()) * g.double()).sum().backward()
        assert fsdp.calls == 1 and layer.weight.main_grad is fsdp.buffer
        written = fsdp.buffer.double() - (0 if overwrite else prior.double())
        assert _rel(written, reference.weight.grad) < 1e-5, (cls.__name__, overwrite)
        assert layer.weight.grad is None


def test_layers_at_one_rank_are_linear(world1):
    """At tp=1 both layers compute torch.nn.Linear's product: any leading dimensions, a 1-D input,
    no bias; parameters deferred on meta and drawn later; from_linear keeps the dtype; autocast
    runs them in its dtype."""
    linear = torch.nn.Linear(4, 6)
    x = torch.randn(2, 3, 4)
    for cls in (mt.ColumnParallelLinear, mt.RowParallelLinear):
        layer = cls.from_linear(linear, world1)
        with torch.no_grad():
            assert torch.allclose(layer(x), linear(x), atol=1e-6)
            assert layer(x[0, 0]).shape == (6,)
            assert torch.allclose(layer(x[0, 0]), linear(x[0, 0]), atol=1e-6)
            plain = cls(4, 6, world1, bias=False)
            assert plain.bias is None
            assert torch.allclose(plain(x), x @ plain.weight.t(), atol=1e-6)

            deferred = cls(4, 6, world1, device="meta")
            assert deferred.weight.is_meta and deferred.bias.is_meta
            assert deferred(x.to("meta")).shape == (2, 3, 6)  # shapes without data
            deferred.to_empty(device="cpu")
            deferred.reset_parameters(torch.Generator().manual_seed(5))
            layer.reset_parameters(torch.Generator().manual_seed(5))
            assert torch.equal(deferred.weight, layer.weight)
            assert torch.equal(deferred.bias, layer.bias)

            half = cls.from_linear(copy.deepcopy(linear).to(torch.bfloat16), world1)
            assert half.weight.dtype == half.bias.dtype == torch.bfloat16
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert layer(x).dtype == torch.bfloat16
        assert "tp_size=1, rank=0, sequence_parallel=False" in repr(layer)


def test_a_copied_layer_keeps_its_group(world1):
    """copy.deepcopy (an EMA or reference model) copies the parameters and shares the group,
    which is a handle to this process's communicators; pickling the group says why it cannot."""
    layer = mt.RowParallelLinear(4, 6, world1, sequence_parallel=True)
    twin = copy.deepcopy(layer)
    assert twin.group is world1 and copy.copy(world1) is world1
    assert twin.weight is not layer.weight and torch.equal(twin.weight, layer.weight)
    x = torch.randn(3, 2, 4)
    with torch.no_grad():
        assert torch.equal(twin(x), layer(x))
    with pytest.raises(TypeError, match="a TPGroup cannot be pickled"):
        pickle.dumps(layer)


def test_megatron_tensor_parallel_marks(world1):
    """The shards carry Megatron-LM's tensor-parallel marks (its gradient clipping and parameter
    norm count a shard on every rank only with them); a row-parallel bias is whole, unmarked."""
    col = mt.ColumnParallelLinear(4, 6, world1)
    row = mt.RowParallelLinear(4, 6, world1)
    for parameter, dim in ((col.weight, 0), (col.bias, 0), (row.weight, 1)):
        assert parameter.tensor_model_parallel is True
        assert (parameter.partition_dim, parameter.partition_stride) == (dim, 1)
    assert not hasattr(row.bias, "tensor_model_parallel")
