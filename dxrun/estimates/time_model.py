"""The accelerator time model: one train step's time on a GPU or TPU target, from the model's
shapes, the mesh and the collectives of the compiled step (pure functions; no JAX).

XLA:CPU's program is not the GPU's, so only what the CPU compile is faithful about (the
shardings, the collectives and their groups) is read from it; the rest is counted from the
shapes, kernel by kernel class: matmuls (each a roofline at a shape-dependent efficiency),
fused attention, elementwise work as HBM traffic under XLA:GPU's fusion, and collectives over
the target's links. The data replicas' collectives overlap compute, the tensor-parallel ones
do not. Every constant is in ``COST``, one row per target, each with its source; the model,
term by term, is in the guide (docs/guide/large-models.md, "The time model").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dxrun.config import head_dim_of
from dxrun.cost import GATED, GB, RECOMPUTE_MATMULS, active_d_ff, attention_flops, is_causal
from dxrun.plan import KERNELS, kv_gather_bytes, padded_vocab, table_rows

if TYPE_CHECKING:
    from dxrun.config import RunConfig
    from dxrun.plan import MeshPlan


@dataclass(frozen=True)
class Cost:
    """A target's cost-model constants (beside its datasheet row, ``plan.targets.TARGETS``, and its
    peak, ``PEAK_TFLOPS``). ``sources``: where each number comes from."""

    matmul_efficiency: float  # best-shape achieved / dense peak (bf16 GEMM)
    matmul_half_dim: float  # smallest matmul dim at which the efficiency is half the best
    attention_efficiency: float  # fused attention, forward + backward, of the bf16 peak
    hbm_efficiency: float  # achieved / datasheet HBM bandwidth of a streaming kernel
    link_efficiency: float  # collective bus bandwidth / datasheet link bandwidth (one way)
    devices_per_node: int  # devices behind one NVLink / ICI domain
    network_bytes_per_s: float  # per device, across nodes, one way
    clock_scale: float = 1.0  # sustained / boost clock (a power limit below the datasheet's)
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # the share of the modelled elementwise traffic left as passes of their own (XLA:TPU fuses
    # norms, activations and residual adds into the matmuls that read or write them)
    elementwise_share: float = 1.0
    # a scanned layer stack (model.scan_layers) copies each layer's saved activations out of
    # the scan's stacked buffers in the backward (a read and a write of each): priced where
    # measured (``scan_traffic``)
    scan_copies: bool = False


_MAMF = ("stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul "
         "FLOPS comparison table' (bf16 torch.matmul, best shape)")
_FA = ("FlashAttention-2 paper (Dao 2023) fig. 7 (A100, fwd+bwd, causal, head dim 128: 50-60% "
       "of peak); FlashAttention-3 paper (Shah et al. 2024) figs. 5-6 (H100 cuDNN/FA2 "
       "fwd+bwd, causal: 40-55% of the 989 TFLOP/s peak)")
_STREAM = ("BabelStream/nvbandwidth device-to-device copies: ~90% of the HBM datasheet figure "
           "on A100/H100 (NVIDIA's 'CUDA C++ Best Practices', effective bandwidth); 0.85 kept "
           "for XLA's multi-operand fusions")
_NCCL = ("nccl-tests all_reduce_perf bus bandwidth on 8-GPU NVLink nodes: ~230 GB/s A100 "
         "(of 300), ~360 GB/s H100 without NVLS (of 450); NVIDIA NCCL docs/blog")
_NET = ("400 Gb/s InfiniBand NDR / RoCE per GPU (DGX H100, Grand Teton), 200 Gb/s HDR (DGX "
        "A100); A3 VMs 200 Gb/s per GPU")
_HALF_DIM = ("assumed, not fitted: cuBLAS/CUTLASS tiles are 128 (or 256) wide, so a matmul "
             "whose smallest dim is under a tile leaves most of a tile idle")
_SUSTAINED = ("calibrated: fitted on MaxText's Llama 2 7B run (BENCHMARKS.md, 'Plan mode vs "
              "published GPU runs'); H100 SXM boards hold ~1.6 GHz of their 1.98 GHz boost "
              "through a long run (the peak and MAMF assume the boost)")

_V5E_FIT = ("calibrated: fitted on dxrun's GPT-2 small/medium/large steps on one v5e chip "
            "(bf16, splash attention, remat none and full, layers unrolled; BENCHMARKS.md, "
            "'TPU'); the attention fraction is what splash's kernels reach in their profile at "
            "head dim 64")
_V5E_SCAN = ("measured: the same steps with the layers scanned run slower on a v5e by the "
             "backward's dynamic-slice copies of the stacked activations (BENCHMARKS.md, 'TPU')")


def _gpu(**own: str) -> dict[str, str]:
    """An NVIDIA target's sources: the shared ones, with ``own`` in place."""
    return {"matmul_half_dim": _HALF_DIM, "attention_efficiency": _FA,
            "hbm_efficiency": _STREAM, "link_efficiency": _NCCL,
            "devices_per_node": "8 GPUs per NVLink node (HGX/DGX, Grand Teton, A3)",
            "network_bytes_per_s": _NET, "elementwise_share": "1.0: the traffic as modelled",
            "scan_copies": "not priced: not measured on a GPU"} | own


