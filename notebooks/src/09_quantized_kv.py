# %% [markdown]
# # 09 · Quantized KV pools: FP8 and NVFP4, bit for bit
#
# Production engines store K and V in 8 or even 4 bits: the cache then holds two to
# almost four times as many tokens. The formats are simple, but their rules fail
# *silently* when misapplied: a scale computed one rounding too early, or one scale
# shared by K and V, still gives plausible numbers. The sections:
#
# 1. count the **bytes per token** of bf16, FP8 and NVFP4 for real models, and check the
#    memory formula against the bytes of a real quantized pool;
# 2. see the **E2M1 grid** and quantize one NVFP4 block of 16 values by hand;
# 3. measure the **quantization error** of K (after RoPE) and V per format;
# 4. break the **scale round-trip rule** and watch writer and reader disagree;
# 5. measure why **K and V need separate global scales**;
# 6. measure **decode attention error** per format, with the Triton kernels that write
#    and read quantized pools, checked bit for bit against the Python references.
#
# The formats (details in `pagedkv_lib.quant`): **FP8 E4M3** stores `fp8(x / scale)`
# (1 byte, largest finite value 448; E4M3 has no infinity, and this suite's conversion
# *saturates*, clamping anything larger to +-448: saturation is a mode of the
# conversion, chosen here as FlashInfer and TensorRT-LLM do, not a property of the
# format, whose other conversion mode turns overflow into NaN); **NVFP4** stores blocks of 16 values as 4-bit
# E2M1 codes (two per byte) with one FP8 block scale per block and one fp32 global
# scale per tensor: `x ≈ e2m1_value(code) * block_scale * global_scale`.
#
# **You will learn to**
# * count the bytes per token of bf16, FP8 and NVFP4 caches, and match them to a real pool;
# * quantize an NVFP4 block by hand: block scale, its FP8 rounding, E2M1 codes, packing;
# * recognise two silent quantization bugs (a scale used before its rounding, one global
#   scale for K and V) and the harness check that catches each;
# * measure what each format costs in K, V and decode-attention error.
#
# **Before this:** [01 · The KV-cache memory formula](01_memory_formula.ipynb) (bytes per
# token), [06 · The Triton write kernel](06_triton_write.ipynb) and
# [07 · The Triton read kernel](07_triton_read.ipynb) (the kernels quantized here);
# [08 · The silent-bug zoo](08_silent_bugs.ipynb) introduces the harness.
#
# **Time:** 15 s to run (Restart and Run All, 2 CPU cores), 30 minutes to read.
# Needs Triton (Linux, WSL, a container or a hosted notebook).

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup(kernels=True)

# %%
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from IPython.display import display

import pagedkv_kernels as kernels
from pagedkv_kernels import quant_decode, quant_write
from pagedkv_kernels.device import quant_codes
from pagedkv_lab import faults, verify, viz
from pagedkv_lib import PRESETS, formats, memory, quant, quant_reference, reference
from pagedkv_lib.quant_pool import QuantizedKVPool

# %% [markdown]
# ## 1. Bytes per token
#
# Per layer, token and KV head, a format stores one K and one V vector of `head_dim`
# values: 2 bytes each in bf16, 1 byte in FP8 (plus a 4-byte fp32 scale with per-token
# scales), and in NVFP4 half a byte per value plus one scale byte per 16 values:
# `128 / 2 + 128 / 16 = 72` bytes for a 128-wide head, 28 % of bf16.

# %%
names = ["llama-2-7b", "llama-3-8b", "llama-3-70b", "qwen2.5-7b", "falcon-7b", "deepseek-v2"]
fmts = {"bf16": "bf16", "fp8": "fp8", "fp8 + token scale": "fp8_per_token", "nvfp4": "nvfp4"}
per_token = {label: [memory.kv_bytes_per_token(PRESETS[n], f) for n in names] for label, f in fmts.items()}
for i, n in enumerate(names):
    row = "  ".join(f"{label} {per_token[label][i] / 1024:7.1f} KiB" for label in fmts)
    print(f"{n:>12}: {row}   nvfp4 saves {1 - per_token['nvfp4'][i] / per_token['bf16'][i]:.1%}")
per_token_kib = {k: [b / 1024 for b in v] for k, v in per_token.items()}
title = "KV cache per token, all layers, one rank"
fig = viz.plot_grouped_bars(names, per_token_kib, title, "KiB per token", annotate=None)
plt.show()
ratios = [f"{nv / bf:.4f}" for nv, bf in zip(per_token["nvfp4"], per_token["bf16"])]
assert all(nv * 256 == bf * 72 for nv, bf in zip(per_token["nvfp4"], per_token["bf16"])), (
    f"NVFP4 should take 72/256 = 0.2812 of bf16's bytes, got {ratios}"
)
assert per_token["fp8"] == [b // 2 for b in per_token["bf16"]], (
    f"FP8 should take exactly half of bf16's bytes: {per_token['fp8']} vs {per_token['bf16']}"
)

