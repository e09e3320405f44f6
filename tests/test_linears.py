"""export/serve/kernels: CPU serving linears (the few-row GEMV kernel, oneDNN) and the paged decode attention kernel
give the model's own outputs."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import model_config


def test_the_gemv_kernel_builds_here_and_equals_f_linear():
    """csrc/linears.cpp on this machine (AVX-512 or AVX2): every row count 1-8, both dtypes, odd sizes (a tail of
    input columns past the vector width, output rows past the row group), with and without a bias."""
    from export.serve.kernels import kernel

    gemv = kernel()
    assert gemv is not None, "the GEMV kernel did not build on this machine (see the warning)"
    check_all(gemv)


def test_the_kernel_s_threads_share_out_a_weight_and_give_one_thread_s_result():
    """A weight split between 2 threads in pieces (csrc/simd.h `shared_work`), with a busy Python thread on the
    same cores preempting one of them so that the other takes pieces from the end of its share: every output the
    one-thread result to the bit (a row's sums do not depend on which thread reads it), for the few-row linear and
    the routed experts (`run_tasks`)."""
    import threading

    from export.serve.kernels import kernel

    gemv = kernel()
    torch.manual_seed(0)
    w = torch.randn(8192, 512).bfloat16()
    x = torch.randn(3, 512).bfloat16()
    counts = [1, 2, 0, 3, 1, 1, 2, 1]  # 8 SwiGLU experts, 2 MB of fc1 weight each
    w1 = [torch.randn(2048, 512).bfloat16() for _ in counts]
    w2 = [(torch.randn(512, 1024) * 0.1).bfloat16() for _ in counts]
    xe = torch.randn(sum(counts), 512).bfloat16()

    def run():
        return [gemv.linear(x[:m].contiguous(), w, None) for m in (1, 3)] + [
            gemv.expert_mlps(xe, counts, w1, [], w2, [], True)]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = run()
    finally:
        torch.set_num_threads(threads)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(1000))

    hog = threading.Thread(target=busy, daemon=True)
    hog.start()
    try:
        torch.set_num_threads(2)
        for _ in range(20):
            for got, want in zip(run(), alone):
                assert torch.equal(got, want)
    finally:
        stop.set()
        hog.join()
        torch.set_num_threads(threads)


def test_served_weights_move_into_a_file_mapping_and_keep_their_values(monkeypatch, tmp_path):
    """map_weights: every large CPU weight reachable from a model (its ServingWeights' detached copies too, which
    share a storage) reads the same values from an unlinked file's mapping (in /proc/self/maps), the kernel gives
    the same outputs, small tensors stay where they are; `serve --no-map-weights` leaves everything alone."""
    from export.serve.kernels import ServingLinear, kernel, map_weights, options

    gemv = kernel()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 8)).bfloat16()
    big = ServingLinear(model[0])
    served = big.served.weight  # the ServingWeight's own tensor (a detached view of the parameter's storage)
    before, small = served.clone(), model[1].weight.data_ptr()
    x = torch.randn(1, 1024).bfloat16()
    want = gemv.linear(x, served, None)

    def mapped(t):
        ptr = t.data_ptr()
        for line in open("/proc/self/maps"):
            span, *rest = line.split()
            lo, hi = (int(a, 16) for a in span.split("-"))
            if lo <= ptr < hi:
                return "moe-pipeline-weights-" in line and line.rstrip().endswith("(deleted)")
        return False

    with options.using(map_weights=False):
        assert map_weights(model, big, directory=str(tmp_path)) == 0 and not mapped(served)
    assert map_weights(model, big, directory=str(tmp_path)) >= served.numel() * 2
    assert mapped(served) and mapped(model[0].weight) and model[1].weight.data_ptr() == small
    assert torch.equal(served, before) and torch.equal(model[0].weight, before)
    assert torch.equal(gemv.linear(x, served, None), want)
    assert list(tmp_path.iterdir()) == []  # unlinked once mapped


def test_the_gemv_kernel_avx2_build_equals_f_linear():
    """The AVX2 + FMA variant (CPUs without AVX-512: most laptops), built here too where the CPU can run it, with the
    prefetch hint this CPU's own build does not take (so that both hints' code is compiled and checked here)."""
    from export.serve.kernels import build, prefetch_hint

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU runs neither variant")
    gemv = build("AVX2", hint="nta" if prefetch_hint() == "t0" else "t0")
    check_all(gemv)


def test_the_prefetch_hint_follows_the_cpu_or_the_option():
    from export.serve.kernels import options, prefetch_hint

    vendor = next(line for line in open("/proc/cpuinfo") if line.startswith("vendor_id"))
    assert options.current().prefetch == "auto" and prefetch_hint() == ("t0" if "GenuineIntel" in vendor else "nta")
    for hint in ("t0", "NTA"):
        with options.using(prefetch=hint):
            assert prefetch_hint() == hint.lower()
    with pytest.raises(ValueError, match="--prefetch 'l2': use t0, nta or auto"):
        prefetch_hint("l2")


def test_the_gemv_kernel_avx512_build_without_bf16_dot_products_equals_f_linear():
    """On a CPU with AVX512_BF16 the kernel's bf16 path is VDPBF16PS; the AVX-512 build without it (Skylake, Ice
    Lake, Zen 4 before the flag is read) widens bf16 by a shift instead: built and checked here too."""
    from export.serve.kernels import build, cpu_isa

    if cpu_isa() not in ("AVX512_BF16", "AMX_BF16"):  # AMX_BF16's build holds AVX512_BF16's code and AMX's ops
        pytest.skip("this CPU has no AVX512_BF16: the default build is already the plain AVX-512 one")
    check_all(build("AVX512"))


def check_all(gemv):
    """Every op of a build of csrc/ against its reference."""
    check_kernel(gemv)
    check_attention(gemv)
    check_experts(gemv)
    check_experts(gemv, C=128, width=64, counts=(1, 3, 9, 2))  # int4 experts too (groups of 64)
    # experts of 16 rows and more (AVX512_BF16: tiles.h's tiles of 1 to 3 blocks of 16 rows, partial blocks; an odd
    # hidden size; 100 rows: 7 blocks as 3 + 2 + 2) beside ones of fewer rows
    check_experts(gemv, C=202, width=72, counts=(20, 3, 49, 16, 100, 15))
    check_experts(gemv, C=256, width=128, counts=(20, 3, 49, 16))  # int4 experts in tiles too (groups of 64)
    check_norm(gemv)
    check_argmax(gemv)
    check_screen(gemv)
    check_screen_topk(gemv)
    check_screen_sample(gemv)
    check_int8(gemv)
    check_int4(gemv)
    check_routed(gemv)
    check_combine(gemv)
    if hasattr(gemv, "amx_linear"):
        check_amx(gemv)
    if hasattr(gemv, "w8a8_linear"):
        check_w8a8(gemv)
    if hasattr(gemv, "screen_argmax_i4"):
        check_quantized_screen(gemv)


def check_w8a8(gemv):
    """W8A8 (AVX512_VNNI builds): `w8a8_linear` against F.linear on x rounded to int8 steps a row at a time
    (`int8_activations`) and the dequantised weight, fp32 to its sums' order and bf16 to one rounding, 1 to 300 rows
    (several row blocks of 64), sizes off the tiles (200 outputs, 130 inputs), with and without a bias, a row of
    zeros, a row with a NaN (all NaN out); the tiles unpack to the int8 values; W8A8 experts (`expert_mlps`) equal to each expert's W8A8 linears and
    activation in turn, an expert without rows and one of 70 (two row blocks), SwiGLU and GeLU."""
    import torch.nn.functional as F

    from export.serve import kernels
    from export.serve.kernels import W8A8Weight, int8_activations
    from pipeline.quantize import quantize_int8

    torch.manual_seed(0)
    w = torch.randn(200, 130) * 0.05
    q, scale = quantize_int8(w)
    W = W8A8Weight(q, scale)
    W.q, W.scale = gemv.vnni_pack(q), torch.stack([scale, q.sum(1).float()])  # this build's tiles
    assert torch.equal(W.values(), q)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for M in (1, 5, 64, 65, 300):
            x = torch.randn(M, 130).to(dtype)
            x[0] = 0.0
            if M > 1:
                x[1, 3] = float("nan")  # a row that is not finite gives NaN, as F.linear would
            for bias in (None, torch.randn(200).to(dtype)):
                y = gemv.w8a8_linear(x, W.q, W.scale, bias)
                ref = F.linear(int8_activations(x), W.dequantized(torch.float32), None if bias is None else bias.float())
                ok = torch.ones(M, dtype=torch.bool)
                ok[1:2] = M == 1
                assert y.dtype == dtype and torch.allclose(y[ok].float(), ref[ok], atol=tol, rtol=tol)
                assert (y[0].float() == (0 if bias is None else bias.float())).all()
                assert M == 1 or y[1].isnan().all()
    C, Fh = 192, 128
    for swiglu in (True, False):
        counts, ws = [3, 0, 70, 1], []
        for _ in counts:
            w1 = W8A8Weight.of(torch.randn((2 if swiglu else 1) * Fh, C) * 0.05)
            w2 = W8A8Weight.of(torch.randn(C, Fh) * 0.05)
            for v in (w1, w2):
                v.gemv = gemv
            ws.append((w1, torch.randn(w1.shape[0]), w2, torch.randn(C)))
        x = torch.randn(sum(counts), C)
        w1s, b1s, w2s, b2s, s1s, s2s = kernels.expert_tensors(ws)
        y = gemv.expert_mlps(x, counts, w1s, b1s, w2s, b2s, swiglu, s1s, s2s)
        ref, r = [], 0
        for (w1, b1, w2, b2), n in zip(ws, counts):
            h = gemv.w8a8_linear(x[r:r + n].contiguous(), w1.q, w1.scale, b1)
            r += n
            a = F.silu(h[:, :Fh]) * h[:, Fh:] if swiglu else F.gelu(h)
            ref.append(gemv.w8a8_linear(a.contiguous(), w2.q, w2.scale, b2))
        assert torch.allclose(y, torch.cat(ref), atol=1e-5, rtol=1e-5)


def check_amx(gemv):
    """amx_linear (AMX builds) against F.linear in fp32: 1 to 256 rows (one or two row tiles, several 32-row
    blocks, a partial one), outputs past a 32-output pair (padded with zeros), with and without a bias; each row's
    result the same whatever rows come with it; the wrong shapes named."""
    assert gemv.amx_ready(), "this CPU has AMX but Linux did not give the process its tile state"
    torch.manual_seed(0)
    for out_f, in_f in [(512, 256), (7, 64), (1000, 96), (50, 1024)]:
        w = torch.randn(out_f, in_f).bfloat16()
        b = torch.randn(out_f).bfloat16()
        packed = gemv.amx_pack(w)
        x = torch.randn(256, in_f).bfloat16()
        for bias in (None, b):
            alone = gemv.amx_linear(x[:1].contiguous(), packed, out_f, bias)
            for rows in (1, 2, 15, 16, 17, 31, 32, 33, 100, 256):
                ref = F.linear(x[:rows].float(), w.float(), None if bias is None else bias.float())
                got = gemv.amx_linear(x[:rows].contiguous(), packed, out_f, bias)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
                torch.testing.assert_close(got.float(), ref, atol=1e-2 * in_f ** 0.5, rtol=1e-2)
                assert torch.equal(got[:1], alone)
    # expert_mlps' AMX path: experts of more rows than one pass (9-40; 1 and 3 stay on VDPBF16PS), widths of 32s
    check_experts(gemv, C=256, width=96, counts=(1, 9, 40, 17, 3, 32))
    with pytest.raises(RuntimeError, match="in a multiple of 32"):
        gemv.amx_pack(torch.randn(8, 40).bfloat16())
    with pytest.raises(RuntimeError, match=r"packed is amx_pack of a \[40, 64\] weight"):
        gemv.amx_linear(torch.randn(2, 64).bfloat16(), gemv.amx_pack(torch.randn(8, 64).bfloat16()), 40, None)
    with pytest.raises(RuntimeError, match="1 to 256 rows"):
        gemv.amx_linear(torch.randn(257, 64).bfloat16(), gemv.amx_pack(torch.randn(8, 64).bfloat16()), 8, None)


def check_int8(gemv):
    """int8_linear against F.linear on the dequantised weight (scale * q) in fp32: 1 to 19 rows (several passes of 8, a
    partial one), sizes off the vector widths, fp32 and bf16 inputs, with and without a bias; a pass's rows the same as
    those rows alone; quantize_int8's rows within half a step of the weight; bad input named."""
    from pipeline.quantize import quantize_int8

    torch.manual_seed(0)
    for out_f, in_f in [(512, 256), (7, 100), (513, 257), (3, 33), (1024, 1024)]:
        w = torch.randn(out_f, in_f)
        w[1] = 0  # a row of zeros: zeros out
        q, scale = quantize_int8(w, chunk=100)
        assert q.dtype == torch.int8 and scale.dtype == torch.float32 and int(q.abs().max()) == 127
        assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
        deq = q.float() * scale[:, None]
        for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
            x = torch.randn(19, in_f).to(dtype)
            b = torch.randn(out_f).to(dtype)
            for bias in (None, b):
                alone = {n: gemv.int8_linear(x[8:8 + n].contiguous(), q, scale, bias) for n in (1, 8)}
                for rows in (1, 2, 3, 5, 8, 9, 16, 19):
                    ref = F.linear(x[:rows].float(), deq, None if bias is None else bias.float())
                    got = gemv.int8_linear(x[:rows].contiguous(), q, scale, bias)
                    assert got.dtype == dtype and got.shape == (rows, out_f)
                    torch.testing.assert_close(got.float(), ref, atol=tol * in_f ** 0.5, rtol=tol)
                    assert not got[:, 1].any() or bias is not None
                    if rows in (9, 16):  # the second pass: as those rows alone
                        assert torch.equal(got[8:], alone[rows - 8])
    with pytest.raises(RuntimeError, match="q int8"):
        gemv.int8_linear(torch.randn(2, 16), torch.randn(8, 16), torch.ones(8), None)
    with pytest.raises(RuntimeError, match="x fp32 or bf16"):
        gemv.int8_linear(torch.randn(2, 16).double(), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8), None)
    with pytest.raises(RuntimeError, match="bias of x's dtype"):
        gemv.int8_linear(torch.randn(2, 16), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8),
                         torch.ones(8).bfloat16())


