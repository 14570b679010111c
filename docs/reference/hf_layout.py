"""The Hugging Face guide's layout tables, from the code's own mapping (``dxrun.hf``):
which HF tensor becomes which dxrun weight, in which shape, and how its numbers move. Filled into
docs/guide/huggingface.md where it says ``<!-- generated: hf-layout -->`` (docs/hooks.py)."""

from __future__ import annotations

from dxrun.hf import SAME, TABLES

MARKER = "<!-- generated: hf-layout -->"
HOW = {SAME: "as stored (Conv1D's (in, out) is dxrun's order)",
       "transposed": "transposed: Linear's (out, in) to (in, out)"}
TITLES = {"gpt2": "GPT-2 (`GPT2LMHeadModel`; `c_attn`: q, k, v side by side; embeddings tied: "
                  "no `lm_head` tensor)",
          "llama": "Llama (`LlamaForCausalLM`; `lm_head.weight` absent when "
                   "`tie_word_embeddings`), and Mistral (`MistralForCausalLM`), the same tensors",
          "qwen2": "Qwen2/2.5 (`Qwen2ForCausalLM`): Llama's tensors and the q, k, v biases "
                   "(`model.qkv_bias`)",
          "qwen3": "Qwen3 (`Qwen3ForCausalLM`): Llama's tensors and each head's q and k norms "
                   "(`model.qk_norm=head`); E is `head_dim`",
          "olmo2": "OLMo 2 (`Olmo2ForCausalLM`): Llama's tensors but its norms: q and k across "
                   "all heads (`model.qk_norm=proj`), and the blocks' two after attention and "
                   "the MLP (`model.norm_position=post`)",
          "gemma2": "Gemma 2 (`Gemma2ForCausalLM`): Llama's tensors (Gemma 1's, "
                    "`GemmaForCausalLM`, are Llama's) and its four norms a block "
                    "(`model.norm_position=sandwich`), each weight w of a scale 1 + w "
                    "(`model.norm_plus_one`)",
          "gemma3_text": "Gemma 3 text (`Gemma3ForCausalLM`): Gemma 2's tensors and each head's "
                         "q and k norms (`model.qk_norm=head`)",
          "phi3": "Phi-3 (`Phi3ForCausalLM`): Llama's tensors but q, k, v in one "
                  "`qkv_proj` and gate, up in one `gate_up_proj`, split on import and joined "
                  "on export",
          "mixtral": "Mixtral (`MixtralForCausalLM`): Llama's tensors but the MLP's, in place "
                     "of which each layer (every one an MoE layer) has a router and N experts "
                     "(`{j}`: expert j, at index j of the stacked weight's `expert` axis; X: "
                     "an expert's width, `intermediate_size`); an MoE layer's attention and "
                     "norms are `moe_blocks/...`, its weights stacked over the MoE layers",
          "qwen2_moe": "Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's tensors, and in its MoE "
                       "layers Qwen3-MoE's router and experts besides a shared expert S "
                       "(`shared_expert_intermediate_size`) wide and its sigmoid gate "
                       "(`model.moe.shared_d_ff`, `model.moe.shared_gate=true`)",
          "qwen3_moe": "Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's tensors, and in its MoE "
                       "layers (`model.moe.every`, `model.moe.first_dense`) a router and N "
                       "experts in place of the MLP, X `moe_intermediate_size` wide; its dense "
                       "layers are `blocks/...`, its MoE layers `moe_blocks/...`"}


def hf_layout_markdown() -> str:
    out = []
    for kind, table in TABLES.items():
        out += [f"**{TITLES[kind]}**", "", "| HF tensor | HF shape | dxrun weight | how |",
                "|---|---|---|---|"]
        for w in table:
            part = (f"; block {w.part[0] + 1} of ({', '.join(w.part[1])}) on the output axis"
                    if w.part else "")
            matrix = w.kind != SAME or (len(w.hf_shape) == 2 and w.hf_shape[0] not in "VP")
            how = HOW[w.kind] if matrix else "as stored"
            out.append(f"| `{w.hf}` | ({', '.join(w.hf_shape)}) | `{w.dxrun}` | {how}{part} |")
        out.append("")
    return "\n".join(out)


def fill(markdown: str) -> str:
    """``markdown`` with the marker replaced by the tables (pages without it unchanged)."""
    return markdown.replace(MARKER, hf_layout_markdown()) if MARKER in markdown else markdown