# %% [markdown]
# The formula must match what a pool really allocates. A `QuantizedKVPool` owns the
# codes (`data`, uint8) and the scale pool beside it (`scales`, addressed by the same
# page and row); its bytes for one layer of Llama-3-8B, 40 pages of 16 tokens:

# %%
spec = PRESETS["llama-3-8b"]
for kv_dtype, mode in (("fp8", "tensor"), ("fp8", "token"), ("nvfp4", "block")):
    pool = QuantizedKVPool(40, 16, spec.num_kv_heads, spec.head_dim, kv_dtype, scale_mode=mode)
    shapes = f"data {tuple(pool.data.shape)}" + ("" if pool.scales is None else f", scales {tuple(pool.scales.shape)}")
    formula = memory.kv_cache_bytes(spec, [40 * 16], pool.memory_dtype, page_size=16) // spec.num_layers
    print(f"{kv_dtype}/{mode:>6}: {pool.nbytes:>7} bytes = formula {formula:>7}   ({shapes})")
    assert pool.nbytes == formula, f"{kv_dtype}/{mode}: the pool holds {pool.nbytes} bytes, the formula says {formula}"

# %% [markdown]
# ## 2. The E2M1 grid, and one NVFP4 block by hand
#
# E2M1 has 1 sign, 2 exponent and 1 mantissa bit: magnitudes
# `{0, 0.5, 1, 1.5, 2, 3, 4, 6}`. Rounding is to the nearest; a tie (0.25, 0.75, ...,
# 5) goes to the neighbour whose index is even (its mantissa bit is 0), and everything
# past 6 saturates at 6. In the figure, a dotted line marks each threshold between two
# magnitudes and a short bar on it points to the side a value exactly on the threshold
# (a tie) goes; the red arrows are the five values of the block below, in block units.
#
# One block of 16 values is quantized in five steps: its largest magnitude `amax`;
# the block scale `sf = amax / (6 * global_scale)`, which makes `amax` land on 6;
# `sf8 = fp8(sf)`, the block scale as stored; the quantization scale
# `q = 1 / (fp8_value(sf8) * global_scale)` **from the rounded sf8**; the codes
# `e2m1(x * q)`, packed two per byte with the even element in the low nibble.

# %%
block = torch.tensor([2.6, -0.3, 0.9, 1.4, -5.2, 0.05, 3.3, 0.7, -1.1, 2.0, 0.0, -2.9, 4.1, 0.45, -0.6, 1.8])
gs = 0.01  # the global scale, fixed here
amax = block.abs().max()
sf = amax / (6 * torch.tensor(gs))
sf8 = quant.fp8_decode(quant.fp8_encode(sf))
q = 1 / (sf8 * gs)
codes = quant.e2m1_encode(block * q)
print(f"amax {float(amax)}, sf {float(sf):.4f} -> sf8 {float(sf8)}, q {float(q):.5f}")
print("x * q:", [round(float(y), 2) for y in block * q])
print("value:", quant.e2m1_decode(codes).tolist())
print("bytes:", [f"0x{b:02x}" for b in quant.pack_nibbles(codes).tolist()])
packed, scales = quant.nvfp4_quantize(block, gs)
assert torch.equal(packed, quant.pack_nibbles(codes)), (
    f"the codes by hand {quant.pack_nibbles(codes).tolist()} differ from nvfp4_quantize's {packed.tolist()}"
)
assert float(scales.float()) == float(sf8), (
    f"the block scale by hand is {float(sf8)}, nvfp4_quantize stored {float(scales.float())}"
)
fig = viz.plot_e2m1_grid({f"x[{i}]": float(block[i] * q) for i in (0, 4, 5, 7, 13)})
plt.show()

# %% [markdown]
# `sf = 86.67` is not an FP8 value; E4M3 has steps of 8 between 64 and 128, so the
# stored scale is 88. Reading back multiplies each code by `88 * 0.01`. The Triton write
# kernel must produce exactly these bytes. One token with this block as its first head
# feature block, written by `kernels.append_paged_kv_quant_pool`:

# %%
pool = QuantizedKVPool(1, 1, 1, 16, "nvfp4", device=DEV, k_scale=gs, v_scale=gs)
kernels.append_paged_kv_quant_pool(
    block.view(1, 1, 16).to(DEV), block.view(1, 1, 16).to(DEV), pool, torch.tensor([0], device=DEV)
)
print(
    "kernel bytes:",
    [f"0x{b:02x}" for b in pool.data[0, 0, 0, 0].tolist()],
    " block scale code:",
    hex(int(pool.scales[0, 0, 0, 0])),
)
assert torch.equal(pool.data[0, 0, 0, 0].cpu(), packed), "the kernel's codes differ from the reference"
assert int(pool.scales[0, 0, 0, 0]) == int(scales.view(torch.uint8)), "the kernel's block scale differs"

