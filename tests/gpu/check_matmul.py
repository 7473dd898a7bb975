"""GPU checks of meshla's GEMM (meshla/matmul.hpp, through _meshla.Matmul), which every
collective matmul runs, and its scaled fp8 products: each dtype, layout, bias and scaling
against a float64 reference of the same (for fp8, dequantized) operands, on NaN-poisoned outputs
with fresh random inputs; and fp8's refusals in the core's words.

  python tests/gpu/check_matmul.py --results FILE
"""

import itertools
import os

import torch

from meshla import _meshla
from reporting import Reporter, check_parser, relative_error

# The families of checks (``--families``): what tests/gpu/test_gpu_suite.py selects with -k.
FAMILIES = ("products", "fp8")
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# m, n, k: square-ish, ragged (no multiple of the tiles), and a large one. k and the rows of fp8
# operands must be multiples of 16.
SHAPES = [(256, 384, 512), (1000, 528, 272), (8192, 4096, 4096)]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Against the dequantized operands' exact product. A bfloat16 d is rounded to 8 bits. A float32
# d is no better than Hopper's fp8 tensor cores add: their accumulator keeps 13 fraction bits and
# truncates (e8m13; cuBLAS and CUTLASS promote the partial sums into fp32 every few k-steps), so
# a few units of 2^-13 = 1.2e-4, not float32's 2^-24 (seen: 1.0e-4 to 1.3e-4 on H100).
FP8_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 4 * 2.0**-13}


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


