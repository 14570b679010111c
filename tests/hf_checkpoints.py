"""Small Hugging Face checkpoints made here (random weights under the hub's tensor names,
written with ``safetensors.numpy``) and their reference logits from ``transformers``' own Flax
classes: what tests/test_hf*.py load into dxrun and compare against. No network: every
directory is written locally and transformers runs with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

V = 101  # odd: padded on tp2 and tp4
GPT2 = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=V,
            activation_function="gelu_new", layer_norm_epsilon=1e-5)
LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=96, vocab_size=V,
             max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, hidden_act="silu")
# The Llama-shaped families, each with its pieces: Mistral's sliding window (5 of the tests' 16
# positions) with a head_dim of its own, Qwen2's q, k, v biases, Qwen3's per-head q and k norms
# with a head_dim of its own and tied embeddings (Qwen3-0.6B's).
MISTRAL = dict(LLAMA, model_type="mistral", head_dim=16, sliding_window=5, rope_theta=1e6)
QWEN2 = dict(LLAMA, model_type="qwen2", use_sliding_window=False, rms_norm_eps=1e-6)
QWEN3 = dict(LLAMA, model_type="qwen3", head_dim=16, tie_word_embeddings=True,
             attention_bias=False)
OLMO2 = dict(LLAMA, model_type="olmo2", rms_norm_eps=1e-6)
# Gemma's pieces: GeGLU (tanh GELU), 1 + w norms, embeddings scaled by sqrt(d), a head_dim of
# its own, tied embeddings. Gemma 2's besides: the sandwich norms, soft caps low enough to bite
# on these weights, a score scale not the head dim's, windowed and full layers alternating.
# Gemma 3's: q and k norms, 2 windowed layers to 1 full, the windowed ones on their own rope
# base. Phi-3's: q, k, v and gate, up fused in the checkpoint, a window.
GEMMA = dict(LLAMA, model_type="gemma", head_dim=16, tie_word_embeddings=True,
             hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6)
GEMMA2 = dict(GEMMA, model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
              num_hidden_layers=4, sliding_window=5, attn_logit_softcapping=2.0,
              final_logit_softcapping=5.0, query_pre_attn_scalar=24)
GEMMA3 = dict(GEMMA, model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
              num_hidden_layers=3, sliding_window=5, rope_local_base_freq=100.0,
              query_pre_attn_scalar=16,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
PHI3 = dict(LLAMA, model_type="phi3", sliding_window=7, pad_token_id=None,
            original_max_position_embeddings=32)
# The mixtures of experts (issue 82): Mixtral's 8 experts, top 2 renormalised, in every layer,
# with a window; Qwen3-MoE's 8 experts of their own width, top 3 not renormalised, dense and
# MoE layers alternating (decoder_sparse_step=2), q and k norms.
MIXTRAL = dict(LLAMA, model_type="mixtral", intermediate_size=32, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=5, rope_theta=1e6)
QWEN3_MOE = dict(LLAMA, model_type="qwen3_moe", num_hidden_layers=4, head_dim=16,
                 num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                 norm_topk_prob=False, decoder_sparse_step=2, rms_norm_eps=1e-6)
# Qwen2-MoE's: q, k, v biases, a shared expert and its gate, dense first layer (mlp_only_layers).
QWEN2_MOE = dict(LLAMA, model_type="qwen2_moe", num_hidden_layers=3, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                 shared_expert_intermediate_size=40, mlp_only_layers=[0], rms_norm_eps=1e-6)
MOE_FAMILIES = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE}
FAMILIES = {"mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "olmo2": OLMO2,
            "gemma": GEMMA, "gemma2": GEMMA2, "gemma3_text": GEMMA3, "phi3": PHI3}


def hf_config(fields: dict):
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_tensors(fields: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under the hub's names (GPT-2: without ``transformer.``, as the hub's
    gpt2 has them), at the shapes ``fields`` (a config.json) gives."""
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    out = {}
    if fields["model_type"] == "gpt2":
        D, F, P = fields["n_embd"], 4 * fields["n_embd"], fields["n_positions"]
        out = {"wte.weight": w(V, D), "wpe.weight": w(P, D),
               "ln_f.weight": 1 + w(D), "ln_f.bias": w(D)}
        for i in range(fields["n_layer"]):
            h = f"h.{i}."
            out |= {h + "ln_1.weight": 1 + w(D), h + "ln_1.bias": w(D),
                    h + "attn.c_attn.weight": w(D, 3 * D), h + "attn.c_attn.bias": w(3 * D),
                    h + "attn.c_proj.weight": w(D, D), h + "attn.c_proj.bias": w(D),
                    h + "ln_2.weight": 1 + w(D), h + "ln_2.bias": w(D),
                    h + "mlp.c_fc.weight": w(D, F), h + "mlp.c_fc.bias": w(F),
                    h + "mlp.c_proj.weight": w(F, D), h + "mlp.c_proj.bias": w(D)}
        return out
    D, F = fields["hidden_size"], fields["intermediate_size"]
    H, K = fields["num_attention_heads"], fields["num_key_value_heads"]
    E = fields.get("head_dim") or D // H
    out = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D)}
    if not fields.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(V, D)
    for i in range(fields["num_hidden_layers"]):
        h = f"model.layers.{i}."
        if fields["model_type"] in ("qwen2", "qwen2_moe"):
            out |= {h + f"self_attn.{x}_proj.bias": w(n * E)
                    for x, n in zip("qkv", (H, K, K), strict=True)}
        if fields["model_type"] in ("qwen3", "qwen3_moe"):
            out |= {h + f"self_attn.{x}_norm.weight": 1 + w(E) for x in "qk"}
        kind = fields["model_type"]
        if kind == "olmo2":  # its norms: q, k across heads; after, not before
            out |= {h + "self_attn.q_norm.weight": 1 + w(H * E),
                    h + "self_attn.k_norm.weight": 1 + w(K * E),
                    h + "post_feedforward_layernorm.weight": 1 + w(D)}
        else:
            out[h + "input_layernorm.weight"] = 1 + w(D)
        if kind in ("gemma2", "gemma3_text"):  # the sandwich's other two
            out |= {h + f"{x}_feedforward_layernorm.weight": w(D) for x in ("pre", "post")}
        if kind == "gemma3_text":
            out |= {h + f"self_attn.{x}_norm.weight": w(E) for x in "qk"}
        out[h + "post_attention_layernorm.weight"] = 1 + w(D)
        if kind == "phi3":  # q, k, v and gate, up joined
            out |= {h + "self_attn.qkv_proj.weight": w((H + 2 * K) * E, D),
                    h + "self_attn.o_proj.weight": w(D, H * E),
                    h + "mlp.gate_up_proj.weight": w(2 * F, D)}
        else:
            out |= {h + "self_attn.q_proj.weight": w(H * E, D),
                    h + "self_attn.k_proj.weight": w(K * E, D),
                    h + "self_attn.v_proj.weight": w(K * E, D),
                    h + "self_attn.o_proj.weight": w(D, H * E)}
        out |= _mlp(fields, i, h, w)
    return out