# %% [markdown]
# The write kernel, `pagedkv_kernels.quant_write.quant_append_kernel`: one program per tile of
# tokens and heads loads the rows (rotating K when RoPE is fused), then quantizes and
# stores K and V through one helper. Below it, called out from the module, the lines of
# the five steps above: the block scale from `amax / (6 * gs)` rounded to FP8 (`sf8`),
# the **rounded** scale times the global one as the quantization scale (the two-level
# scale), the E2M1 codes and the packing of two codes per byte.

# %% tags=["nbval-ignore-output"]
# (shows the module's current source; shown, not compared)
display(viz.source_code(quant_write.quant_append_kernel))
steps = [
    "amax = tl.max(finite_abs(blocks), axis=3)",
    "sf8 = fp8_encode(tl.math.div_rn(amax, gs * 6.0))",
    "den = fp8_decode(sf8) * gs",
    "codes = e2m1_encode(blocks * q_scale",
    "(lo | (hi << 4))",
]
display(viz.lesson_lines(quant_write, steps))

# %%
found = {step: viz.find_lines(quant_write, step) for step in steps}
order = [found[step][0] for step in steps]
print(
    f"kernels/pagedkv_kernels/quant_write.py: the five steps are {len(order)} lines, in order: {order == sorted(order)}"
)
assert all(len(lines) == 1 for lines in found.values()), f"each step should be one line of the writer: {found}"
assert order == sorted(order), f"the steps must run in the order amax, sf8, q from sf8, codes, pack: lines {order}"

# %% [markdown]
# ## 3. Quantization error of K and V
#
# K after RoPE has a few outlier channels (here 8 times larger than the rest) while V
# does not, as in real models. 4 sequences of 64 tokens are written through the kernels
# with fused RoPE (rotate, then quantize) into a bf16 pool and into three quantized
# pools whose K and V global scales are calibrated on each tensor. The errors are
# measured against the float64 truth.

# %%
heads, dim, ps, lens = 2, 128, 16, [64, 64, 64, 64]
gen = torch.Generator().manual_seed(1)
k_raw, v = torch.randn(256, heads, dim, generator=gen), torch.randn(256, heads, dim, generator=gen)
k_raw[..., [3, 3 + 64, 17, 17 + 64]] *= 8  # outlier channels (NeoX pairs i, i + 64)
pos = torch.cat([torch.arange(n) for n in lens])
batch = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
table = formats.pad_block_tables(formats.scatter_pages([4, 4, 4, 4], 18, gen), 4)
slots = formats.slot_mapping(table, batch, pos, ps)
k_true = reference.rope_reference(k_raw, pos, 10000.0, "neox")  # float64
rope = {"rope": "neox", "positions": pos.to(DEV)}
print(f"K range {k_true.abs().max():.1f}, V range {v.abs().max():.1f}")

# %%
bf16 = torch.zeros(18, 2, ps, heads, dim, dtype=torch.bfloat16, device=DEV)
kernels.append_paged_kv(k_raw.bfloat16().to(DEV), v.bfloat16().to(DEV), bf16, slots.to(DEV), **rope)
page, row = slots // ps, slots % ps
stored = {"bf16": (bf16.cpu()[page, 0, row], bf16.cpu()[page, 1, row])}
pools = {}
for label, kv_dtype, mode in (("fp8", "fp8", "tensor"), ("fp8 token", "fp8", "token"), ("nvfp4", "nvfp4", "block")):
    scales = {"k_scale": quant.global_scale_for(k_true, kv_dtype), "v_scale": quant.global_scale_for(v, kv_dtype)}
    pool = QuantizedKVPool(18, ps, heads, dim, kv_dtype, device=DEV, scale_mode=mode, **scales)
    kernels.append_paged_kv_quant_pool(k_raw.to(DEV), v.to(DEV), pool, slots.to(DEV), **rope)
    pools[label] = pool
    stored[label] = (pool.read_slots(slots, 0), pool.read_slots(slots, 1))

# %% [markdown]
# The kernels' codes and scales must equal the references' bit for bit. With RoPE the
# reference quantizes the float64 rotation while the kernel rotates in fp32, so the
# reference is fed the rotation the kernel computes (what `kernels.append_paged_kv` stores
# in an fp32 pool):

