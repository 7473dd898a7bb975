"""GPU correctness checks of the grouped GEMM (one GPU), one JSON line per check.

  python tests/gpu/check_grouped.py --results FILE

Every check draws fresh random inputs and splits (skewed, with empty groups), poisons the outputs
with NaN, runs the pass and compares with a float64 per-group loop over the same (rounded)
inputs: ||out - ref|| / ||ref|| under a per-dtype threshold; among the shapes, one whose last
tiles are split in two halves of their k-tiles, which must be split there and repeat bitwise.
The "padded" family runs feature sizes TMA cannot read (copied into the workspace, padded with
zeros). Also: the module's autograd and its packed, aligned gradients; device-side rejection of bad
m_splits; CUDA-graph capture with m_splits changing between replays; delayed weight gradients on
a side stream under allocator pressure; torch.compile.
"""

import copy
import os
import itertools
import traceback

import torch

import meshla.torch as mt
from meshla.torch import grouped
from reporting import Reporter, check_parser, relative_error

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}
# (groups, in_features, out_features, rows); 24 x 40 makes out*in*2 bytes a non-multiple of 256;
# 3 groups of 13000 rows have odd tile counts in most groups; 24 x 4096 x 4096 cuts its large groups
# into strips (12 M-tiles, whose rows fill a quarter of a 50 MB L2) and spreads its small ones
# (at most 2 M-tiles) among them.
SHAPES = [(4, 64, 32, 300), (8, 1024, 512, 8192), (3, 40, 24, 100), (1, 256, 128, 77),
          (16, 512, 256, 5000), (3, 256, 384, 13000), (24, 4096, 4096, 32000)]
# Features that are not multiples of 8, run padded in 16 bits (GroupedMatmul's padded copies):
# out only (1000 x 1001, issue 41's example), in only, both, and both with a partial last tile.
PADDED_SHAPES = [(4, 1000, 1001, 3000), (3, 61, 64, 700), (6, 37, 45, 1500), (2, 300, 130, 257)]
PASS = mt.grouped._PASS
# Group sizes whose rows end at every point of a 64-row k-tile of the weight gradient (1-4 of its
# 16-row k-blocks hold rows, or all of them), with an empty group; 184 output features make the
# last M-tile a partial one (56 rows), so the trimmed k-tail also runs on it.
K_TAIL_SIZES = [1, 16, 17, 32, 33, 48, 49, 63, 64, 65, 0, 130, 191]
K_TAIL_SHAPE = (len(K_TAIL_SIZES), 256, 184, sum(K_TAIL_SIZES))