def _tpu(**own: str) -> dict[str, str]:
    """A TPU target's sources: the shared ones, with ``own`` in place."""
    return {"matmul_half_dim": "MXU 128 x 128 (Cloud TPU system architecture)",
            "hbm_efficiency": "assumed as GPUs'", "link_efficiency": "assumed",
            "network_bytes_per_s": "DCN, assumed", "clock_scale": "1.0, not calibrated"} | own


COST: dict[str, Cost] = {
    "h100": Cost(0.803, 96, 0.45, 0.85, 0.80, 8, 50 * GB, 0.79, _gpu(
        matmul_efficiency=_MAMF + ": H100 SXM 794.5 of 989", clock_scale=_SUSTAINED)),
    "h100_96gb_500w": Cost(0.803, 96, 0.45, 0.85, 0.80, 8, 50 * GB, 0.51, _gpu(
        matmul_efficiency=_MAMF + ": H100 SXM 794.5 of 989",
        network_bytes_per_s="torchtitan docs/performance.md: 400 Gb/s RDMA per GPU",
        clock_scale="calibrated: fitted on torchtitan's Llama 3.1 8B run (BENCHMARKS.md). It "
                    "stands for the 500 W limit of 700 W-TDP parts (torchtitan "
                    "docs/performance.md) and also absorbs what that run does and dxrun would "
                    "not: eager PyTorch (its compiled row is 16% faster) and op-level AC "
                    "recomputing every other matmul; 0.51 is not a clock measurement")),
    "h200": Cost(0.836, 96, 0.45, 0.85, 0.80, 8, 50 * GB, 0.79, _gpu(
        matmul_efficiency=_MAMF + ": GH200 828.6 of 989 (the H200's HBM3e die)",
        clock_scale="assumed as the H100's (calibrated there)")),
    "a100": Cost(0.869, 96, 0.55, 0.85, 0.77, 8, 25 * GB, 1.0, _gpu(
        matmul_efficiency=_MAMF + ": A100 SXM 271.2 of 312",
        clock_scale="1.0, not calibrated: no A100 run calibrates (the A100 row validates)")),
    "l40s": Cost(0.80, 96, 0.45, 0.85, 0.80, 8, 25 * GB, 0.79, _gpu(
        matmul_efficiency="assumed as the H100's (no MAMF published)",
        clock_scale="assumed as the H100's", link_efficiency="PCIe 4.0 x16, assumed 80%",
        devices_per_node="8 PCIe cards per server, assumed",
        network_bytes_per_s="200 Gb/s per GPU, assumed")),
    # TPUs: Pallas' splash attention (dxrun/model/splash_attention.py). The v5e's matmul and
    # attention fractions are fitted on dxrun's own steps on one chip (BENCHMARKS.md, "TPU");
    # the v5p's matmul fraction is MaxText's published MFU (README "Runtime Performance
    # Results": 55-65% on dense Llama-class models; the matmuls alone do better).
    "v5e": Cost(0.85, 128, 0.20, 0.85, 0.80, 256, 25 * GB, 1.0, _tpu(
        matmul_efficiency=_V5E_FIT, attention_efficiency=_V5E_FIT, elementwise_share=_V5E_FIT,
        scan_copies=_V5E_SCAN, devices_per_node="a v5e pod slice (256 chips on ICI)"),
        elementwise_share=0.45, scan_copies=True),
    "v5p": Cost(0.80, 128, 0.20, 0.85, 0.80, 8960, 25 * GB, 1.0, _tpu(
        matmul_efficiency="MaxText README v5p results (~60% MFU end to end)",
        attention_efficiency="assumed as the v5e's", elementwise_share="assumed as the v5e's",
        scan_copies="assumed as the v5e's", devices_per_node="a v5p pod (8,960 chips on ICI)"),
        elementwise_share=0.45, scan_copies=True),
}