def check_int4(gemv):
    """int4_linear against F.linear on the dequantised weight in fp32: groups of 64 and 128, 1 to 19 rows (passes of
    8), fp32 and bf16 inputs, with and without a bias; pack_int4 and unpack_int4 inverse; bad input named."""
    from pipeline.quantize import dequantized, pack_int4, quantize_int4, unpack_int4

    torch.manual_seed(0)
    for out_f, in_f, group in [(512, 256, 128), (7, 128, 64), (33, 384, 128), (1024, 1024, 128)]:
        q, scale = quantize_int4(torch.randn(out_f, in_f), group=group)
        packed = pack_int4(q)
        assert packed.dtype == torch.uint8 and packed.shape == (out_f, in_f // 2) and torch.equal(unpack_int4(packed), q)
        deq = dequantized(q, scale, group)
        for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
            x = torch.randn(19, in_f).to(dtype)
            b = torch.randn(out_f).to(dtype)
            for bias in (None, b):
                for rows in (1, 2, 3, 8, 9, 19):
                    ref = F.linear(x[:rows].float(), deq, None if bias is None else bias.float())
                    got = gemv.int4_linear(x[:rows].contiguous(), packed, scale, bias, group)
                    assert got.dtype == dtype and got.shape == (rows, out_f)
                    torch.testing.assert_close(got.float(), ref, atol=tol * in_f ** 0.5, rtol=tol)
    with pytest.raises(RuntimeError, match="groups of a multiple of 64"):
        gemv.int4_linear(torch.randn(2, 128), torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), None, 48)
    with pytest.raises(RuntimeError, match=r"scale fp32 \[out, in / group\]"):
        gemv.int4_linear(torch.randn(2, 128), torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 1), None, 64)
    with pytest.raises(ValueError, match="a multiple of 64"):
        pack_int4(torch.zeros(2, 100, dtype=torch.int8))