def _mlp(fields: dict, i: int, h: str, w) -> dict[str, np.ndarray]:
    """Layer ``i``'s MLP tensors: dense (gate, up, down: Phi-3's gate and up fused) or a
    mixture of experts' (Mixtral's w1, w3, w2 in every layer; Qwen3-MoE's, in its MoE
    layers)."""
    D, F = fields["hidden_size"], fields["intermediate_size"]
    kind = fields["model_type"]
    step = fields.get("decoder_sparse_step", 1)
    if kind == "mixtral" or (kind in ("qwen2_moe", "qwen3_moe") and (i + 1) % step == 0
                             and i not in fields.get("mlp_only_layers", [])):
        n = fields.get("num_local_experts") or fields["num_experts"]
        X = fields.get("moe_intermediate_size", F)
        block, names = (("block_sparse_moe", ("w1", "w3", "w2")) if kind == "mixtral"
                        else ("mlp", ("gate_proj", "up_proj", "down_proj")))
        out = {h + f"{block}.gate.weight": w(n, D, scale=1.0)}  # routes far from ties
        for j in range(n):
            e = h + f"{block}.experts.{j}."
            out |= {e + f"{names[0]}.weight": w(X, D), e + f"{names[1]}.weight": w(X, D),
                    e + f"{names[2]}.weight": w(D, X)}
        if kind == "qwen2_moe":  # the shared expert and its gate
            S = fields["shared_expert_intermediate_size"]
            out |= {h + "mlp.shared_expert.gate_proj.weight": w(S, D),
                    h + "mlp.shared_expert.up_proj.weight": w(S, D),
                    h + "mlp.shared_expert.down_proj.weight": w(D, S),
                    h + "mlp.shared_expert_gate.weight": w(1, D)}
        return out
    out = {}
    if kind != "phi3":  # drawn in this order: the stored references' weights
        out |= {h + "mlp.gate_proj.weight": w(F, D), h + "mlp.up_proj.weight": w(F, D)}
    return out | {h + "mlp.down_proj.weight": w(D, F)}


def write_hf_dir(d: Path, fields: dict, tensors: dict[str, np.ndarray], shards: int = 1
                 ) -> Path:
    """config.json (as transformers writes it) and the tensors, in one model.safetensors or in
    ``shards`` files with their index."""
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    hf_config(fields).to_json_file(str(d / "config.json"))
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(d / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
         "weight_map": weight_map}))
    return d


def reference_logits(d: Path, tokens_BxL: np.ndarray) -> np.ndarray:
    """transformers' Flax model of the directory (one model.safetensors), fp32."""
    from transformers import FlaxGemmaForCausalLM, FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM

    kind = json.loads((d / "config.json").read_text())["model_type"]
    cls = {"gpt2": FlaxGPT2LMHeadModel, "gemma": FlaxGemmaForCausalLM}.get(
        kind, FlaxLlamaForCausalLM)
    import jax

    model = cls.from_pretrained(str(d), dtype=np.float32)
    # jitted: one compile, where the eager call compiles each operation on its own
    return np.asarray(jax.jit(lambda p, t: model(t, params=p).logits)(model.params, tokens_BxL))


def write_tokenizer(path: Path, corpus: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer.json of at most ``vocab`` ids trained on ``corpus``, with
    GPT-2's end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=sorted(set(corpus.read_text())),
                                  show_progress=False)
    tok.train([str(corpus)], trainer)
    tok.save(str(path))
    return path