# What the estimate row says of its basis: set from the last `python -m benchmarks
# --published` (BENCHMARKS.md, "Plan mode vs published GPU runs").
ESTIMATE_BASIS = {"calibrated_on": 2, "validated_on": 7, "within_pct": 19}


def basis_text(basis: dict[str, int] = ESTIMATE_BASIS) -> str:
    return (f"roofline calibrated on {basis['calibrated_on']} runs, validated within "
            f"±{basis['within_pct']}% on {basis['validated_on']} published runs (BENCHMARKS.md)")


@dataclass(frozen=True)
class Workload:
    """One device's share of one train step, as the time model reads it."""

    model: Any  # the model config (n_layers, d_model, n_heads, n_kv_heads, d_ff, mlp, pos, ...)
    seq_len: int
    rows: int  # sequences per device per micro-batch (the tensor group shares them)
    micro_steps: int  # train.grad_accum
    vocab: int  # the output layer's columns (padded vocabulary)
    tp: int
    n_devices: int
    params: float  # all parameters (the model's, padded)
    params_per_device: float  # this device's shard (the optimizer updates these)
    precision: str  # fp32 | bf16
    grad_reduce_dtype: str = "fp32"
    # ZeRO-1 (parallelism.shard_optimizer): the parameters this device's optimizer updates
    # (its shard of params_per_device, 1/dp of it); None = params_per_device
    updated_per_device: float | None = None
    # model.loss_chunk resolved: with the vocabulary split over tensor (tp > 1) the chunks'
    # backward redoes the head's forward; on one shard their forward made the gradient
    loss_chunk: int = 0
    remat: str = "none"  # the run plan's model.remat
    cp: int = 1  # the context axis: a device holds seq_len / cp positions of each row
    kernel: str = "xla"  # the run plan's attention kernel (attention_kernel.KERNELS)

    @property
    def tokens(self) -> int:
        """Tokens one device computes per micro-batch."""
        return self.rows * self.seq_len // self.cp


def fused_attention(w: Workload) -> bool:
    """Whether the run's kernel (the plan's, ``attention_kernel.KERNELS``) is a fused flash
    attention: cuDNN's or splash. A context axis's blockwise kernel is priced as XLA's
    attention matmuls (its blocks are einsums)."""
    return w.kernel != "blockwise" and KERNELS[w.kernel].fused


def _matmul_s(m: float, n: float, k: float, peak: float, hbm: float, cost: Cost,
              in_bytes: int, out_bytes: int) -> float:
    """One ``m x k`` by ``k x n`` matmul: the slower of its compute and its operands' traffic."""
    s = min(m, n, k)
    eff = cost.matmul_efficiency * s / (s + cost.matmul_half_dim)
    compute = 2 * m * n * k / (peak * eff)
    memory = (in_bytes * (m * k + k * n) + out_bytes * m * n) / hbm
    return max(compute, memory)


def _block_matmuls(w: Workload) -> list[tuple[float, float]]:
    """(input width, output width) of one block's weight matmuls on one device (tp-split)."""
    m = w.model
    E, tp = head_dim_of(m), w.tp
    F = active_d_ff(m)
    mlp_in = [(m.d_model, F / tp)] * (2 if m.mlp in GATED else 1)
    return [(m.d_model, (m.n_heads + 2 * m.n_kv_heads) * E / tp), (m.n_heads * E / tp, m.d_model),
            *mlp_in, (F / tp, m.d_model)]