def check_kernel(gemv):
    assert gemv.MAX_ROWS == 8
    torch.manual_seed(0)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
        for out_f, in_f in [(512, 256), (7, 100), (513, 257), (1, 16), (3072, 1024)]:
            w = torch.randn(out_f, in_f).to(dtype)
            b = torch.randn(out_f).to(dtype)
            for rows in range(1, 9):
                x = torch.randn(rows, in_f).to(dtype)
                for bias in (None, b):
                    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
                    got = gemv.linear(x, w, bias)
                    assert got.dtype == dtype and got.shape == (rows, out_f)
                    torch.testing.assert_close(got.float(), ref, atol=tol * in_f ** 0.5, rtol=tol)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        gemv.linear(torch.randn(9, 16), torch.randn(8, 16), None)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        gemv.linear(torch.randn(1, 16).double(), torch.randn(8, 16).double(), None)


def check_experts(kernel, C=200, width=70, counts=(1, 3, 5, 2, 9, 4)):
    """expert_mlps of this build against the experts one at a time (F.linear, F.silu or F.gelu, F.linear): SwiGLU
    and GeLU, with and without biases, experts of 1 to 9 rows (past the kernel's 4 a pass), a width off the
    kernel's blocks, both dtypes; bf16 equal to the bit where F.linear's sums round alike. int8 and int4 experts (their
    packed weights, and scales per row or per group of 64 as s1, s2; `quantize_int8`,
    the scales as s1, s2) against the same on their dequantised weights."""
    from pipeline.quantize import quantize_int8
    from pipeline.quantize import dequantized, pack_int4, quantize_int4

    torch.manual_seed(0)
    counts = list(counts)
    schemes = (False, "int8", "int4") if C % 64 == 0 and width % 64 == 0 else (False, "int8")  # int4: groups of 64
    for (dtype, tol), swiglu, bias, int8 in itertools.product(((torch.float32, 1e-5), (torch.bfloat16, 2e-2)),
                                                              (True, False), (False, True), schemes):
        weights, quantised = [], []  # per expert: (w1, b1, w2, b2) as the kernel takes them; with int8, (q1, s1, q2, s2)
        for _ in counts:
            w1 = torch.randn((2 if swiglu else 1) * width, C).to(dtype)
            w2 = (torch.randn(C, width) * 0.1).to(dtype)
            if int8 == "int8":
                (q1, s1), (q2, s2) = quantize_int8(w1.float()), quantize_int8(w2.float())
                quantised.append((q1, s1, q2, s2))
                w1, w2 = q1.float() * s1[:, None], q2.float() * s2[:, None]  # the reference's weights, exact in fp32
            elif int8 == "int4":  # groups of 64: C and width multiples of it
                (q1, s1), (q2, s2) = quantize_int4(w1.float(), 64), quantize_int4(w2.float(), 64)
                quantised.append((pack_int4(q1), s1, pack_int4(q2), s2))
                w1, w2 = dequantized(q1, s1, 64), dequantized(q2, s2, 64)
            weights.append((w1, torch.randn(w1.shape[0]).to(dtype) if bias else None, w2,
                            torch.randn(C).to(dtype) if bias else None))
        x = torch.randn(sum(counts), C).to(dtype)
        b1 = [w[1] for w in weights] if bias else []
        b2 = [w[3] for w in weights] if bias else []
        if int8:
            got = kernel.expert_mlps(x, counts, [q[0] for q in quantised], b1, [q[2] for q in quantised], b2, swiglu,
                                     [q[1] for q in quantised], [q[3] for q in quantised])
        else:
            got = kernel.expert_mlps(x, counts, [w[0] for w in weights], b1, [w[2] for w in weights], b2, swiglu)
        ref, r = [], 0
        for n, (w1, b1_, w2, b2_) in zip(counts, weights):
            h = F.linear(x[r:r + n].float(), w1.float(), None if b1_ is None else b1_.float()).to(dtype)
            r += n
            if swiglu:
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            ref.append(F.linear(h.float(), w2.float(), None if b2_ is None else b2_.float()))
        ref = torch.cat(ref)
        assert got.dtype == dtype and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    with pytest.raises(RuntimeError, match="add up to"):
        kernel.expert_mlps(torch.randn(3, 16), [2], [torch.randn(8, 16)], [], [torch.randn(16, 4)], [], True)
    i8 = torch.zeros(8, 16, dtype=torch.int8), torch.zeros(16, 4, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8 ones with s1, s2"):
        kernel.expert_mlps(torch.randn(2, 16), [2], [i8[0]], [], [i8[1]], [], True)
    with pytest.raises(RuntimeError, match="one scale per row of w1 and w2"):
        kernel.expert_mlps(torch.randn(2, 16), [2], [i8[0]], [], [i8[1]], [], True, [torch.ones(8)], [torch.ones(4)])


def check_norm(kernel):
    """rms_norm of this build against pipeline/model.py's RMSNorm: fp32 and bf16, a width off the vector width,
    per-head rows (Qwen3-MoE's q/k norm)."""
    from pipeline.model import RMSNorm

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for shape in ((3, 1024), (2, 5, 16, 64), (1, 1, 100)):
            norm = RMSNorm(shape[-1], 1e-6).to(dtype)
            with torch.no_grad():
                norm.weight.add_(torch.randn_like(norm.weight) * 0.2)
                x = torch.randn(shape).to(dtype)
                got, ref = kernel.rms_norm(x, norm.weight, norm.eps), norm(x)
            assert got.dtype == dtype and got.shape == x.shape
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def check_argmax(kernel):
    """argmax_rows of this build equals torch.argmax: fp32 and bf16 (whose many ties take the first index), a width
    off the vector width, one row and many, a NaN."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1, 50304), (32, 1000), (3, 7)):
            x = torch.randn(shape).to(dtype)
            x[0, -1] = x[0].max()  # a tie: the first index wins
            if shape[0] > 1:  # a NaN before the row's largest value: its index, as torch's
                x[1, :2], x[1, 2] = -10.0, float("nan")
            assert kernel.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


def few_row_argmax(kernel, x, w):
    """argmax_rows of the few-row kernel's logits, MAX_ROWS rows a pass (what the screens answer, to the index)."""
    n = kernel.MAX_ROWS
    return kernel.argmax_rows(torch.cat([kernel.linear(x[i:i + n], w, None) for i in range(0, x.shape[0], n)])).tolist()


def check_screen(kernel):
    """HeadScreen (export/serve/kernels) over this build's screen (`screen_argmax`, or `screen_argmax_vnni` where
    the build has AVX512_VNNI): each row's token is argmax_rows of the few-row kernel's logits, to the index, for 1-8
    rows (and up to VNNI_MAX_ROWS with VNNI: several passes of the few-row kernel), fp32 and bf16 weights, sizes off
    the vector widths, with exact ties between output rows (duplicated weight rows: the first index wins) and near
    ties (one weight a bf16 step apart) at the top; a cluster the int8 weights cannot order, and (VNNI) one that x
    rounded to int8 cannot: one input 300x the others, which all round to 0; logits all equal (every output a
    candidate) and a non-finite input are declined (None: the caller runs the whole head); a row count that keeps
    declining stops being tried."""
    from export.serve.kernels import HeadScreen, ServingWeight

    torch.manual_seed(0)
    O, I = 3000, 200  # a tail past the int8 and bf16 vectors' widths, past the candidate scan's and the VNNI tiles'
    vnni = hasattr(kernel, "screen_argmax_vnni")
    counts = [*range(1, 9), 9, 13, 32, 64] if vnni else range(1, 9)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(O, I) * 0.05).to(dtype)
        w[1500] = w[10]  # an exact tie with an earlier row
        w[2000] = w[10]
        w[2000, 3] = torch.nextafter(w[10, 3].float(), torch.tensor(1.0)).to(dtype) if dtype == torch.float32 else \
            (w[10, 3].float() * (1 + 2 ** -7)).to(dtype)  # a near tie
        w[2999] = w[7]  # a tie at the last row (the scan's scalar tail)
        served = ServingWeight(w)
        served.gemv = kernel  # this build, whichever the process loaded
        screen = HeadScreen(served)
        assert screen.vnni == vnni and screen.rows == (kernel.VNNI_MAX_ROWS if vnni else kernel.MAX_ROWS)
        for M in counts:
            x = torch.randn(M, I)  # each row's logits peaked at a random output (flat ones: too many candidates)
            x[2:] += w[torch.randint(0, O, (max(0, M - 2),))].float() * 40
            x[0] = w[10].float() * 40 + torch.randn(I) * 0.01  # row 10 and its ties on top
            if M > 1:
                x[1] = w[7].float() * 40  # row 7 and row 2999
            if M > 8:
                x[8] = w[1234].float() * 40  # in the second pass of the few-row kernel
            x = x.to(dtype)
            want = few_row_argmax(kernel, x, w)
            assert screen.argmax(x) == want
            if M > 1:
                assert want[1] == 7
        assert screen.calls == len(counts) and screen.fallbacks == 0
        # a cluster the int8 copy cannot order: 60 rows of large weights nearly orthogonal to x, logits near 0 and
        # within the quantisation's error of each other; the rest far below. Only the bound (err) keeps them all.
        x = torch.randn(I)
        w2 = -x[None] * 0.05 + torch.randn(O, I) * 0.01
        for j in range(100, 160):
            z = torch.randn(I) * 3
            w2[j] = z - (z @ x) / (x @ x) * x + x * (j - 130) * 1e-5
        w2 = w2.to(dtype)
        served = ServingWeight(w2)
        served.gemv = kernel
        cluster = HeadScreen(served)
        cluster.most = O  # 60 candidates a row: 12 rows pass the default `most`
        for M in (1, 3, 12) if vnni else (1, 3):
            xs = x.to(dtype)[None].repeat(M, 1)
            assert cluster.argmax(xs) == few_row_argmax(kernel, xs, w2)
        assert cluster.fallbacks == 0
        if vnni:  # x rounded to int8 loses all but input 0: x[0] = 100, the rest below half a step (100 / 127 / 2)
            k = torch.randint(-127, 128, (O, I))
            k[:, 0], k[:, 1] = -64, 127  # scale 1 / 64 on every row: the int8 weights exact (the weights' bound ~0)
            k[200:260, 0] = 4 + torch.arange(60) % 3  # these on top; by input 0 alone, every third one first (by
            # 100 / 64 = 1.6, past the bf16 margin of their logits ~8: the invisible inputs add ~3.5 to each)
            w3 = (k / 64).to(dtype)
            served = ServingWeight(w3)
            served.gemv = kernel
            outlier = HeadScreen(served)
            outlier.most = O
            wants = []
            for M in (1, 5, 20):
                xs = torch.rand(M, I) * 0.76 - 0.38
                xs[:, 0] = 100.0
                xs = xs.to(dtype)
                want = few_row_argmax(kernel, xs, w3)
                assert outlier.argmax(xs) == want and all(200 <= t < 260 for t in want)
                wants += want
            assert outlier.fallbacks == 0 and any(t % 3 != 202 % 3 for t in wants)  # inputs int8 could not see won
        assert screen.argmax(torch.zeros(2, I, dtype=dtype)) is None  # every logit 0: all candidates
        x = torch.randn(1, I).to(dtype)
        x[0, 5] = float("inf")
        assert screen.argmax(x) is None
        assert screen.argmax(torch.randn(screen.rows + 1, I).to(dtype)) is None  # past the screen's rows
        for _ in range(HeadScreen.GIVE_UP):  # 3 rows that never screen: after GIVE_UP tries, not tried again
            assert screen.argmax(torch.zeros(3, I, dtype=dtype)) is None
        calls = screen.calls
        assert screen.argmax(torch.zeros(3, I, dtype=dtype)) is None and screen.calls == calls