def split_tail_sizes(sms: int) -> list[int]:
    """Group sizes (in_features 1024, out_features 512) whose forward and dgrad tiles overflow
    full waves of `sms` CTAs by a few tiles, so that the order's last tiles are claimed in two
    halves of their k-tiles (gemm/sm90_tile_marks.hpp, split_tail_tiles): sms // 2 + 1 full M-tiles
    and a 40-row one, on 2 N-tiles forward and 4 dgrad, leave 4 and 8 tiles in the last wave of
    an even `sms`. An empty group too."""
    full = sms // 2 + 1
    return [128 * (full - full // 2 - full // 4), 0, 128 * (full // 2), 40, 128 * (full // 4)]


# What a split tile's cancelling sum comes to (check_split_tails).
SPLIT_MARK = 2.0 ** -14
# The grouped-portable model: 16-bit groups on the portable kernel (no CUTLASS stream-K splits).
PORTABLE = os.environ.get("MESHLA_PORTABLE") == "1"


def cancelling(k: int) -> torch.Tensor:
    """A length-k vector whose float32 sum in order is 0, and SPLIT_MARK when summed from k-tile
    k_tiles // 2 on and then added to the sum before it: SPLIT_MARK first, then +2048 and -2048 at
    the starts of the two k-tiles from there (2048 + 2^-14 rounds to 2048 in float32; all three
    values are exact in bfloat16 and float16)."""
    split = (k // 64) // 2 * 64
    v = torch.zeros(k)
    v[0] = SPLIT_MARK
    v[split] = 2048.0
    v[split + 64] = -2048.0
    return v


def random_splits(groups: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Skewed sizes summing to rows, with about a quarter of the groups empty."""
    weights = torch.rand(groups, generator=generator) ** 3
    weights[torch.rand(groups, generator=generator) < 0.25] = 0
    if weights.sum() == 0:
        weights[0] = 1
    sizes = (weights / weights.sum() * rows).floor().long()
    sizes[int(torch.argmax(weights))] += rows - int(sizes.sum())
    return sizes


def reference(pass_name, x, dy, weight, bias, sizes):
    """Float64 per-group loop on the host-known sizes."""
    outs, start = [], 0
    for g, size in enumerate(sizes.tolist()):
        rows = slice(start, start + size)
        if pass_name == "forward":
            y = x[rows].double() @ weight[g].double().T
            outs.append(y if bias is None else y + bias[g].double())
        elif pass_name == "dgrad":
            outs.append(dy[rows].double() @ weight[g].double())
        elif pass_name == "wgrad":
            outs.append((dy[rows].double().T @ x[rows].double()).unsqueeze(0))
        else:
            outs.append(dy[rows].double().sum(0, keepdim=True))
        start += size
    return torch.cat(outs)


def check_passes(report, dtype, shape, seed, sizes=None, sizes_dtype=torch.int64):
    """Every pass on `shape` against the float64 reference, with random splits unless `sizes`,
    given to the passes as int64 or int32 (JAX's ragged_dot's) group sizes."""
    groups, in_features, out_features, rows = shape
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    sizes = random_splits(groups, rows, gen) if sizes is None else torch.tensor(sizes)
    m_splits = sizes.to(dev, sizes_dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dev, dtype)
    dy = torch.randn(rows, out_features, generator=gen).to(dev, dtype)
    # Weights in a padded packed buffer, as GroupedLinear keeps them.
    stride = mt.packed_group_stride(out_features, in_features, dtype)
    flat = torch.randn(groups * stride, generator=gen).to(dev, dtype)
    weight = grouped._packed(flat, groups, out_features, in_features, stride)
    bias = torch.randn(groups, out_features, generator=gen).to(dev, dtype)
    tag = f"{str(dtype)[6:]}/G{groups}x{in_features}x{out_features}/rows{rows}"
    if sizes_dtype != torch.int64:
        tag += f"/{str(sizes_dtype)[6:]}-sizes"
    nan = float("nan")

    def compare(name, out, ref, per_row_group=True):
        """The worst group's relative error (a global norm would let a small group's rows be
        lost within the tolerance); groups whose reference is all zero are checked elsewhere."""
        if per_row_group:
            pairs = zip(out.split(sizes.tolist()), ref.split(sizes.tolist()))
        else:
            pairs = zip(out, ref)
        err = max((relative_error(o, r) for o, r in pairs if r.numel() and r.norm() > 0),
                  default=0.0)
        if not torch.isfinite(out).all():
            err = float("inf")
        ok = err <= TOLERANCE[dtype]
        report.record(f"{name}/{tag}", 0, ok, f"worst group's relative error {err:.2e}")

    for with_bias in (False, True):
        y = torch.full((rows, out_features), nan, device=dev, dtype=dtype)
        grouped._run(PASS.forward, m_splits, x, x=x, weight=weight,
                      bias=bias if with_bias else None, y=y)
        compare("forward" + ("+bias" if with_bias else ""), y,
                reference("forward", x, None, weight, bias if with_bias else None, sizes))
    dx = torch.full((rows, in_features), nan, device=dev, dtype=dtype)
    grouped._run(PASS.dgrad, m_splits, dy, dy=dy, weight=weight, dx=dx)
    compare("dgrad", dx, reference("dgrad", None, dy, weight, None, sizes))

    dweight_flat = torch.full((groups * stride,), nan, device=dev, dtype=dtype)
    dweight = grouped._packed(dweight_flat, groups, out_features, in_features, stride)
    grouped._run(PASS.wgrad, m_splits, x, x=x, dy=dy, dweight=dweight)
    want = reference("wgrad", x, dy, None, None, sizes)
    compare("wgrad", dweight, want, per_row_group=False)
    empty = sizes == 0
    if empty.any():
        report.record(f"wgrad-empty-groups-zero/{tag}", 0,
                      bool(torch.all(dweight[empty.to(dev)] == 0)),
                      f"{int(empty.sum())} empty groups")
    if stride > out_features * in_features:
        gaps = dweight_flat.view(groups, stride)[:, out_features * in_features:]
        report.record(f"wgrad-padding-untouched/{tag}", 0, bool(torch.isnan(gaps).all()),
                      "the padding between groups keeps its NaN poison")

    start = torch.randn(groups, out_features, in_features, generator=gen).to(dev)
    main_grad = start.clone()
    grouped._run(PASS.wgrad, m_splits, x, x=x, dy=dy, dweight=main_grad,
                 accumulate=True)
    compare("wgrad-accumulate", main_grad, start.double() + want, per_row_group=False)
    if empty.any():
        report.record(f"wgrad-accumulate-empty-untouched/{tag}", 0,
                      bool(torch.equal(main_grad[empty.to(dev)], start[empty.to(dev)])),
                      f"{int(empty.sum())} empty groups")

    dbias = torch.full((groups, out_features), nan, device=dev, dtype=dtype)
    grouped._run(PASS.bias_grad, m_splits, dy, dy=dy, dbias=dbias)
    compare("bias_grad", dbias, reference("bias_grad", None, dy, None, None, sizes),
            per_row_group=False)


def check_split_tails(report, dtype):
    """On split_tail_sizes, the last tiles are split, and their results repeat bitwise. Split or
    not shows in the sum of `cancelling` rows (SPLIT_MARK split, 0 whole): some outputs, at most
    split_capacity tiles' worth, are SPLIT_MARK, the rest 0 (on the portable kernel, which
    never splits, all 0). Then two calls with random inputs give the same bits: the halves add
    in the same order on every call."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sizes = split_tail_sizes(sms)
    rows, in_features, out_features = sum(sizes), 1024, 512
    m_splits = torch.tensor(sizes, device=dev)
    ones_x = torch.ones(rows, in_features, device=dev, dtype=dtype)
    ones_dy = torch.ones(rows, out_features, device=dev, dtype=dtype)
    forward_w = cancelling(in_features).expand(len(sizes), out_features, in_features)
    dgrad_w = cancelling(out_features)[:, None].expand(len(sizes), out_features, in_features)
    gen = torch.Generator().manual_seed(29)
    x = torch.randn(rows, in_features, generator=gen).to(dev, dtype)
    dy = torch.randn(rows, out_features, generator=gen).to(dev, dtype)
    weight = torch.randn(len(sizes), out_features, in_features, generator=gen).to(dev, dtype)

    def forward(x, w, out):
        grouped._run(PASS.forward, m_splits, x, x=x, weight=w, bias=None, y=out)

    def dgrad(dy, w, out):
        grouped._run(PASS.dgrad, m_splits, dy, dy=dy, weight=w, dx=out)

    for name, run, ones, probe, operand, columns in (
            ("forward", forward, ones_x, forward_w, x, out_features),
            ("dgrad", dgrad, ones_dy, dgrad_w, dy, in_features)):
        tag = f"{name}/{str(dtype)[6:]}"
        out = torch.full((rows, columns), float("nan"), device=dev, dtype=dtype)
        run(ones, probe.to(dev, dtype).contiguous(), out)
        halves = out == SPLIT_MARK
        tiles = int(halves.sum()) / (128 * 256)
        if PORTABLE:  # the portable kernel sums k in order, in one tile: never split
            ok = bool((out == 0).all())
        else:
            ok = bool(((out == 0) | halves).all()) and 0 < tiles <= sms // 8
        report.record(f"split-tails-taken/{tag}", 0, ok,
                      f"{tiles:.2f} tiles' outputs from split tiles (at most "
                      f"{0 if PORTABLE else sms // 8})")
        outs = [torch.full((rows, columns), float("nan"), device=dev, dtype=dtype)
                for _ in range(2)]
        for out in outs:
            run(operand, weight, out)
        report.record(f"split-tails-repeat/{tag}", 0,
                      bool(torch.equal(outs[0], outs[1])) and not outs[0].isnan().any().item(),
                      "two calls, bitwise")


def check_module_autograd(report, dtype, seed):
    torch.manual_seed(seed)
    groups, in_features, out_features, rows = 6, 128, 72, 1000
    layer = mt.GroupedLinear(groups, in_features, out_features, device="cuda", dtype=dtype)
    sizes = random_splits(groups, rows, torch.Generator().manual_seed(seed))
    x = torch.randn(rows, in_features, device="cuda", dtype=dtype, requires_grad=True)
    y = layer(x, sizes.cuda())
    dy = torch.randn_like(y)
    y.backward(dy)
    weights = [w.detach() for w in layer.weights()]
    biases = [b.detach() for b in layer.biases()]
    x64 = x.detach().double().requires_grad_()
    w64 = [w.double().requires_grad_() for w in weights]
    b64 = [b.double().requires_grad_() for b in biases]
    outs, start = [], 0
    for g, size in enumerate(sizes.tolist()):
        outs.append(x64[start:start + size] @ w64[g].T + b64[g])
        start += size
    ref = torch.cat(outs)
    ref.backward(dy.double())
    tag = str(dtype)[6:]
    tol = TOLERANCE[dtype]
    errors = {"y": relative_error(y, ref.detach()), "dx": relative_error(x.grad, x64.grad)}
    for g in range(groups):
        errors[f"dW{g}"] = relative_error(layer.weights()[g].grad, w64[g].grad) if sizes[g] else \
            float(layer.weights()[g].grad.abs().max())
        errors[f"db{g}"] = relative_error(layer.biases()[g].grad, b64[g].grad) if sizes[g] else \
            float(layer.biases()[g].grad.abs().max())
    worst = max(errors, key=errors.get)
    report.record(f"module-autograd/{tag}", 0, errors[worst] <= tol,
                  f"worst {worst}: {errors[worst]:.2e}")
    grads = [w.grad for w in layer.weights()]
    base = grads[0].untyped_storage().data_ptr()
    packed = all(g.untyped_storage().data_ptr() == base and (g.data_ptr() - base) % 256 == 0
                 for g in grads)
    report.record(f"module-grads-packed-aligned/{tag}", 0, packed,
                  "every weight gradient is a 256-byte aligned view of one buffer")


def check_ragged_layout(report, dtype, seed):
    """grouped_matmul with rhs [G, k, n] (torch._grouped_mm's layout; the core swaps the passes'
    roles): output and every gradient against float64, an empty group's rhs gradient zero,
    feature sizes that are not multiples of 8 (padded copies on Hopper, whose bias goes in after
    the product at the padded layout's group index)."""
    torch.manual_seed(seed)
    groups, k, n, rows = 5, 203, 75, 900
    sizes = random_splits(groups, rows, torch.Generator().manual_seed(seed))
    sizes[1] = 0
    sizes[0] = rows - int(sizes[1:].sum())
    lhs = torch.randn(rows, k, device="cuda", dtype=dtype, requires_grad=True)
    rhs = (torch.randn(groups, k, n, device="cuda") / k ** 0.5).to(dtype).requires_grad_()
    bias = torch.randn(groups, n, device="cuda", dtype=dtype, requires_grad=True)
    out = mt.grouped_matmul(lhs, rhs, sizes.cuda(), bias)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    lhs64, rhs64, bias64 = (t.detach().double().requires_grad_() for t in (lhs, rhs, bias))
    pieces, start = [], 0
    for g, size in enumerate(sizes.tolist()):
        pieces.append(lhs64[start:start + size] @ rhs64[g] + bias64[g])
        start += size
    ref = torch.cat(pieces)
    ref.backward(d_out.double())
    errors = {"out": relative_error(out, ref.detach()),
              "d_lhs": relative_error(lhs.grad, lhs64.grad),
              "d_rhs": relative_error(rhs.grad, rhs64.grad),
              "d_bias": relative_error(bias.grad, bias64.grad)}
    worst = max(errors, key=errors.get)
    empty_zero = not rhs.grad[1].any().item() and not bias.grad[1].any().item()
    report.record(f"ragged-layout/{str(dtype)[6:]}", 0,
                  errors[worst] <= TOLERANCE[dtype] and empty_zero,
                  f"worst {worst}: {errors[worst]:.2e}; empty group's gradients zero: "
                  f"{empty_zero}")


def _value_error_of(call) -> str:
    """The ValueError that ``call()`` raises, as text, or "nothing raised"."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return "nothing raised"


def check_bad_splits(report):
    dev = torch.device("cuda")
    x = torch.randn(64, 32, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 32, device=dev, dtype=torch.bfloat16)
    for (sizes, expected), sizes_dtype in itertools.product(
            (([30, -2, 36], "m_splits[1]=-2 is negative"),
             ([10, 10, 10], "sums to 30 but the input has 64 rows")), (torch.int64, torch.int32)):
        y = mt.grouped_linear(x, torch.tensor(sizes, device=dev, dtype=sizes_dtype), w)
        torch.cuda.synchronize()
        poisoned = bool(torch.isnan(y).all())
        raised = _value_error_of(
            lambda: mt.grouped_linear(x, torch.tensor([64, 0, 0], device=dev), w))
        report.record(f"bad-splits/{sizes}/{str(sizes_dtype)[6:]}", 0,
                      poisoned and expected in raised,
                      f"output all NaN: {poisoned}; next call: {raised}")
    mt.grouped_linear(x, torch.tensor([1, 2, 3], device=dev), w)
    raised = _value_error_of(mt.check_device_errors)
    report.record("bad-splits/check_device_errors", 0, "sums to 6" in raised, raised)

    # grouped_matmul's bad sizes, found on the device, in its own words (its forward runs as the
    # [G, out, in] kernels' dgrad, padded here: 16 and 30 features are not multiples of 8 for
    # bf16), then grouped_linear's in theirs: each report names the function whose call it was.
    lhs = torch.randn(64, 30, device=dev, dtype=torch.bfloat16)
    rhs = torch.randn(3, 30, 16, device=dev, dtype=torch.bfloat16)
    for name, (call, expected) in {
            "grouped_matmul": (lambda: mt.grouped_matmul(lhs, rhs, torch.tensor(
                [30, -2, 36], device=dev)), "grouped_matmul: group_sizes[1]=-2 is negative"),
            "grouped_linear": (lambda: mt.grouped_linear(x, torch.tensor(
                [1, 2, 3], device=dev), w), "grouped_linear: m_splits sums to 6")}.items():
        call()
        raised = _value_error_of(mt.check_device_errors)
        report.record(f"bad-splits/words/{name}", 0, expected in raised, raised)

    # A bad call on a side stream, still queued behind a wait there (a delayed weight gradient's
    # case): check_device_errors() from the current stream waits for it too.
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # about 30 ms on an H100
        mt.grouped_linear(x, torch.tensor([1, 2, 3], device=dev), w)
    raised = _value_error_of(mt.check_device_errors)
    torch.cuda.synchronize()
    report.record("bad-splits/check_device_errors-side-stream", 0, "sums to 6" in raised, raised)

    # Every pass poisons its whole output when m_splits are bad: the CUTLASS passes (bf16 on
    # Hopper) in their table kernel, the portable kernel's (fp32; bf16 under grouped-portable) and
    # the bias gradient in a kernel of their own.
    bad = torch.tensor([10, 10, 10], device=dev)
    dy = torch.randn(64, 16, device=dev, dtype=torch.bfloat16)
    stride = mt.packed_group_stride(16, 32, torch.bfloat16)
    # The accumulated gradients by address (the op's form): three matrices of one buffer, the
    # poison must reach each of them.
    main_grad = torch.randn(3, 16, 32, device=dev)
    passes = {
        "forward-fp32": lambda: torch.ops.meshla.grouped_mm(x.float(), bad, w.float(), None),
        "dgrad": lambda: torch.ops.meshla.grouped_mm_dgrad(dy, bad, w),
        "wgrad": lambda: torch.ops.meshla.grouped_mm_wgrad(x, dy, bad, stride),
        "wgrad-accumulate": lambda: (
            torch.ops.meshla.grouped_mm_wgrad_accumulate_(x, dy, bad, list(main_grad.unbind(0))),
            main_grad)[1],
        "bias-grad": lambda: torch.ops.meshla.grouped_bias_grad(dy, bad, 3),
    }
    for name, run in passes.items():
        out = run()
        torch.cuda.synchronize()
        poisoned = bool(torch.isnan(out).all())
        raised = _value_error_of(mt.check_device_errors)
        report.record(f"bad-splits-poison/{name}", 0, poisoned and "sums to 30" in raised,
                      f"output all NaN: {poisoned}; check_device_errors: {raised}")


def check_main_grads_anywhere(report, dtype):
    """Weight gradients accumulated into main_grad tensors laid out as Megatron's gradient buffer
    lays out a module's parameters: in reverse order, each with its bias between, at uneven gaps
    (a bucket's padding); then the module's backward with Megatron's grad_added_to_main_grad mark,
    and a CUDA graph of it after a warm-up step."""
    groups, in_features, out_features, rows = 6, 256, 128, 3000
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(19)
    sizes = random_splits(groups, rows, gen)
    m_splits = sizes.to(dev)
    x = torch.randn(rows, in_features, generator=gen).to(dev, dtype)
    dy = torch.randn(rows, out_features, generator=gen).to(dev, dtype)
    matrix = out_features * in_features
    gaps = [out_features + 4 * (g % 3) for g in range(groups)]  # the bias, then 0-8 more floats
    buffer = torch.randn(sum(gaps) + groups * matrix, generator=gen).to(dev)
    offsets, at = [], buffer.numel()
    for g in range(groups):  # group 0 last, as a reversed parameter list puts it
        at -= matrix + gaps[g]
        offsets.append(at)
    main_grads = [buffer[o:o + matrix].view(out_features, in_features) for o in offsets]
    start = buffer.clone()
    torch.ops.meshla.grouped_mm_wgrad_accumulate_(x, dy, m_splits, main_grads)
    want = reference("wgrad", x, dy, None, None, sizes)
    err = max(relative_error(main_grads[g], start[o:o + matrix].view_as(main_grads[g]).double()
                             + want[g]) for g, o in enumerate(offsets))
    outside = torch.ones_like(buffer, dtype=torch.bool)
    for o in offsets:
        outside[o:o + matrix] = False
    untouched = bool(torch.equal(buffer[outside], start[outside]))
    tag = str(dtype)[6:]
    report.record(f"main-grads-anywhere/{tag}", 0, err <= TOLERANCE[dtype] and untouched,
                  f"worst group's relative error {err:.2e}; gaps untouched: {untouched}")

    layer = mt.GroupedLinear(groups, in_features, out_features, device=dev, dtype=dtype,
                             fuse_wgrad_accumulation=True)
    for weight, grad in zip(layer.weights(), main_grads):
        weight.main_grad = grad
        weight.grad_added_to_main_grad = False  # as Megatron's DDP marks its parameters
    xl = x.detach().requires_grad_()

    def step():
        layer(xl, m_splits).backward(dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the warm-up: the main_grad addresses reach the device here
    torch.cuda.current_stream().wait_stream(side)
    marked = all(w.grad_added_to_main_grad and w.grad is not None for w in layer.weights())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    before = buffer.clone()
    graph.replay()
    torch.cuda.synchronize()
    err = max(relative_error(main_grads[g], before[o:o + matrix].view_as(main_grads[g]).double()
                             + want[g]) for g, o in enumerate(offsets))
    report.record(f"main-grads-anywhere-module-graph/{tag}", 0,
                  marked and err <= TOLERANCE[dtype],
                  f"marked with placeholder grads: {marked}; replay's worst group error {err:.2e}")


def check_main_grads_fsdp(report, dtype):
    """The module's backward with Megatron-FSDP's weights: each main_grad is asked of
    get_main_grad(); the even groups' weights carry overwrite_main_grad and their buffers start
    full of NaN, which the gradient replaces; the odd groups' buffers are added to."""
    groups, in_features, out_features, rows = 6, 256, 128, 3000
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(23)
    sizes = random_splits(groups, rows, gen)
    m_splits = sizes.to(dev)
    x = torch.randn(rows, in_features, generator=gen).to(dev, dtype)
    dy = torch.randn(rows, out_features, generator=gen).to(dev, dtype)
    starts = [torch.full((out_features, in_features), float("nan"), device=dev) if g % 2 == 0
              else torch.randn(out_features, in_features, generator=gen).to(dev)
              for g in range(groups)]
    buffers = [start.clone() for start in starts]
    layer = mt.GroupedLinear(groups, in_features, out_features, device=dev, dtype=dtype,
                             fuse_wgrad_accumulation=True)
    for g, weight in enumerate(layer.weights()):
        weight.__fsdp_param__ = True
        weight.get_main_grad = lambda buffer=buffers[g]: buffer
        weight.overwrite_main_grad = g % 2 == 0
    layer(x.detach().requires_grad_(), m_splits).backward(dy)
    torch.cuda.synchronize()
    want = reference("wgrad", x, dy, None, None, sizes)
    err = max(relative_error(buffers[g], want[g] if g % 2 == 0 else starts[g].double() + want[g])
              for g in range(groups))
    asked = all(w.main_grad is b for w, b in zip(layer.weights(), buffers))
    report.record(f"main-grads-fsdp/{str(dtype)[6:]}", 0, err <= TOLERANCE[dtype] and asked,
                  f"worst group's relative error {err:.2e} (even groups overwritten, odd added "
                  f"to); buffers from get_main_grad: {asked}")


def check_graph_capture(report, dtype):
    """Forward and backward of the functional op captured once; replays with new inputs and new
    device-side splits (the host never learns them) must all be right."""
    groups, in_features, out_features, rows = 8, 256, 128, 2048
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, in_features, device=dev, dtype=dtype, requires_grad=True)
    weight = torch.randn(groups, out_features, in_features, device=dev, dtype=dtype,
                         requires_grad=True)
    m_splits = random_splits(groups, rows, gen).to(dev)
    dy = torch.randn(rows, out_features, device=dev, dtype=dtype)

    def step():
        y = mt.grouped_linear(x, m_splits, weight)
        dx, dw = torch.autograd.grad(y, [x, weight], dy)
        return y, dx, dw

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    worst = 0.0
    for replay in range(10):
        sizes = random_splits(groups, rows, gen)
        m_splits.copy_(sizes)
        with torch.no_grad():
            x.copy_(torch.randn(rows, in_features, generator=gen))
            weight.copy_(torch.randn(groups, out_features, in_features, generator=gen))
            dy.copy_(torch.randn(rows, out_features, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        y, dx, dw = outputs
        worst = max(worst, relative_error(y, reference("forward", x, None, weight, None, sizes)),
                    relative_error(dx, reference("dgrad", None, dy, weight, None, sizes)),
                    relative_error(dw, reference("wgrad", x, dy, None, None, sizes)))
    report.record(f"graph-replay-new-splits/{str(dtype)[6:]}", 0, worst <= TOLERANCE[dtype],
                  f"worst relative error over 10 replays {worst:.2e}")


def check_cold_capture(report):
    """The first grouped call of a process may come inside a graph capture: it creates the
    device's engine (a host-mapped status word) there, which must not invalidate the capture."""
    groups, in_features, out_features, rows = 4, 128, 64, 512
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    torch.cuda.synchronize()
    grouped._engines.clear()  # as in a fresh process
    x = torch.randn(rows, in_features, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(groups, out_features, in_features, device=dev, dtype=torch.bfloat16)
    m_splits = random_splits(groups, rows, gen).to(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mt.grouped_linear(x, m_splits, weight)
    sizes = random_splits(groups, rows, gen)
    m_splits.copy_(sizes)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    err = relative_error(y, reference("forward", x, None, weight, None, sizes))
    report.record("graph-capture-cold-engine", 0, err <= TOLERANCE[torch.bfloat16],
                  f"relative error {err:.2e}")


def check_edge_shapes(report):
    """A batch without rows trains (backward included); empty feature dimensions are refused;
    the bias gradient takes more rows than its grid has blocks (65535 x 128)."""
    dev = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float32):
        layer = mt.GroupedLinear(3, 64, 32, device=dev, dtype=dtype)
        x = torch.zeros(0, 64, device=dev, dtype=dtype, requires_grad=True)
        try:
            layer(x, torch.zeros(3, dtype=torch.int64, device=dev)).sum().backward()
            grads = [p.grad for p in layer.parameters()]
            ok = x.grad.shape == (0, 64) and all(g is not None and torch.count_nonzero(g) == 0
                                                for g in grads)
            detail = "zero weight and bias gradients"
        except Exception as e:  # the failure this check exists for
            ok, detail = False, f"{type(e).__name__}: {e}"
        report.record(f"empty-batch-backward/{str(dtype)[6:]}", 0, ok, detail)

    x = torch.randn(4, 8, device=dev, dtype=torch.bfloat16)
    try:
        mt.grouped_linear(x, torch.tensor([4, 0], device=dev),
                          torch.empty(2, 0, 8, device=dev, dtype=torch.bfloat16))
        ok, detail = False, "no error for weight.shape=[2, 0, 8]"
    except ValueError as e:
        ok, detail = "out_features=0" in str(e) and "[2, 0, 8]" in str(e), str(e)
    report.record("empty-features-refused", 0, ok, detail)

    rows, out_features = 65535 * 128 + 1000, 16
    gen = torch.Generator().manual_seed(13)
    sizes = torch.tensor([rows // 3, 0, rows - rows // 3])
    dy = torch.randn(rows, out_features, generator=gen).to(dev, torch.bfloat16)
    dbias = torch.ops.meshla.grouped_bias_grad(dy, sizes.to(dev), 3)
    ref = torch.stack([part.double().sum(0) for part in dy.split(sizes.tolist())])
    err = max(relative_error(dbias[g], ref[g]) for g in (0, 2))
    ok = err <= TOLERANCE[torch.bfloat16] and bool(torch.all(dbias[1] == 0))
    report.record("bias-grad-many-rows", 0, ok, f"{rows} rows, worst group's error {err:.2e}")


def check_delayed_wgrad_side_stream(report):
    """backward() computes dgrad only; backward_dw() on a side stream, held back by a sleep
    kernel, while the main stream frees the saved inputs and churns the allocator. Without the
    module's stream bookkeeping the inputs' memory would be reused and overwritten."""
    torch.manual_seed(11)
    dtype = torch.bfloat16
    groups, in_features, out_features, rows = 8, 512, 256, 4096
    layer = mt.GroupedLinear(groups, in_features, out_features, bias=False, device="cuda",
                             dtype=dtype, delay_wgrad_compute=True)
    sizes = random_splits(groups, rows, torch.Generator().manual_seed(11))
    x = torch.randn(rows, in_features, device="cuda", dtype=dtype)
    dy = torch.randn(rows, out_features, device="cuda", dtype=dtype)
    want = reference("wgrad", x, dy, None, None, sizes)
    layer(x.clone().requires_grad_(), sizes.cuda()).backward(dy.clone())
    del x, dy
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        layer.backward_dw()
    for _ in range(50):  # allocator pressure on the main stream while the side stream waits
        junk = torch.full((rows, in_features), float("nan"), device="cuda", dtype=dtype)
        junk2 = torch.full((rows, out_features), float("nan"), device="cuda", dtype=dtype)
        del junk, junk2
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    got = torch.stack([w.grad for w in layer.weights()])
    err = relative_error(got, want)
    report.record("delayed-wgrad-side-stream", 0, err <= TOLERANCE[dtype],
                  f"relative error {err:.2e}")


def check_compile(report):
    """torch.compile(fullgraph=True) of the functional form and of the module: the forward against
    the float64 reference, every gradient (x, weight, bias) against eager's."""
    dtype = torch.bfloat16
    groups, in_features, out_features, rows = 4, 128, 64, 512
    gen = torch.Generator().manual_seed(5)
    sizes = random_splits(groups, rows, gen).cuda()
    x = torch.randn(rows, in_features, generator=gen).to("cuda", dtype).requires_grad_()
    w = torch.randn(groups, out_features, in_features, generator=gen).to("cuda", dtype)
    b = torch.randn(groups, out_features, generator=gen).to("cuda", dtype)
    w.requires_grad_()
    b.requires_grad_()

    def f(x, w, b):
        return torch.relu(mt.grouped_linear(x, sizes, w, b))

    y = torch.compile(f, fullgraph=True)(x, w, b)
    grads = torch.autograd.grad(y.sum(), [x, w, b])
    want = torch.relu(reference("forward", x.detach(), None, w.detach(), b.detach(), sizes.cpu()))
    err = relative_error(y, want)
    eager = torch.autograd.grad(f(x, w, b).sum(), [x, w, b])
    grad_err = max(relative_error(got, e.double()) for got, e in zip(grads, eager))

    layer = mt.GroupedLinear(groups, in_features, out_features, device="cuda", dtype=dtype)
    twin = copy.deepcopy(layer)
    torch.compile(layer, fullgraph=True)(x.detach(), sizes).sum().backward()
    twin(x.detach(), sizes).sum().backward()
    module_err = max(relative_error(p.grad, q.grad.double())
                     for p, q in zip(layer.parameters(), twin.parameters()))
    ok = max(err, grad_err, module_err) <= TOLERANCE[dtype]
    report.record("torch-compile", 0, ok,
                  f"forward {err:.2e}; gradients against eager: functional {grad_err:.2e}, "
                  f"module {module_err:.2e}")


# The families of checks (``--families``): what tests/gpu/test_gpu_suite.py selects with -k.
FAMILIES = ("capture", "passes", "padded", "autograd", "errors", "main-grads", "edges",
            "compile")


def main():
    parser = check_parser(__doc__, "grouped", FAMILIES)
    args = parser.parse_args()
    report = Reporter(args.results, args.model, args.families)
    # (family, name, check). First: the engine must be created inside a capture, before any
    # other call makes it.
    checks = [("capture", "cold-capture", lambda: check_cold_capture(report))]
    checks += [("passes", f"passes/{dtype}/{shape}",
                lambda d=dtype, s=shape, i=i: check_passes(report, d, s, i))
               for i, (dtype, shape) in enumerate((d, s) for d in TOLERANCE for s in SHAPES)]
    checks += [("padded", f"padded/{dtype}/{shape}",
                lambda d=dtype, s=shape, i=i: check_passes(report, d, s, 41 + i))
               for i, (dtype, shape) in enumerate((d, s) for d in TOLERANCE
                                                  for s in PADDED_SHAPES)]
    checks += [("passes", f"passes-k-tails/{d}",
                lambda d=d: check_passes(report, d, K_TAIL_SHAPE, 17, sizes=K_TAIL_SIZES))
               for d in TOLERANCE]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split_sizes = split_tail_sizes(sms)
    checks += [("passes", f"passes-split-tails/{d}",
                lambda d=d: check_passes(report, d, (len(split_sizes), 1024, 512, sum(split_sizes)),
                                         23, sizes=split_sizes))
               for d in TOLERANCE]
    checks += [("passes", f"passes-int32-sizes/{d}",
                lambda d=d: check_passes(report, d, SHAPES[4], 29, sizes_dtype=torch.int32))
               for d in TOLERANCE]
    checks += [("passes", f"split-tails/{d}", lambda d=d: check_split_tails(report, d))
               for d in (torch.bfloat16, torch.float16)]
    checks += [("autograd", f"module/{d}", lambda d=d: check_module_autograd(report, d, 3))
               for d in TOLERANCE]
    checks += [("autograd", f"ragged-layout/{d}", lambda d=d: check_ragged_layout(report, d, 7))
               for d in TOLERANCE]
    checks += [("errors", "bad-splits", lambda: check_bad_splits(report))]
    checks += [("capture", f"graph/{d}", lambda d=d: check_graph_capture(report, d))
               for d in (torch.bfloat16, torch.float32)]
    checks += [("main-grads", f"main-grads-anywhere/{d}",
                lambda d=d: check_main_grads_anywhere(report, d))
               for d in (torch.bfloat16, torch.float32)]
    checks += [("main-grads", f"main-grads-fsdp/{d}", lambda d=d: check_main_grads_fsdp(report, d))
               for d in (torch.bfloat16, torch.float32)]
    checks += [("edges", "edge-shapes", lambda: check_edge_shapes(report)),
               ("main-grads", "delayed-wgrad", lambda: check_delayed_wgrad_side_stream(report)),
               ("compile", "compile", lambda: check_compile(report))]

    def guarded(name, check):
        try:
            check()
        except Exception:
            report.record(name, 0, False, traceback.format_exc(limit=4))
        print(f"done {name}", flush=True)

    for family, name, check in checks:
        report.family(family, guarded, name, check)


if __name__ == "__main__":
    main()