def matmul_time(w: Workload, peak: float, hbm: float, cost: Cost, fused: bool) -> dict:
    """Seconds of one device's matmuls per step: the blocks' (forward, input gradient, weight
    gradient; plus the forward again under model.remat=full or keep_attention), the output
    layer's, and XLA's
    attention matmuls when the attention is not fused."""
    m, t = w.model, w.tokens
    a = 2 if w.precision == "bf16" else 4  # operand bytes; weight gradients accumulate in fp32
    fwd = bwd = 0.0
    shapes = _block_matmuls(w)
    for k_in, n_out in shapes:
        fwd += _matmul_s(t, n_out, k_in, peak, hbm, cost, a, a)
        bwd += _matmul_s(t, k_in, n_out, peak, hbm, cost, a, a)  # input gradient
        bwd += _matmul_s(k_in, n_out, t, peak, hbm, cost, a, 4)  # weight gradient (fp32)
    # remat=full (and keep_attention) recomputes the forward but its last matmul (the MLP's down
    # projection: no gradient needs its output; step_flops)
    k_in, n_out = shapes[-1]
    redo = (fwd - _matmul_s(t, n_out, k_in, peak, hbm, cost, a, a)
            if w.remat in RECOMPUTE_MATMULS else 0.0)
    L = m.n_layers
    blocks = L * (fwd + bwd + redo)
    D, V = m.d_model, w.vocab / w.tp
    head = (_matmul_s(t, V, D, peak, hbm, cost, a, 4) * (2 if w.loss_chunk and w.tp > 1 else 1)
            + _matmul_s(t, D, V, peak, hbm, cost, a, a) + _matmul_s(D, V, t, peak, hbm, cost, a, 4))
    attn = 0.0
    if not fused:  # XLA's: per (sequence, head) a T x E by E x T and a T x T by T x E matmul
        H, E, T = m.n_heads / w.tp, head_dim_of(m), w.seq_len
        Q = T // w.cp  # a context axis: this device's queries against every key
        one = (_matmul_s(Q, T, E, peak, hbm, cost, a, 4)  # scores, fp32
               + _matmul_s(Q, E, T, peak, hbm, cost, a, a))  # weighted sum
        # backward: four matmuls of the same sizes (2 x); remat=full: the forward again
        attn = one * (3 + (w.remat == "full")) * H * w.rows * L
    return {"blocks": blocks * w.micro_steps, "output_layer": head * w.micro_steps,
            "attention": attn * w.micro_steps}


def elementwise_bytes(w: Workload, fused: bool) -> dict[str, float]:
    """HBM bytes of one device's non-matmul work per step, under XLA:GPU's fusion (each fused
    kernel reads its inputs and writes its outputs once). Per token and layer, forward: the two
    norms (read the residual, write the normed input), rotary embedding (q and k), the MLP's
    activation, the two residual adds; the backward reads twice what the forward did and writes
    as much (2 x), remat recomputes the forward (+1 x). Per step: the cross-entropy over the
    logits (two fp32 reads, a compute-dtype gradient write), the weights' casts to bf16 at each
    use (after the FSDP gather: whole tp shards), the gradient accumulation across micro-batches,
    and AdamW on this device's shard (reads weight, gradient, two moments; writes three)."""
    m, t = w.model, w.tokens
    a = 2 if w.precision == "bf16" else 4
    r = 4 if m.residual_dtype == "fp32" else a
    D, E, tp = m.d_model, head_dim_of(m), w.tp
    H, K, F = m.n_heads / tp, m.n_kv_heads / tp, m.d_ff / tp
    norms = 2 * (r * D + a * D)
    residual = 2 * (2 * r * D + a * D)
    rope = 2 * a * (H + K) * E if m.pos == "rope" else 0.0
    act = (3 if m.mlp in GATED else 2) * a * F
    softmax = 0.0 if fused else H * w.seq_len * (4 + a)  # read fp32 scores, write probabilities
    fwd = norms + residual + rope + act + softmax
    passes = 3 + (1 if w.remat != "none" else 0)  # forward, backward (2 x), recomputation
    layers = m.n_layers * fwd * passes * t
    V = w.vocab / tp
    loss = (8 + a) * V * t
    per_micro = layers + loss
    uses = 3 if w.remat in RECOMPUTE_MATMULS else 2  # forward, input gradient (+ recomputed)
    casts = (6 * w.params / tp) * uses if w.precision == "bf16" else 0.0
    accumulate = 8 * w.params_per_device if w.micro_steps > 1 else 0.0
    updated = w.params_per_device if w.updated_per_device is None else w.updated_per_device
    optimizer = 7 * 4 * updated + 4 * updated  # AdamW + clip norm, on this device's shard
    return {"activations": per_micro * w.micro_steps,
            "weights": (casts + accumulate) * w.micro_steps, "optimizer": optimizer}