def check_screen_topk(kernel):
    """HeadScreen.topk over this build's `screen_topk` (`screen_topk_vnni` where the build has AVX512_VNNI), the rows
    that sample among their k largest logits: each row's candidates hold every token of its top k once its edited
    tokens are set aside (ties at the k-th included) and every edited token, ascending, and their logits are the
    few-row kernel's to the bit (so sampling from them, every other logit -inf, is sampling from the whole layer's);
    1 to 64 rows (8 without VNNI), fp32 and bf16, k from 1 to 60; logits all equal (every output a candidate) and
    a non-finite input give None."""
    from export.serve.kernels import HeadScreen, ServingWeight

    torch.manual_seed(2)
    O, I = 3000, 200
    vnni = hasattr(kernel, "screen_topk_vnni")
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(O, I) * 0.05).to(dtype)
        w[2999], w[1500] = w[7], w[7]  # a three-way tie (the last row: the scan's tail)
        served = ServingWeight(w)
        served.gemv = kernel
        screen = HeadScreen(served)
        screen.most = O
        for M in [1, 2, 5, 8, *((13, 64) if vnni else ())]:
            x = torch.randn(M, I)
            x[0] = w[7].float() * 20 + torch.randn(I) * 0.5  # row 7 and its ties among the largest
            x = x.to(dtype)
            ks = torch.randint(1, 61, (M,)).tolist()
            ks[0] = 2  # the k-th of row 0 inside the tie: all three kept
            edited = [torch.randint(0, O, (int(torch.randint(0, 8, ())),)).tolist() + [O - 1] * (m % 2)
                      for m in range(M)]
            offsets, tokens, values = screen.topk(x, ks, edited)
            full = torch.cat([kernel.linear(x[i:i + kernel.MAX_ROWS], w, None)
                              for i in range(0, M, kernel.MAX_ROWS)]).float()
            for m in range(M):
                t, v = tokens[offsets[m]:offsets[m + 1]], values[offsets[m]:offsets[m + 1]]
                assert torch.equal(t, t.sort().values) and torch.equal(v, full[m, t])
                row = full[m].clone()
                row[edited[m]] = float("-inf")
                kth = row.topk(ks[m]).values[-1]
                assert set(torch.nonzero(row >= kth).flatten().tolist()) | set(edited[m]) <= set(t.tolist())
            assert {7, 1500, 2999} <= set(tokens[offsets[0]:offsets[1]].tolist())
        assert screen.fallbacks == 0
        assert screen.topk(torch.zeros(2, I, dtype=dtype), [3, 3], [[], []]) is None  # all equal: all candidates
        x = torch.randn(1, I).to(dtype)
        x[0, 5] = float("nan")
        assert screen.topk(x, [3], [[]]) is None