# %%
rotated = torch.zeros(18, 2, ps, heads, dim, device=DEV)
kernels.append_paged_kv(k_raw.to(DEV), v.to(DEV), rotated, slots.to(DEV), **rope)
for label, pool in pools.items():
    want = pool.to("cpu")
    want.data.zero_()
    quant_reference.write_rows(want, 0, page, row, rotated.cpu()[page, 0, row])
    quant_reference.write_rows(want, 1, page, row, v)
    same = torch.equal(pool.data.cpu(), want.data)
    same = same and (pool.scales is None or torch.equal(pool.scales.cpu(), want.scales))
    print(f"{label:>9}: codes and scales equal the reference: {same}")
    assert same, f"{label}: the write kernel's bytes differ from the reference quantizer's"

# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
exact = (k_true, v.double())
rel = {label: [quant.relative_rms_error(s, x) for s, x in zip(kv, exact)] for label, kv in stored.items()}
vs_bf16 = {label: [quant.relative_rms_error(s, b) for s, b in zip(kv, stored["bf16"])] for label, kv in stored.items()}
for label in stored:
    print(
        f"{label:>9}: relative RMS error vs float64  K {rel[label][0]:.2e}  V {rel[label][1]:.2e}"
        f"   vs bf16  K {vs_bf16[label][0]:.2e}  V {vs_bf16[label][1]:.2e}"
    )
k_err = {label: f"{e[0]:.2e}" for label, e in rel.items()}
v_err = {label: f"{e[1]:.2e}" for label, e in rel.items()}
assert rel["bf16"][0] < rel["fp8 token"][0] < rel["fp8"][0] < rel["nvfp4"][0], (
    f"K's error should grow as bits shrink (bf16 < fp8 token < fp8 < nvfp4): {k_err}"
)
fp8_v = (rel["fp8 token"][1], rel["fp8"][1])  # in either order: per-token scales barely matter for V
assert rel["bf16"][1] < min(fp8_v) and max(fp8_v) < rel["nvfp4"][1], (
    f"V's error should grow as bits shrink (bf16 < both fp8 < nvfp4): {v_err}"
)
assert max(rel["fp8"]) < 2**-5, (
    f"FP8's relative error should stay below 2**-5 = 0.031: K {k_err['fp8']}, V {v_err['fp8']}"
)
assert max(rel["nvfp4"]) < 0.12, (
    f"NVFP4's relative error should stay below 0.12: K {k_err['nvfp4']}, V {v_err['nvfp4']}"
)

# %%
errors = {
    f"{name} (after RoPE)" if name == "K" else name: {
        label: (kv[i].double() - exact[i]).abs().flatten() for label, kv in stored.items()
    }
    for i, name in enumerate("KV")
}
fig = viz.plot_error_histograms(errors, "|stored - exact| per value, 256 tokens x 2 heads x 128")
plt.show()

# %% [markdown]
# Per-token FP8 scales (`amax / 448` per token and head, stored in the scale pool,
# 4 bytes per vector) help K, whose rows differ in range, and barely matter for V: in
# its normal range E4M3 keeps the same 3-bit relative precision whatever the scale.
# NVFP4's 16-value blocks adapt at a finer grain, but with 8 levels instead of 256.
#
# ## 4. The scale round-trip rule, broken
#
# The stored block scale is `sf8 = fp8(sf)`, a rounded number: the reader multiplies by
# it. A writer that quantizes with the unrounded `sf` (fault `nvfp4_unrounded_scale`)
# stores the same scales, but codes computed against a scale nobody stores: every block
# is read back off by `sf8 / sf`, up to 6 % (half a step of E4M3's 3-bit mantissa).

# %%
x = k_true.float().reshape(-1, dim)
gk = quant.global_scale_for(x, "nvfp4")
good, s_good = quant.nvfp4_quantize(x, gk)
bad, s_bad = faults.nvfp4_quantize_unrounded_scale(x, gk)
d_good, d_bad = quant.nvfp4_dequantize(good, s_good, gk), quant.nvfp4_dequantize(bad, s_bad, gk)
bound = quant.nvfp4_error_bound(s_good, gk)
same_scales = torch.equal(s_good.view(torch.uint8), s_bad.view(torch.uint8))
changed = (d_good != d_bad).float().mean()
print(f"stored block scales identical: {same_scales}; decoded values that differ: {changed:.1%}")
print(f"values beyond the format's error bound: right writer {int(((d_good - x).abs() > bound).sum())}, ", end="")
print(f"unrounded scale {int(((d_bad - x).abs() > bound).sum())} of {x.numel()}")
assert same_scales, "the faulty writer should store the very same block scales: the fault hides in the codes"
assert changed > 0.02, f"only {changed:.1%} of the decoded values differ; the unrounded scale should change over 2 %"
beyond_good, beyond_bad = int(((d_good - x).abs() > bound).sum()), int(((d_bad - x).abs() > bound).sum())
assert beyond_good == 0, f"{beyond_good} values of the right writer lie beyond the format's error bound"
assert beyond_bad > 0, "no value of the faulty writer lies beyond the error bound: the fault went unseen"