def _is_tensor_group(groups: list[list[int]], tp: int) -> bool:
    """A group of consecutive devices of size tp: the innermost mesh axis, ``tensor``."""
    return tp > 1 and all(len(g) == tp and sorted(g) == list(range(min(g), min(g) + tp))
                          and min(g) % tp == 0 for g in groups)


def _is_context_group(groups: list[list[int]], cp: int, tp: int) -> bool:
    """Groups of cp devices tp apart: the ``context`` axis, just outside ``tensor``."""
    return cp > 1 and all(len(g) == cp and sorted(g) == list(range(min(g), min(g) + cp * tp, tp))
                          for g in groups)


def collective_time(colls: list[dict], w: Workload, link: float, cost: Cost) -> dict:
    """Seconds of the step's collectives: (tensor-parallel and context, over data replicas).
    The context axis's key/value gathers are on the attention's path, not overlapped, as the
    tensor-parallel ones. bf16 halves what the GPU program sends in bf16 (see the module
    docstring)."""
    out = {"tensor": 0.0, "data": 0.0, "tensor_bytes": 0.0, "data_bytes": 0.0}
    per_node = cost.devices_per_node
    for c in colls:
        tensor = (_is_tensor_group(c["groups"], w.tp)
                  or _is_context_group(c["groups"], w.cp, w.tp))
        n = max(len(g) for g in c["groups"])
        if n <= 1:
            continue
        nbytes = c["bytes"] * c["runs"]
        if w.precision == "bf16" and "f32" in c["dtypes"] and (
                tensor or (w.grad_reduce_dtype == "bf16" and c["kind"] != "all-gather")):
            nbytes /= 2
        spans = any(len({d // per_node for d in g}) > 1 for g in c["groups"])
        bw = cost.network_bytes_per_s if spans else link * cost.link_efficiency
        key = "tensor" if tensor else "data"
        out[key] += nbytes / bw
        out[f"{key}_bytes"] += nbytes
    return out


def scan_traffic(w: Workload) -> float:
    """HBM bytes a scanned layer stack adds to one device's step: the backward copies each
    layer's saved activations out of the scan's stacked buffers (a read and a write). Saved
    per token: under remat ``none`` the residual stream twice, the two norms' outputs, q, k, v,
    the attention output and the MLP's hidden activations; ``full`` the layer's input;
    ``keep_attention`` the input, the attention output and its fp32 log-sum-exp per head;
    ``dots`` the input and the matmul outputs."""
    m = w.model
    a = 2 if w.precision == "bf16" else 4
    r = 4 if m.residual_dtype == "fp32" else a
    D, E, tp = m.d_model, head_dim_of(m), w.tp
    qkv, F = (m.n_heads + 2 * m.n_kv_heads) / tp * E, m.d_ff / tp
    ups = 2 if m.mlp in GATED else 1
    saved = {"none": 2 * r * D + 2 * a * D + a * qkv + a * D + (ups + 1) * a * F,
             "full": r * D, "keep_attention": r * D + a * D + 4 * m.n_heads / tp,
             "dots": r * D + a * qkv + a * D + ups * a * F}[w.remat]
    return 2 * saved * m.n_layers * w.tokens * w.micro_steps


def step_time(w: Workload, cost: Cost, peak_tflops: float, hbm_bytes_per_s: float,
              link_bytes_per_s: float, collectives: list[dict]) -> dict[str, Any]:
    """One device's step: the parts (seconds) and their sum under the overlap assumption."""
    peak = peak_tflops * 1e12 * cost.clock_scale
    hbm = hbm_bytes_per_s * cost.hbm_efficiency
    fused = fused_attention(w)
    mm = matmul_time(w, peak, hbm, cost, fused)
    attention = 0.0
    if fused:
        # The tensor group shares its rows and splits their heads: a device runs 1/tp of the
        # heads of every row it holds (w.tokens: the group's rows).
        per_token = attention_flops(w.model, w.seq_len, is_causal(w.model)) / w.tp
        fwd = w.model.n_layers * per_token * w.tokens * w.micro_steps
        recompute = fwd if w.remat in ("full", "dots") else 0.0
        attention = (3.5 * fwd + recompute) / (peak * cost.attention_efficiency)
    eb = elementwise_bytes(w, fused)
    elementwise = cost.elementwise_share * sum(eb.values()) / hbm
    if cost.scan_copies and w.model.scan_layers:  # copies: nothing to fuse them into
        eb["scan"] = scan_traffic(w)
        elementwise += eb["scan"] / hbm
    comm = collective_time(collectives, w, link_bytes_per_s, cost)
    if not collectives and w.cp > 1:  # no compiled step: the context axis's gathers counted
        comm["tensor_bytes"] = kv_gather_bytes(
            batch_per_replica=w.rows * w.micro_steps, seq_len=w.seq_len,
            n_kv_heads=w.model.n_kv_heads, head_dim=head_dim_of(w.model),
            n_layers=w.model.n_layers, cp=w.cp, tp=w.tp, dtype_bytes=2 if w.precision == "bf16" else 4)
        comm["tensor"] = comm["tensor_bytes"] / (link_bytes_per_s * cost.link_efficiency)
    compute = sum(mm.values()) + attention + elementwise
    step = compute + comm["tensor"] + max(0.0, comm["data"] - compute)
    return {
        "model": "accelerator cost model (dxrun/estimates/time_model.py)",
        "fused_attention": fused,
        "matmul_s": mm["blocks"] + mm["output_layer"], "matmul_parts_s": mm,
        "attention_s": attention + mm["attention"],
        "elementwise_s": elementwise, "elementwise_bytes": eb,
        "compute_s": compute,
        "tensor_collective_s": comm["tensor"], "data_collective_s": comm["data"],
        "collective_bytes": comm["tensor_bytes"] + comm["data_bytes"],
        "exposed_collective_s": comm["tensor"] + max(0.0, comm["data"] - compute),
        "step_time_s": step,
    }


def workload(cfg: RunConfig, plan: MeshPlan, n_params: float, params_per_device: float,
             vocab: int = 0, kernel: str | None = None) -> Workload:
    """The time model's view of a run config and its mesh plan. ``vocab``: the target's padded
    vocabulary (``autotune.footprint.target_vocab``, what the memory model counts too); 0: padded as
    a GPU run pads it, whatever the CPU compile did. ``kernel``: the attention kernel of a run
    on the target (``autotune.footprint.kernel_on``); None: the plan's."""
    replicas = plan.replicas
    accum = plan.grad_accum
    return Workload(
        model=cfg.model, seq_len=plan.seq_len,
        rows=plan.global_batch // replicas // accum, micro_steps=accum,
        vocab=vocab or padded_vocab(table_rows(cfg.model), plan.tp, "gpu",
                                    cfg.parallelism.vocab_align),
        tp=plan.tp, n_devices=plan.n_devices, params=n_params,
        params_per_device=params_per_device, precision=plan.precision,
        grad_reduce_dtype=plan.grad_reduce_dtype,
        updated_per_device=params_per_device / plan.dp if plan.shard_optimizer else None,
        loss_chunk=plan.loss_chunk, remat=plan.remat, cp=plan.cp,
        kernel=kernel or plan.attention)