def check_screen_sample(kernel):
    """HeadScreen.sample over this build's `screen_sample` (`screen_sample_vnni` where the build has AVX512_VNNI): every
    sampled row it decides takes the token export/serve/sampling.py `sample_batch` draws from the few-row kernel's
    logits with the same settings, seed and processors (temperature, top_p, min_p; logit_bias, a banned token,
    repetition, frequency and presence penalties after some output, on every other row); rows at temperature alone
    are always decided, rows of peaked logits nearly always, flat logits under top_p half the time or more (-1:
    the caller's whole head);
    1 to 32 rows (8 without VNNI), fp32 and bf16; a non-finite input gives None."""
    from export.serve.kernels import HeadScreen, ServingWeight
    from export.serve.sampling import Sampler, edits_of, sample_batch
    from export.serve.step import Sampling

    torch.manual_seed(4)
    O, I = 3000, 200
    vnni = hasattr(kernel, "screen_sample_vnni")
    for dtype in (torch.float32, torch.bfloat16):
        for spread, peaked in ((0.05, False), (0.4, True)):  # logits' spread ~0.7 and ~5.7
            w = (torch.randn(O, I) * spread).to(dtype)
            served = ServingWeight(w)
            served.gemv = kernel
            screen = HeadScreen(served)
            decided = 0
            for M in [1, 2, 5, 8, *((13, 32) if vnni else ())]:
                x = torch.randn(M, I).to(dtype)
                full = torch.cat([kernel.linear(x[i:i + kernel.MAX_ROWS], w, None)
                                  for i in range(0, M, kernel.MAX_ROWS)])
                top = full.float().topk(3).indices  # processors on tokens that matter
                settings = [Sampling([0.7, 1.0, 1.3][m % 3], top_p=[1.0, 0.95, 0.8, 0.5][m % 4],
                                     min_p=[0.0, 0.0, 0.05][m % 3], seed=1000 * M + m,
                                     **({} if m % 2 else {"presence_penalty": 0.4, "frequency_penalty": 0.7,
                                                          "repetition_penalty": 1.3, "prompt": [int(top[m, 1]), 5],
                                                          "logit_bias": [[int(top[m, 2]), 1.5], [11, -2.0]]}))
                            for m in range(M)]
                samplers = [Sampler.of(s, O) for s in settings]
                for m, s in enumerate(samplers):
                    for t in ((int(top[m, 0]), int(top[m, 0]), 40) if m % 2 == 0 else ()):
                        s.took(t)  # an output to penalize
                    s.sampled = 17
                banned = [[int(top[m, 1])] if m % 4 == 2 else None for m in range(M)]
                got = screen.sample(x, [s.temperature for s in settings], [s.top_p for s in settings],
                                    [s.min_p for s in settings], [s.seed for s in samplers], [17] * M,
                                    edits_of(samplers, banned, O))
                want = [p["token"] for p in sample_batch(samplers, full, banned)]
                for m in range(M):
                    assert got[m] in (want[m], -1), (dtype, spread, M, m)
                    assert got[m] >= 0 or settings[m].top_p < 1  # temperature (and min_p) alone: always drawn
                    decided += got[m] >= 0
            assert decided >= (61 if vnni else 16) * (0.9 if peaked else 0.5)
        x = torch.randn(1, I).to(dtype)
        x[0, 5] = float("nan")
        assert screen.sample(x, [1.0], [1.0], [0.0], [1], [0]) is None