# %%
used = {
    name: ((d - x).abs() / bound).flatten() for name, d in (("right: q from sf8", d_good), ("fault: q from sf", d_bad))
}
title = "NVFP4 K: each value's error as a fraction of the format's bound"
fig = viz.plot_histogram(used, title, "|decoded - exact| / bound (1 = one block unit)", bins=60, logx=False)
plt.gca().axvline(1.0, color="k", lw=0.8, ls="--")
plt.gca().set_yscale("log")
plt.show()
worst_good, worst_bad = float(used["right: q from sf8"].max()), float(used["fault: q from sf"].max())
assert worst_good <= 1, f"the right writer uses {worst_good:.2f} of the bound: more than the format allows"
assert worst_bad > 1, f"the faulty writer uses at most {worst_bad:.2f} of the bound: it should exceed 1"

# %% [markdown]
# The faulty writer's codes are right for a scale the reader never sees: each block comes
# back scaled by `sf8 / sf`, and some values land beyond the error the format promises.
# Nothing crashes, and the error is a few percent, so only a bit-exact check catches it
# reliably: the harness's `quant_append` check compares codes with the reference's.

# %%
report = verify.run(
    quant_append_fn=kernels.append_paged_kv_quant_pool, faults={"nvfp4_unrounded_scale"}, checks=("quant_append",)
)
print(report.summary())
print(report.failures[0].detail)
failed_checks = sorted({r.check for r in report.failures})
assert not report.passed, "quant_append passed with the unrounded scale: the fault went unseen"
assert failed_checks == ["quant_append"], f"only quant_append should fail, got {failed_checks}"
formats_failed = sorted({r.case["format"] for r in report.failures})
assert formats_failed == ["nvfp4"], f"only NVFP4 cases can fail (FP8 has no block scale), got {formats_failed}"

# %% [markdown]
# ## 5. Why K and V need separate global scales
#
# A per-tensor scale maps the tensor's largest value onto the format's largest (448
# for FP8; 6 x 448 for NVFP4's two levels). K's range after RoPE is several times V's.
# One scale for both must be fitted to one of them: fitted to V (fault
# `shared_kv_scale`), K's outliers saturate; fitted to K (the max of the two), V uses a
# smaller part of the range. Measured, relative RMS error:


# %%
def kv_errors(fmt, k_scale, v_scale):
    """Relative RMS error of K and V quantized (by the reference) with these scales."""
    pool = QuantizedKVPool(18, ps, heads, dim, fmt, k_scale=k_scale, v_scale=v_scale)
    quant_reference.append_paged_kv_quant(k_true.float(), v, pool, slots)
    return [quant.relative_rms_error(pool.read_slots(slots, i), x) for i, x in enumerate(exact)]


choices = {}
for fmt in ("fp8", "nvfp4"):
    sk, sv = quant.global_scale_for(k_true, fmt), quant.global_scale_for(v, fmt)
    choices[fmt] = {
        "separate": kv_errors(fmt, sk, sv),
        "shared = V's": kv_errors(fmt, *faults.shared_kv_scale(sk, sv)),
        "shared = max": kv_errors(fmt, max(sk, sv), max(sk, sv)),
    }
    for name, (ek, ev) in choices[fmt].items():
        print(f"{fmt:>5} {name:>13}: K {ek:.3e}  V {ev:.3e}")
labels = [f"{fmt} {'KV'[i]}" for fmt in choices for i in (0, 1)]
series = {name: [choices[f][name][i] for f in choices for i in (0, 1)] for name in choices["fp8"]}
fig = viz.plot_error_bars(labels, series, "one global scale or two: relative RMS error", "relative RMS error")
plt.show()
for fmt in choices:
    errs = choices[fmt]  # name -> [K error, V error]
    k_sep, k_fit_v = errs["separate"][0], errs["shared = V's"][0]
    v_sep, v_fit_max = errs["separate"][1], errs["shared = max"][1]
    assert k_fit_v > 5 * k_sep, f"{fmt}: K with V's scale should saturate (> 5x): {k_fit_v:.2e} vs {k_sep:.2e}"
    assert v_fit_max < 1.1 * v_sep, f"{fmt}: V with the max scale should lose < 10 %: {v_fit_max:.2e} vs {v_sep:.2e}"

# %% [markdown]
# Fitted to V, K is clipped at V's range and its error grows twentyfold. Fitted to the
# larger range, V loses almost nothing at this 8x ratio: E4M3 keeps 3 mantissa bits
# over 15 binades, and NVFP4's block scales take up the slack. Separate scales are still
# the rule: a writer cannot know which tensor is larger at every layer, and the block
# scales' range (down to 2**-9) runs out once ratios reach the thousands. The harness
# check `quant_scales` requires every value within the format's error bound; the fault
# breaks it:

# %%
ok = verify.check_quant_scales(kernels.append_paged_kv_quant_pool, kernels.paged_decode_attention_quant_pool, set())
broken = verify.check_quant_scales(
    kernels.append_paged_kv_quant_pool, kernels.paged_decode_attention_quant_pool, {"shared_kv_scale"}
)
print(f"separate scales: {'pass' if ok.passed else 'FAIL'}; one scale: {'pass' if broken.passed else 'FAIL'}")
print(broken.detail)
assert ok.passed, f"quant_scales should pass with separate scales: {ok.detail}"
assert not broken.passed, "quant_scales passed with one scale for K and V: the fault went unseen"

# %% [markdown]
# ## 6. Decode attention error per format
#
# ### A dequantize-and-dot tile, in the page
#
# The read side in its smallest form: one tile of 16 FP8 K rows of 128 codes (per-tensor
# scale) and one query. Step 1 dequantizes the tile in fp32, `fp8_value(code) * scale`,
# with the suite's device codec `pagedkv_kernels.device.quant_codes.fp8_decode`; step 2 takes the dot
# product with the dequantized tile. The tile is read from the FP8 pool of section 3
# (sequence 0's first page, head 0). The dequantized tile must equal the reference's
# `quant.fp8_dequantize` bit for bit; the scores, sums in another order, must equal a
# float64 dot of the same values within `1e-6 |ref| + 1e-6`.


# %%
@triton.jit
def fp8_tile_scores(codes_ptr, q_ptr, scale, deq_ptr, s_ptr, N: tl.constexpr, D: tl.constexpr):
    """One tile: codes uint8 [N, D] (row-major), q fp32 [D], a per-tensor scale; writes the
    dequantized tile deq fp32 [N, D] and the scores s fp32 [N] = deq @ q."""
    n = tl.arange(0, N)
    d = tl.arange(0, D)
    offs = n[:, None] * D + d[None, :]
    k = quant_codes.fp8_decode(tl.load(codes_ptr + offs)) * scale  # step 1: dequantize in fp32
    tl.store(deq_ptr + offs, k)
    q = tl.load(q_ptr + d)
    tl.store(s_ptr + n, tl.sum(q[None, :] * k, axis=1))  # step 2: dot with the dequantized tile


def tile_scores(codes, q_row, scale):
    """Launch fp8_tile_scores on one [N, D] tile; returns (deq [N, D], scores [N]) on the CPU."""
    deq = torch.empty(codes.shape, dtype=torch.float32, device=DEV)
    s = torch.empty(codes.shape[0], dtype=torch.float32, device=DEV)
    fp8_tile_scores[(1,)](codes.contiguous().to(DEV), q_row.to(DEV), scale, deq, s, N=codes.shape[0], D=codes.shape[1])
    return deq.cpu(), s.cpu()


fp8_pool = pools["fp8"]
k_codes = fp8_pool.data[int(table[0, 0]), 0, :, 0].cpu()  # [16 rows, 128 codes]: page 0 of sequence 0, K, head 0
q_row = torch.randn(dim, generator=torch.Generator().manual_seed(5))
deq, s = tile_scores(k_codes, q_row, fp8_pool.k_scale)
want_deq = quant.fp8_dequantize(k_codes, fp8_pool.k_scale)
want_s = want_deq.double() @ q_row.double()
score_err = float(((s.double() - want_s).abs() / (1e-6 + 1e-6 * want_s.abs())).max())
print(f"dequantized tile bit-exact: {torch.equal(deq, want_deq)}; scores: worst error / tolerance {score_err:.2f}")
assert torch.equal(deq, want_deq), "step 1: the dequantized tile differs from quant.fp8_dequantize"
assert score_err <= 1, f"step 2: the scores are {score_err:.1f}x the tolerance off a float64 dot"
wrong_deq, _ = tile_scores(k_codes, q_row, fp8_pool.v_scale)  # V's scale for K's codes
off = float((wrong_deq - want_deq).abs().max())
print(f"with V's scale for K's codes: tile still bit-exact: {torch.equal(wrong_deq, want_deq)} (max |diff| {off:.2g})")
assert not torch.equal(wrong_deq, want_deq), "K's codes read with V's scale must not give K's values"

# %% [markdown]
# ### The production kernel
#
# `pagedkv_kernels.quant_decode.quant_decode_split_kernel` is the split-KV decode kernel of
# notebook 07 with this tile inside its loop: every iteration of `while tile < tile_hi`
# finds each row's page once, dequantizes that tile of K and of V (codes and scales from
# the same page and row) and runs the shared online-softmax step of
# `pagedkv_kernels.device.attention_core` on fp32 values. Below it, called out from
# `kernels/pagedkv_kernels/quant_decode.py`, the dequantize of each format: for NVFP4 the **two-level
# scale** `e2m1_value(code) * fp8_value(sf8) * gs` (block scale, then global scale,
# multiplied in the reference's order, so the values are bit for bit the reference's).