class Checks:
    def __init__(self, report: Reporter):
        self.report = report
        self.matmul = _meshla.Matmul(torch.cuda.current_device())

    def run(self, name, body):
        self.report.check(name, body)

    def products(self):
        """bf16, fp16, fp32: b as [k, n] and as [n, k], with and without a bias."""
        for (m, n, k), dtype, trans_b, bias in itertools.product(
                SHAPES, TOLERANCE, (False, True), (False, True)):
            def body():
                a = torch.randn(m, k, device="cuda").to(dtype)
                b = torch.randn(*((n, k) if trans_b else (k, n)), device="cuda").to(dtype)
                c = torch.randn(n, device="cuda").to(dtype) if bias else None
                d = poisoned(m, n, dtype=dtype)
                self.matmul.run(a, b, d, bias=c, trans_b=trans_b, stream=stream())
                want = a.double() @ (b.double().T if trans_b else b.double())
                if bias:
                    want += c.double()
                error = relative_error(d, want)
                return error < TOLERANCE[dtype], f"relative error {error:.2e}"

            self.run(f"{m}x{n}x{k} {str(dtype)[6:]} trans_b={trans_b} bias={bias}", body)

    def fp8(self):
        """Scaled fp8 products, tensorwise and rowwise, e4m3 with e4m3 or e5m2 either way round,
        into bf16 or fp32, a bf16 bias: against the dequantized operands' product in float64."""
        kinds = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
        for (m, n, k), (a_dtype, b_dtype), out, scaling, bias in itertools.product(
                SHAPES, kinds, (torch.bfloat16, torch.float32), ("tensorwise", "rowwise"),
                (False, True)):
            if bias and out == torch.float32:
                continue  # refused below

            def body():
                a, a_scale = quantized(torch.randn(m, k, device="cuda"), a_dtype, scaling)
                b, b_scale = quantized(torch.randn(n, k, device="cuda"), b_dtype, scaling)
                c = torch.randn(n, device="cuda").to(out) if bias else None
                d = poisoned(m, n, dtype=out)
                self.matmul.run(a, b, d, bias=c, trans_b=True, scaling=scaling,
                                a_scale=a_scale, b_scale=b_scale, stream=stream())
                want = dequantized(a, a_scale) @ dequantized(b, b_scale).T
                if bias:
                    want += c.double()
                error = relative_error(d, want)
                tolerance = FP8_TOLERANCE[out]
                return error < tolerance, f"relative error {error:.2e} (tolerance {tolerance})"

            self.run(f"fp8 {m}x{n}x{k} {str(a_dtype)[6:]} x {str(b_dtype)[6:]} -> "
                     f"{str(out)[6:]} {scaling} bias={bias}", body)

        def refused(name, expected, words, **change):
            def body():
                options = dict(a_dtype=E4M3, b_dtype=E4M3, out=torch.bfloat16, trans_b=True,
                               bias=False, scaling="tensorwise")
                options.update(change)
                a, a_scale = quantized(torch.randn(64, 64, device="cuda"), options["a_dtype"],
                                       options["scaling"])
                b, b_scale = quantized(torch.randn(64, 64, device="cuda"), options["b_dtype"],
                                       options["scaling"])
                c = (torch.zeros(64, device="cuda", dtype=options["out"]) if options["bias"]
                     else None)
                try:
                    self.matmul.run(a, b, poisoned(64, 64, dtype=options["out"]), bias=c,
                                    trans_b=options["trans_b"], scaling=options["scaling"],
                                    a_scale=a_scale, b_scale=b_scale, stream=stream())
                except expected as error:
                    return words in str(error), f"{type(error).__name__}: {error}"
                return False, "accepted"

            self.run(f"fp8 refused: {name}", body)

        refused("b as [k, n]", NotImplementedError, "float8 needs b stored [n, k] (trans_b)",
                trans_b=False)
        refused("e5m2 x e5m2", NotImplementedError, "no float8_e5m2 x float8_e5m2 GEMM",
                a_dtype=E5M2, b_dtype=E5M2)
        refused("a bias with a float32 d", NotImplementedError,
                "a float8 product with a float32 d takes no bias", out=torch.float32, bias=True)
        refused("rowwise into float16", NotImplementedError,
                "a rowwise float8 product's d is bfloat16 or float32, not float16",
                out=torch.float16, scaling="rowwise")


    def casts(self):
        """meshla's float8 casts (meshla/float8.hpp) against torch's ops on the same values: each
        group's amax exactly (NaN where a value is), q the float32 product rounded to the float8
        dtype (saturated at its largest, past which torch's cast gives NaN), the transpose
        bitwise q's, alone or with q; 16- and 32-bit t whose rows take the 16-byte loads or not
        (ragged, pitched, off a 16-byte boundary), zero and NaN values; and the layers' cast
        (meshla.torch._float8.quantized) on the GPU bitwise its CPU form, on t and tᵀ."""
        from meshla.torch._float8 import quantized as layers_cast

        counts = {"tensor": lambda t: 1, "rows": lambda t: t.shape[0],
                  "columns": lambda t: t.shape[1]}
        dims = {"tensor": None, "rows": 1, "columns": 0}
        # (rows, cols, row pitch, first column): t = parent[:rows, first:first + cols]
        layouts = [(193, 77, 77, 0), (193, 77, 80, 0), (256, 4096, 4096, 0), (4100, 72, 80, 0),
                   (64, 1000, 1024, 1)]
        for (rows, cols, pitch, first), dtype, fp8, scales in itertools.product(
                layouts, (torch.bfloat16, torch.float16, torch.float32), (E4M3, E5M2),
                ("tensor", "rows", "columns")):
            def body():
                parent = (torch.randn(rows, pitch + first, device="cuda") * 5).to(dtype)
                t = parent[:, first:first + cols]
                t[1] = 0
                magnitude = t.float().abs()
                finite = magnitude.amax() if dims[scales] is None else magnitude.amax(
                    dim=dims[scales])
                t[2, 3] = float("nan")
                amax = torch.full((counts[scales](t),), -1.0, device="cuda")
                _meshla.float8_amax(t, scales, amax, stream())
                magnitude = t.float().abs()
                want = magnitude.amax() if dims[scales] is None else magnitude.amax(
                    dim=dims[scales])
                amax_ok = torch.equal(amax.nan_to_num(-2.0), want.reshape(-1).nan_to_num(-2.0))
                # Multipliers that take each group's largest finite value to 1.5x the dtype's
                # largest: the top of the range saturates, the rest rounds.
                multiplier = 1.5 * FP8_MAX[fp8] / finite.reshape(-1).clamp(min=1e-3)
                poison = torch.full((rows, cols), 0x7F, dtype=torch.uint8, device="cuda")
                q, q_t = poison.clone().view(fp8), poison.t().contiguous().view(fp8)
                _meshla.float8_cast(t, scales, multiplier, q, q_t, stream())
                only_t = poison.t().contiguous().view(fp8)
                _meshla.float8_cast(t, scales, multiplier, None, only_t, stream())
                shaped = multiplier.reshape(-1, 1) if scales == "rows" else multiplier
                want_q = (t.float() * shaped).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
                # As values (NaN's bytes may differ between the two casts; poison is NaN too).
                same = torch.equal(q.float().nan_to_num(7.0), want_q.float().nan_to_num(7.0))
                transposed = (torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
                              and torch.equal(only_t.view(torch.uint8), q_t.view(torch.uint8)))
                # The layers' cast on t without its NaN, and on tᵀ (a view whose rows are not
                # unit-stride): the GPU's bytes and scales are the CPU's.
                t[2, 3] = 0
                layers = True
                for view in (t, t.t()):
                    gpu = layers_cast(view, fp8, scales, transposed=True)
                    cpu = layers_cast(view.cpu(), fp8, scales, transposed=True)
                    layers = layers and all(
                        torch.equal(g.cpu().view(torch.uint8), c.view(torch.uint8))
                        if g.dtype == fp8 else torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
                return amax_ok and same and transposed and layers, (
                    f"amax exact {amax_ok}, q {same}, transposes bitwise {transposed}, "
                    f"layers' cast as on the CPU {layers}")

            self.run(f"float8 cast {rows}x{cols} (pitch {pitch}, from column {first}) "
                     f"{str(dtype)[6:]} -> {str(fp8)[6:]} scales={scales}", body)


def quantized(x: torch.Tensor, dtype, scaling: str):
    """x in fp8 with float32 scales (x ≈ q * scale): one scale, or one per row ([rows])."""
    amax = (x.abs().amax() if scaling == "tensorwise" else x.abs().amax(dim=1)).clamp(min=1e-12)
    scale = (amax / FP8_MAX[dtype]).float()
    q = (x / (scale if scaling == "tensorwise" else scale[:, None])).to(dtype)
    return q, scale.reshape(-1).contiguous()


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale.double()
    return q.double() * (scale if scale.numel() == 1 else scale[:, None])


def main():
    args = check_parser(__doc__, "matmul", FAMILIES).parse_args()
    report = Reporter(args.results, args.model, args.families)
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    checks = Checks(report)
    report.family("products", checks.products)
    report.family("fp8", checks.fp8)
    report.family("fp8", checks.casts)


if __name__ == "__main__":
    main()