def check_quantized_screen(kernel):
    """QuantizedHeadScreen (csrc/heads.cpp `screen_argmax_i4`, `screen_argmax_i8`, AVX512_VNNI builds): each row's token
    is argmax_rows of int4_linear's or int8_linear's logits on the same weights, to the index, for 1-20 rows (passes of
    8 over the weight), fp32 and
    bf16 x, int4 groups of 128 and 256, int8 rows off the 64-byte load, a row count off the vector width; exact ties
    (duplicated rows: the first index wins) and near ties (a row's scale a step apart) at the top; a winner only the
    inputs x rounds to zero can pick, kept by the bound; flat logits and a non-finite input declined (None)."""
    from export.serve.kernels import Int4Weight, Int8Weight, QuantizedHeadScreen
    from pipeline.quantize import pack_int4

    torch.manual_seed(0)

    def exact(x, w):
        x = x.contiguous()
        if isinstance(w, Int4Weight):
            return kernel.argmax_rows(kernel.int4_linear(x, w.q, w.scale, None, w.group)).tolist()
        return kernel.argmax_rows(kernel.int8_linear(x, w.q, w.scale, None)).tolist()

    def copy_row(w, to, frm, factor=1.0):
        w.q[to], w.scale[to] = w.q[frm], w.scale[frm] * factor

    for w in (Int4Weight.of(torch.randn(3001, 256) * 0.05, 128), Int4Weight.of(torch.randn(517, 512) * 0.05, 256),
              Int8Weight.of(torch.randn(3001, 200) * 0.05), Int8Weight.of(torch.randn(700, 512) * 0.05)):
        O, I = w.shape
        w.gemv = kernel  # this build, whichever the process loaded
        copy_row(w, O // 2, 10)  # an exact tie with an earlier row
        copy_row(w, 400, 10, 1 + 2 ** -20)  # and a near one
        copy_row(w, O - 1, 7)  # a tie at the last row (the scan's scalar tail)
        screen = QuantizedHeadScreen(w)
        deq = w.dequantized()
        for dtype in (torch.float32, torch.bfloat16):
            for M in (*range(1, 9), 9, 13, 20):
                x = torch.randn(M, I) + deq[torch.randint(0, O, (M,))] * 40  # peaked at a random output
                x[0] = deq[10] * 40 + torch.randn(I) * 0.01  # row 10 and its ties on top
                if M > 1:
                    x[1] = deq[7] * 40
                x = x.to(dtype)
                want = exact(x, w)
                assert screen.argmax(x) == want and want[0] in (10, 400)
                if M > 1:
                    assert want[1] == 7
        assert screen.fallbacks == 0 and screen.calls == 22
        assert screen.argmax(torch.zeros(2, I)) is None  # every logit 0: all candidates
        x = torch.randn(1, I)
        x[0, 5] = float("inf")
        assert screen.argmax(x) is None
        assert screen.argmax(torch.randn(kernel.VNNI_MAX_ROWS + 1, I)) is None  # past the screen's rows
    # inputs x rounded to int8 cannot see: x[0] = 100, the rest positive below half a step (100 / 127 / 2). Rows
    # 200-259 on top by input 0, which puts every third one (input 0's weight 3) first; the invisible inputs' weights
    # (7, 0, -7 for input 0's 1, 2, 3) turn the order round: row 200 wins, which only the bound keeps a candidate
    O, I = 1000, 128
    k = torch.randint(-7, 8, (O, I))
    k[:, 0] = -4
    j = torch.arange(60)
    k[200:260, 0] = 1 + j % 3
    k[200:260, 1:] = (7 - 7 * (j % 3))[:, None]
    for w in (Int4Weight(pack_int4(k.to(torch.int8)), torch.full((O, 1), 0.25)),
              Int8Weight(k.to(torch.int8), torch.full((O,), 0.25))):
        w.gemv = kernel
        outlier = QuantizedHeadScreen(w)
        outlier.most = O
        for M in (1, 5, 8, 11):
            xs = torch.rand(M, I) * 0.38
            xs[:, 0] = 100.0
            for dtype in (torch.float32, torch.bfloat16):
                want = exact(xs.to(dtype), w)
                assert outlier.argmax(xs.to(dtype)) == want == [200] * M
        assert outlier.fallbacks == 0


def test_only_an_output_layer_that_fits_gets_a_screen(monkeypatch):
    """`serving_linears` gives the model's lm_head a HeadScreen (and no other layer); none with a bias, a weight that
    is not finite, or `serve --no-head-screen`."""
    from export.serve.kernels import HeadScreen, ServingLinear, ServingWeight, kernel, options, serving_linears

    if kernel() is None:
        pytest.skip("no kernel on this machine")
    from pipeline.model import GPT

    model = GPT(model_config(vocab_size=4096, hidden=64)).eval().requires_grad_(False)
    serving_linears(model)
    assert isinstance(model.lm_head.screen, HeadScreen)
    assert all(m.screen is None for m in model.modules() if isinstance(m, ServingLinear) and m is not model.lm_head)
    w = torch.randn(4096, 64)
    assert HeadScreen.of(ServingWeight(w), torch.zeros(4096)) is None
    w[3, 3] = float("nan")
    assert HeadScreen.of(ServingWeight(w), None) is None
    with options.using(head_screen=False):
        assert HeadScreen.of(ServingWeight(torch.randn(4096, 64)), None) is None


def check_combine(kernel):
    """combine_pairs (routed_experts' weighted sum, vectorised) to the bit: each choice's product added and rounded
    to bf16 once, to nearest even, as c10::BFloat16 rounds (the data makes every fp32 sum exact, so only the rounding
    to bf16 can differ, and many land halfway); a NaN stays a NaN; fp32 too; widths off the vector width."""
    torch.manual_seed(0)
    for C in (1024, 37):
        S, k = 33, 4
        y = (1 + torch.rand(S, k, C)).bfloat16()  # 8 significant bits: each product with a bf16 weight exact in fp32
        mix = torch.rand(S, k).bfloat16().float()
        y[3, 1, 5] = float("nan")
        got = kernel.combine_pairs(y, mix)
        want = (y[:, 0].float() * mix[:, :1]).bfloat16()
        halfway = 0  # exact sums halfway between two bf16 values: where ties to even decides
        for j in range(1, k):
            exact = want.float() + y[:, j].float() * mix[:, j:j + 1]
            halfway += int(((exact.view(torch.int32) & 0xFFFF) == 0x8000).sum())
            want = exact.bfloat16()
        assert halfway > 0
        assert torch.isnan(got[3, 5]) and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
        got32 = kernel.combine_pairs(y.float(), mix)
        want32 = y[:, 0].float() * mix[:, :1]
        for j in range(1, k):
            want32 = torch.addcmul(want32, y[:, j].float(), mix[:, j:j + 1])
        assert torch.equal(torch.nan_to_num(got32), torch.nan_to_num(want32))


def check_routed(kernel):
    """route + routed_experts of this build against pipeline/model.py's `route` (no capacity) and the experts one at a
    time, each token's choices weighted and added as PlacedMoE does: top-1 and top-2, renormalised or not, fp32
    and bf16, an expert with no token; int8 experts (routed_experts and expert_pairs) against their dequantised
    weights."""
    from pipeline.quantize import quantize_int8
    from pipeline.model import route

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for k, renorm in ((1, False), (2, True), (2, False)):
            S, C, E, width = 9, 96, 6, 40
            x = torch.randn(S, C).to(dtype)
            wg = torch.randn(E, C)
            wg[3] = -10 * x.float().mean(0)  # expert 3 is nobody's choice
            mix, experts, counts = kernel.route(x, wg, k, renorm)
            ref = route(F.linear(x.float(), wg), k, renorm)
            assert experts.tolist() == ref.experts.tolist() and counts.tolist() == ref.counts.tolist()
            torch.testing.assert_close(mix, ref.weights, atol=1e-6, rtol=1e-5)
            assert counts[3] == 0
            weights = {e: (torch.randn(2 * width, C).to(dtype), None, (torch.randn(C, width) * 0.1).to(dtype), None)
                       for e in range(E)}
            active = [e for e in range(E) if counts[e]]
            got = kernel.routed_experts(x, experts, mix, active, [weights[e][0] for e in active], [],
                                        [weights[e][2] for e in active], [], True)
            # int8 experts: as routed_experts on their dequantised weights, within the bf16 roundings
            q = {e: (quantize_int8(weights[e][0].float()), quantize_int8(weights[e][2].float())) for e in active}
            deq = [[a.float() * b[:, None] for a, b in q[e]] for e in active]
            got8 = kernel.routed_experts(x, experts, mix, active, [q[e][0][0] for e in active], [],
                                         [q[e][1][0] for e in active], [], True, [q[e][0][1] for e in active],
                                         [q[e][1][1] for e in active])
            want8 = kernel.routed_experts(x.float(), experts, mix, active, [d[0] for d in deq], [],
                                          [d[1] for d in deq], [], True)
            torch.testing.assert_close(got8.float(), want8, atol=2 * tol * want8.abs().max().item(), rtol=2 * tol)
            here = active[:2]
            keep = torch.where(torch.isin(experts, torch.tensor(here)), experts, -1)
            pairs8 = kernel.expert_pairs(x, keep, mix, here, [q[e][0][0] for e in here], [], [q[e][1][0] for e in here],
                                         [], True, [q[e][0][1] for e in here], [q[e][1][1] for e in here])
            assert pairs8[keep < 0].abs().sum() == 0 and pairs8[keep >= 0].abs().sum() > 0
            want = torch.zeros(S, C, dtype=dtype)
            for s in range(S):
                for j in range(k):
                    w1, _, w2, _ = weights[int(experts[s, j])]
                    gate, up = F.linear(x[s:s + 1].float(), w1.float()).to(dtype).chunk(2, dim=-1)
                    y = F.linear((F.silu(gate) * up).float(), w2.float()).to(dtype)[0]
                    want[s] = y * mix[s, j].to(dtype) if j == 0 else want[s] + y * mix[s, j].to(dtype)
            torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
            # expert parallelism's halves: each "rank" computes its experts' pairs (-1: another's, left zero); their
            # sum (an all-reduce), combined, is routed_experts' answer to the bit
            def pairs(mine):
                keep = torch.where(torch.isin(experts, torch.tensor(mine)), experts, -1)
                here = [e for e in active if e in mine]
                return kernel.expert_pairs(x, keep, mix, here, [weights[e][0] for e in here], [],
                                           [weights[e][2] for e in here], [], True)
            halves = pairs([0, 1, 2]), pairs([4, 5])  # expert 3: nobody's choice, held by neither
            assert halves[0][torch.isin(experts, torch.tensor([4, 5]))].abs().sum() == 0
            assert torch.equal(kernel.combine_pairs(halves[0] + halves[1], mix), got)


def check_attention(kernel):
    """paged_attention of this build against SDPA (tests/test_paged_attention.py): fp32 and bf16, grouped-query heads,
    a head size off the vector width."""
    from test_paged_attention import check_case

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        check_case(kernel, dtype, tol, 4, 2, 40)


def test_the_serving_cache_attends_with_the_kernel_and_gives_the_model_s_tokens():
    """PagedCache.attend on the CPU: the paged kernel for one new token a row (rows of different lengths, blocks
    scattered over the pool, decoding together), None for a prompt (SDPA then); a greedy decode through it equals
    one through the model's own cache and SDPA."""
    from export.serve.kv_cache import PagedCache
    from pipeline.model import GPT, KVCache

    cfg = model_config(layers=2, hidden=64, heads=4, experts=(4,), moe_layers=(1,))
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    cache = PagedCache(cfg, blocks=12, block_size=4, heads=cfg.kv_heads)
    assert cache._kernel is not None
    cache.extend(2, [7, 1, 10, 4, 0])  # sequence 2: 5 + 7 tokens; sequence 0: 9 + 7
    cache.extend(0, [3, 11, 5, 9, 2])
    prompts = [torch.randint(0, cfg.vocab_size, (1, n)) for n in (5, 9)]
    with torch.no_grad():
        firsts, refs = [], []
        for seq, p in zip((2, 0), prompts):
            cache.select([seq], [0], [p.shape[1]])
            assert cache.attend(0, *(torch.zeros(1, cfg.heads, p.shape[1], cfg.head_dim) for _ in range(3))) is None
            firsts.append(model(p, cache=cache).logits[0, -1].argmax().item())
            ref_cache = KVCache(cfg, batch=1, max_len=32)
            model(p, cache=ref_cache)
            refs.append((ref_cache, [firsts[-1]]))
        toks = [[t] for t in firsts]
        lens = [5, 9]
        for _ in range(6):  # both rows decode together: one new token each, different lengths
            cache.select([2, 0], lens, [1, 1])
            logits = model(torch.tensor([[t[-1]] for t in toks]), cache=cache).logits[:, -1]
            lens = [n + 1 for n in lens]
            for t, row in zip(toks, logits):
                t.append(row.argmax().item())
            for ref_cache, ref in refs:  # the model's own cache and SDPA, one row at a time
                ref.append(model(torch.tensor([[ref[-1]]]), cache=ref_cache).logits[0, -1].argmax().item())
    assert toks == [ref for _, ref in refs]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_serving_linear_is_the_linear(dtype, tol):
    from export.serve.kernels import ServingLinear

    layer = nn.Linear(256, 512).to(dtype).eval()
    served = ServingLinear(layer)
    assert served.served.gemv is not None and "GEMV kernel" in repr(served)
    assert served.served.weight.data_ptr() == layer.weight.data_ptr()  # the weight as it was: no second copy
    for shape in [(1, 256), (3, 256), (1, 4, 256), (2, 9, 256), (0, 1, 256), (40, 256), (3, 11, 256)]:
        # the kernel (1-8 rows), F.linear (a small weight: more rows), no rows
        x = torch.randn(*shape).to(dtype)
        with torch.no_grad():
            got = served(x)
            assert got.shape == (*shape[:-1], 512)
            torch.testing.assert_close(got.float(), layer(x).float(), atol=tol, rtol=tol)


def test_a_large_serving_linear_pads_rows_for_onednn():
    from export.serve.kernels import ONEDNN_FROM, ServingLinear

    layer = nn.Linear(1024, ONEDNN_FROM // 1024).eval()
    served = ServingLinear(layer)
    for rows in (2, 5, 18, 33, 100):  # the kernel, then oneDNN: as they are (5, 18) or padded (33 -> 36, 100 -> 104)
        x = torch.randn(rows, 1024)
        with torch.no_grad():
            torch.testing.assert_close(served(x), layer(x), atol=1e-4, rtol=1e-4)


def test_a_large_bf16_serving_linear_takes_2_to_256_rows_to_amx():
    """On a CPU with AMX a large bf16 weight's second copy is the kernel's AMX packing (not oneDNN's): 1 row goes to
    the GEMV kernel, 2-256 rows to amx_linear, more to oneDNN on the plain weight; all F.linear's outputs."""
    from export.serve.kernels import ONEDNN_FROM, ServingLinear, cpu_isa, kernel

    if cpu_isa() != "AMX_BF16":
        pytest.skip("this CPU has no AMX: bf16 rows past the GEMV kernel's go to oneDNN's packed weight")
    layer = nn.Linear(1024, ONEDNN_FROM // 1024).bfloat16().eval()
    served = ServingLinear(layer)
    assert served.served.amx is not None and served.served.packed is served.served.weight
    assert "AMX for 2-256" in repr(served)
    with torch.no_grad():
        for rows in (1, 2, 9, 33, 256, 300):
            x = torch.randn(rows, 1024).bfloat16()
            got = served(x)
            torch.testing.assert_close(got.float(), layer(x).float(), atol=3e-2, rtol=3e-2)
            if 1 < rows <= 256:
                assert torch.equal(got, kernel().amx_linear(x, served.served.amx, layer.out_features, layer.bias))


def test_row_buckets_bound_the_shapes_onednn_compiles():
    from export.serve.kernels import bucket

    sizes = [bucket(n) for n in range(1, 2049)]
    assert sizes[:8] == list(range(1, 9))  # few rows as they are
    assert all(n <= b <= n * 1.125 for n, b in zip(range(1, 2049), sizes))  # at most 12.5% padding
    assert len(set(sizes)) <= 8 + 8 * 8  # up to 8, then 8 sizes per octave: 8-2048
    assert bucket(9) == 9 and bucket(17) == 18 and bucket(100) == 104 and bucket(2048) == 2048


def test_serving_a_model_keeps_its_logits_and_its_gates(monkeypatch):
    from export.serve.kernels import FusedAttention, FusedQKV, ServingLinear, options, serving_linears
    from pipeline.model import GPT, init_weights

    cfg = model_config(hidden=128, heads=4)
    model = GPT(cfg).eval()
    init_weights(model, 2)
    ids = torch.randint(0, cfg.vocab_size, (3, 11))
    with torch.no_grad():
        ref = model(ids).logits
        ref_one = model(ids[:1, :1]).logits  # one row: the kernel's path once served
    with options.using(linears="aten"):
        assert serving_linears(model) == 0  # switched off: nothing changes
    assert serving_linears(model) > 0
    # q, k, v as one projection: the model's own attention module, swapped (no q/k/v left)
    assert all(type(b.attn) is FusedAttention and isinstance(b.attn.qkv_proj, FusedQKV) for b in model.blocks)
    assert not any(hasattr(b.attn, "q_proj") for b in model.blocks)
    assert all(type(m.moe.deepspeed_moe.gate.wg) is nn.Linear for m in model.moe_layers())  # the router reads it
    assert isinstance(model.lm_head, ServingLinear)
    assert model.lm_head.served.weight.data_ptr() == model.wte.weight.data_ptr()  # tied: one copy
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(ids[:1, :1]).logits, ref_one, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_a_large_serving_linear_takes_many_rows_on_any_cpu(dtype, tol):
    """Past the kernel's rows a weight of 1M+ elements goes to oneDNN, which has no bf16 primitive on a CPU without
    AVX-512 (it raised 'could not create a primitive descriptor' on an AVX2 machine): F.linear there."""
    from export.serve.kernels import ONEDNN_FROM, ServingLinear

    layer = nn.Linear(1024, ONEDNN_FROM // 1024).to(dtype).eval()
    served = ServingLinear(layer)
    x = torch.randn(40, 1024).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(served(x).float(), layer(x).float(), atol=tol, rtol=tol)


def test_int8_weights_through_the_serving_linears():
    """kernels.Int8Weight: its linear on [batch, tokens, in] inputs against F.linear on the weight it stands for
    (fp32 and bf16, with a bias); int8 experts through expert_mlps and routed_layer against the same experts
    dequantised; a layer mixing int8 and plain experts, and a wrong weight, refused by name; Int4Weight's linear, and
    a row its groups do not divide."""
    from export.serve import kernels
    from export.serve.kernels import Int4Weight, Int8Weight

    torch.manual_seed(0)
    w, b = torch.randn(96, 80), torch.randn(96)
    int8 = Int8Weight.of(w)
    assert int8.shape == (96, 80) and int8.q.dtype == torch.int8
    assert (int8.dequantized() - w).abs().max() <= int8.scale.max() / 2 * (1 + 1e-6)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(2, 5, 80).to(dtype)
        got = int8.linear(x, b.to(dtype))
        assert got.shape == (2, 5, 96) and got.dtype == dtype
        torch.testing.assert_close(got.float(), F.linear(x.float(), int8.dequantized(), b.to(dtype).float()),
                                   atol=tol * 80 ** 0.5, rtol=tol)
    C, width, E = 64, 48, 4
    experts = {e: (Int8Weight.of(torch.randn(2 * width, C)), None, Int8Weight.of(torch.randn(C, width) * 0.1), None)
               for e in range(E)}
    plain = {e: (x[0].dequantized(), None, x[2].dequantized(), None) for e, x in experts.items()}
    x = torch.randn(6, C)
    got = kernels.expert_mlps(x, [2, 0, 3, 1], [experts[e] for e in range(E)], True)
    want = kernels.expert_mlps(x, [2, 0, 3, 1], [plain[e] for e in range(E)], True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    wg = torch.randn(E, C)
    (got, counts), (want, counts_) = (kernels.routed_layer(x, wg, 2, True, lambda e: table[e], True)
                                      for table in (experts, plain))
    assert torch.equal(counts, counts_)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    mixed = [experts[0], plain[1]]
    with pytest.raises(ValueError, match="all or none, fc1 and fc2 alike"):
        kernels.expert_mlps(x[:2], [1, 1], mixed, True)
    with pytest.raises(ValueError, match="q int8 \\[out, in\\] and scale fp32 \\[out\\]"):
        Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))
    # int4, groups of 128: its linear against the weight it stands for; a row that does not fit its groups refused
    int4 = Int4Weight.of(torch.randn(40, 256))
    assert int4.shape == (40, 256) and int4.q.shape == (40, 128) and int4.scale.shape == (40, 2)
    x = torch.randn(3, 2, 256).bfloat16()
    torch.testing.assert_close(int4.linear(x).float(), F.linear(x.float(), int4.dequantized()), atol=1e-2 * 16,
                               rtol=1e-2)
    assert not Int4Weight.fits(200) and Int4Weight.fits(384)
    with pytest.raises(ValueError, match="in a multiple of 128"):
        Int4Weight(torch.zeros(4, 100, dtype=torch.uint8), torch.ones(4, 1))