# %% tags=["nbval-ignore-output"]
# (shows the module's current source; shown, not compared)
display(viz.source_code(quant_decode.quant_decode_split_kernel))
nvfp4_line = "return e2m1_decode(code) * fp8_decode(sf8) * gs"
dequant_lines = [nvfp4_line, "return fp8_decode(code) * scale[:, None]", "return fp8_decode(code) * gs"]
display(viz.lesson_lines(quant_decode, dequant_lines))

# %%
kernel = quant_decode.quant_decode_split_kernel
loop, loop_end = viz.find_lines(kernel, "while tile < tile_hi"), viz.find_lines(kernel, "tile += 1")
calls = [n for n in viz.find_lines(kernel, "_dequant_tile(")]
print(f"dequantize calls (K, V) inside the tile loop: {[loop[0] < n < loop_end[0] for n in calls]}")
assert len(calls) == 2 and all(loop[0] < n < loop_end[0] for n in calls), (
    f"K and V must be dequantized inside the tile loop (lines {loop[0]}-{loop_end[0]}), found calls at {calls}"
)
two_level = viz.find_lines(quant_decode, dequant_lines[0])
assert len(two_level) == 1, "NVFP4 reads e2m1_value * fp8_value(sf8) * global scale, in that order, in one line"

# %% [markdown]
# ### The error per format
#
# The decode kernel computes scores and output in fp32 from the dequantized tiles. Against
# the float64 attention over the *exact* K and V, the error is the format's; against
# the reference decode over the *dequantized* pool, only fp32 accumulation remains
# (checked with the harness's fp32 pass rule).

# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
q = torch.randn(4, 8, dim, generator=gen)
seq_lens = torch.tensor(lens)
oracle = verify.scenarios.attention_oracle
truth = torch.stack([oracle(q[b].double(), k_true[batch == b], v[batch == b].double(), range(64)) for b in range(4)])
outs = {"bf16": kernels.paged_decode_attention(q.bfloat16().to(DEV), bf16, table.to(DEV), seq_lens.to(DEV))}
for label, pool in pools.items():
    outs[label] = kernels.paged_decode_attention_quant_pool(q.to(DEV), pool, table.to(DEV), seq_lens.to(DEV))
    want = quant_reference.paged_decode_attention_quant(q, pool.to("cpu"), table, seq_lens, precision="fp64")
    check = verify.compare.compare(outs[label], want, *verify.TOLERANCES[torch.float32])
    assert check.passed, f"{label}: the decode kernel is off the reference by {check.max_abs:.2e} at {check.worst}"
dec_err = {label: quant.relative_rms_error(out, truth) for label, out in outs.items()}
for label, e in dec_err.items():
    print(f"{label:>9}: relative RMS error of the decode output = {e:.2e}")
shown = {label: f"{e:.2e}" for label, e in dec_err.items()}
assert dec_err["bf16"] < dec_err["fp8 token"] < dec_err["fp8"] < dec_err["nvfp4"] < 0.3, (
    f"decode error should grow bf16 < fp8 token < fp8 < nvfp4, all below 0.3: {shown}"
)

# %%
title = "decode attention: error against float64 exact K, V"
errors = {"decode output": list(dec_err.values())}
fig = viz.plot_error_bars(list(dec_err), errors, title, "relative RMS error of output")
plt.show()

# %% [markdown]
# **Is the NVFP4 error what real models see?** Not as a number. These K and V are
# random Gaussian values with 4 planted outlier channels in K, 8 times the rest, and
# random queries; their attention is nearly uniform, so the output is a small average
# whose relative error is large. Real activations, real queries (which concentrate
# attention) and the calibrated scales of a served model give other numbers; a
# published accuracy evaluation of a NVFP4 KV cache on a real model is the source to
# cite for those, and this notebook does not have one. What the figure does show is
# what the **per-block scales** buy: the same 4-bit E2M1 codes with only the per-tensor
# scale (every block scaled by the tensor's largest value) lose most small values to 0.
# Measured on K and V of section 3 (reference quantizer, no kernel):


# %%
def e2m1_tensor_scale_only(x):
    """x rounded to E2M1 with one per-tensor scale (amax -> 6), no block scales: float32."""
    s = x.abs().max() / 6
    return (quant.e2m1_decode(quant.e2m1_encode((x / s).float())) * s).float()


for name, x in (("K", k_true.float()), ("V", v)):
    gx = quant.global_scale_for(x, "nvfp4")
    block = quant.nvfp4_dequantize(*quant.nvfp4_quantize(x, gx), gx)
    e_block, e_tensor = quant.relative_rms_error(block, x), quant.relative_rms_error(e2m1_tensor_scale_only(x), x)
    print(f"{name}: relative RMS error with block scales {e_block:.3f}, with the per-tensor scale only {e_tensor:.3f}")
    cut = 1 - e_block / e_tensor
    assert cut > 0.2, f"{name}: block scales should cut the error by > 20 %: {e_block:.3f} vs {e_tensor:.3f}"

# %% [markdown]
# ## 7. The harness on the quantized kernels
#
# `pagedkv_lab.verify` runs the quantized family on any pair of callables with the
# signatures of `kernels.append_paged_kv_quant_pool` and `kernels.paged_decode_attention_quant_pool`:
# `quant_append` (codes and scales bit for bit over FP8 per tensor, per token and NVFP4,
# both layouts, page sizes 1/5/16, padding slots, zeros, NaN, ±inf, out-of-range and
# subnormal inputs), `quant_decode` (NaN-poisoned pools, GQA, splits, a ring window)
# and `quant_scales`.

# %%
fns = {
    "quant_append_fn": kernels.append_paged_kv_quant_pool,
    "quant_decode_fn": kernels.paged_decode_attention_quant_pool,
}
report = verify.run(**fns, checks=verify.QUANT_CHECKS)
print(report.summary())
assert report.passed, f"the suite's quantized kernels failed the harness:\n{report}"

# %% [markdown]
# ## What was verified
#
# | claim | check |
# | --- | --- |
# | the memory formula equals a real quantized pool's bytes | `pool.nbytes == kv_cache_bytes(...)`, 3 formats |
# | one NVFP4 block by hand equals the reference and the kernel | packed bytes and block scale |
# | the write kernel (fused RoPE) equals the reference quantizer | codes and scales bit for bit, 3 formats |
# | error grows bf16 < FP8 < NVFP4 | relative RMS error of K and V |
# | the unrounded block scale is silent, `quant_append` catches it | same scales, 4 % of values differ |
# | a scale fitted to V saturates K, `quant_scales` catches it | K error x20, check fails |
# | the writer's five steps are its lines, in order (the codes from the rounded scale) | line positions |
# | a dequantize-and-dot tile in the page equals the reference | tile `torch.equal`; scores `1e-6 + 1e-6 \|ref\|` |
# | the production decode dequantizes K and V inside its tile loop; NVFP4 with the two-level scale | line positions |
# | the decode kernel matches the reference over the dequantized pool | fp32 pass rule, 3 formats |
# | per-block scales cut NVFP4's error on this data (vs a per-tensor scale alone) | > 20 % |
#
# ## Try this
#
# 1. **Predict, then run:** raise the outlier factor of K from 8 to 1000 in section 3 and
#    run sections 3 and 5. When does "shared = max" start to cost V precision, for FP8 and
#    for NVFP4? The `shared = max` assert of section 5 prints both errors.
# 2. Set the global scale of section 2 to 1e-4: the block scale overflows 448. Predict what
#    happens to the largest values, then read what `nvfp4_error_bound` says.
# 3. Write a K block that holds one NaN: what does the whole block read back as, and why
#    can E2M1 itself not say "NaN"?
# 4. Run `python -m pagedkv_kernels.tools.verify` (the quantized family runs on the suite's kernels) or
#    `verify.run(quant_append_fn=..., ...)` on your own quantizing append.
#
# ## In real systems
#
# - FlashInfer: [`flashinfer.page.nvfp4_quantize_append_paged_kv_cache`][fi-nvfp4] (and
#   `..._with_slot_mapping`), [`fp8_token_head_quantize_append_paged_kv_cache_with_slot_mapping`][fi-fp8],
#   [`flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache`][fi-rope].
# - TensorRT-LLM: `applyBiasRopeUpdateKVCacheV2` in `unfusedAttentionKernels_2_template.h`
#   ([`cpp/tensorrt_llm/kernels/unfusedAttentionKernels`][trtllm]): RoPE, then the
#   same-dtype, FP8 or FP4 store branch.
# - vLLM: [quantized KV cache][vllm] (`kv_cache_dtype="fp8"`, per-tensor and per-head scales).
#
# [fi-nvfp4]: https://docs.flashinfer.ai/generated/flashinfer.page.nvfp4_quantize_append_paged_kv_cache.html
# [fi-fp8]: https://docs.flashinfer.ai/generated/flashinfer.page.fp8_token_head_quantize_append_paged_kv_cache_with_slot_mapping.html
# [fi-rope]: https://docs.flashinfer.ai/generated/flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache.html
# [trtllm]: https://github.com/NVIDIA/TensorRT-LLM/tree/main/cpp/tensorrt_llm/kernels/unfusedAttentionKernels
# [vllm]: https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/
#
# **Next:** [10 · Chunked prefill](10_chunked_prefill.ipynb): many queries per sequence
# against the paged cache.
