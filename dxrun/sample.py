"""``python -m dxrun.sample <run dir | checkpoints dir | step dir | HF dir> prompt="..."
[max_new_tokens=64 temperature=0 top_k=0 top_p=1 seed=0 n=1 steps=0 unmask=random] [overrides]``.

Text runs (and a HF dir's tokenizer.json) encode the prompt and decode the continuation with
the run's own tokenizer (bytes or its ``tokenizer.json``); a continuation ends at the first
end-of-text token. So do ``data=tokens`` runs whose ``meta.json`` names its tokenizer. Markov
runs (and token dirs that name none) take and print token ids, and the share of generated tokens
the chain allows after their context. Without a prompt, a markov sample starts from the first
``data.order`` tokens of a held-out sequence (one per sample), a text one from end-of-text.

Decoding is ``dxrun.tools.decode``: one jitted program with a key/value cache, on one device unless
a ``parallelism`` override names a mesh (``parallelism=tp2``: the model split over 2 devices);
``n`` must then divide over the mesh's data-parallel replicas. ``model.objective=mdlm`` runs
sample by their reverse process, ``steps`` steps (0: one per new token; dxrun.tools.decode).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from dxrun.config import ConfigError, head_dim_of
from dxrun.data import EVAL, Data, Tokenizer, recorded_tokenizer
from dxrun.tools.checkpoint import Loaded, is_hf_dir, load, main, split_args, token_ids

if TYPE_CHECKING:
    from dxrun.config import DataConfig, RunConfig

log = logging.getLogger("dxrun")

OPTIONS: dict[str, Any] = {"prompt": "", "max_new_tokens": 64, "temperature": 0.0, "top_k": 0,
                           "top_p": 1.0, "seed": 0, "n": 1, "steps": 0, "unmask": "random"}
UNMASK = ("random", "confidence")  # a masked-diffusion step's choice (dxrun.tools.decode)


def check_options(o: dict[str, Any]) -> None:
    for key, ok, want in (("max_new_tokens", o["max_new_tokens"] >= 1, ">= 1"),
                          ("n", o["n"] >= 1, ">= 1"),
                          ("temperature", 0 <= o["temperature"] < math.inf,
                           ">= 0 and finite (0 = greedy)"),
                          # jax.random.key keeps 32 bits: 2^32 would be seed 0 again
                          ("seed", 0 <= o["seed"] < 2**32, "in [0, 2^32)"),
                          ("top_k", o["top_k"] >= 0, ">= 0 (0 = no cut)"),
                          ("top_p", 0 < o["top_p"] <= 1, "in (0, 1] (1 = no cut)"),
                          ("steps", o["steps"] >= 0, ">= 0 (0 = one per new token)"),
                          ("unmask", o["unmask"] in UNMASK, " or ".join(UNMASK))):
        if not ok:
            raise ConfigError(f"{key}={o[key]} must be {want}")


def allowed_transitions(tokens_BxT: np.ndarray, succ: np.ndarray, symbols: int, order: int,
                        first: int) -> tuple[int, int]:
    """(allowed, total) over the tokens at positions >= ``first`` that have a full context of
    ``order`` tokens: allowed when the chain can follow that context with it."""
    allowed = total = 0
    for t in range(max(first, order), tokens_BxT.shape[1]):
        ctx_BxK = tokens_BxT[:, t - order:t]
        in_alphabet = (ctx_BxK < symbols).all(axis=1)
        ctx_B = (ctx_BxK % symbols) @ (symbols ** np.arange(order - 1, -1, -1))
        ok_B = in_alphabet & (succ[ctx_B] == tokens_BxT[:, t:t + 1]).any(axis=1)
        allowed, total = allowed + int(ok_B.sum()), total + len(ok_B)
    return allowed, total


def _ids(prompt: str, limit: int, what: str) -> list[int]:
    try:
        ids = token_ids(prompt)
    except ValueError:
        ids = [-1]
    if any(not 0 <= i < limit for i in ids):
        raise ConfigError(f"prompt={prompt!r}: {what} prompts are token ids 0-{limit - 1} "
                          "separated by spaces, e.g. prompt='3 7'")
    return ids


def prompt_tokens(d: DataConfig, vocab_size: int, prompt: str, n: int, chain: Any = None
                  ) -> tuple[np.ndarray, Any]:
    """The prompt as ``n x P`` ids, and the tokenizer (None: the run's tokens print as ids),
    for the run's data ``d`` and ``model.vocab_size``. ``chain``: the markov source of a markov
    run."""
    if chain is not None:
        if prompt:
            return np.tile(_ids(prompt, chain.S, "markov"), (n, 1)), None
        return chain.batch(0, EVAL)[:n, :d.order], None  # held-out starts: real contexts
    path, name = d.tokenizer, f"data.tokenizer={d.tokenizer}"
    if d.name == "tokens":  # text in and out when the token dir's meta.json names its tokenizer
        known, path = recorded_tokenizer(d)
        name = f"the tokenizer {path} (data.path={d.path}'s meta.json)"
        if not known:
            # a Hugging Face dir without tokenizer.json (an exported bytes-level run's)
            where = (f"{d.path} has no tokenizer.json" if getattr(d, "hf", False)
                     else f"data.path={d.path} records no tokenizer of its ids (meta.json)")
            if not prompt:
                raise ConfigError(f"prompt is empty; {where}, so this run takes token ids, "
                                  "e.g. prompt='464 2068'")
            what = f"{where}: its" if getattr(d, "hf", False) else "data=tokens"
            return np.tile(_ids(prompt, vocab_size, what), (n, 1)), None
    tok = Tokenizer(path)
    if bad := tok.unencodable(prompt):
        name = "bytes (UTF-8)" if path is None else name
        raise ConfigError(f"prompt={prompt!r}: {name} cannot encode "
                          f"{''.join(dict.fromkeys(bad))!r}; leave those characters out")
    ids = list(tok.encode(prompt)) if prompt else []
    if not ids:
        if tok.eot is None:
            raise ConfigError(f"prompt={prompt!r} encodes to no tokens and {name} has no "
                              "end-of-text token to start from; give a prompt")
        ids = [tok.eot]
    return np.tile(np.asarray(ids, np.int32), (n, 1)), tok


def hf_prompt_data(path: Path) -> Any:
    """How a Hugging Face directory's prompt is read when no data is given: with its
    tokenizer.json (text in and out), else as token ids."""
    tok = path.expanduser() / "tokenizer.json"
    if tok.is_file():
        return SimpleNamespace(name="text", tokenizer=str(tok), path=None)
    return SimpleNamespace(name="tokens", tokenizer=None, path=str(path), hf=True)


def make_decoder(loaded: Loaded, prompt_len: int, new_tokens: int, sampling: Any,
                 steps: int = 0, unmask: str = "random") -> Any:
    """``dxrun.tools.decode``'s generate for a loaded run, in the run's compute dtype
    (``train.precision``): a bf16 run decodes with bf16 weights and cache, as it trained (half
    the weight traffic per token); the logits stay fp32. A masked-diffusion run's is
    ``dxrun.tools.decode``'s: ``steps`` denoising steps (0: one per new token), ``unmask``."""
    from dxrun.experiment import jax_dtype  # imports JAX
    from dxrun.tools import decode  # imports JAX

    cfg, exp = loaded.cfg, loaded.exp
    m, dtype = cfg.model, jax_dtype(exp.plan.compute_dtype)  # the run plan's
    if m.objective == "mdlm":
        return decode.make_denoise(exp.graphdef, exp.mesh, exp.plan.rules, exp.param_shardings,
                                    prompt_len, new_tokens, sampling, steps or new_tokens, unmask,
                                    m, dtype)
    if m._target_:  # a user model: no key/value cache of dxrun's
        log.info("sampling: model._target_ has no key/value cache; each new token recomputes "
                 "the whole sequence")
        return decode.make_generate_recomputed(exp.graphdef, exp.mesh, exp.plan.rules,
                                        exp.param_shardings, prompt_len, new_tokens, sampling)
    return decode.make_generate(exp.graphdef, exp.mesh, exp.plan.rules, exp.param_shardings,
                         prompt_len, new_tokens, sampling, m.n_layers, m.n_kv_heads,
                         head_dim_of(m), dtype=dtype)


def no_context_parallel(cp: int) -> None:
    """Decoding one token at a time has no sequence to split over ``parallelism.cp``."""
    if cp > 1:
        raise ConfigError(f"sampling decodes one token at a time and does not split it over "
                          f"parallelism.cp={cp}; sample on a mesh with cp=1 (no parallelism "
                          "override: one device; or parallelism=tp2)")


def sample(path: Path, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Generate; return the tokens (``n x T``), the prompt length, the printable samples and,
    for markov data, (allowed, total) generated transitions."""
    check_options(options)
    n, new = options["n"], options["max_new_tokens"]

    def as_batch(cfg: RunConfig) -> None:  # the plan checks the n sequences split over replicas
        no_context_parallel(cfg.parallelism.cp)  # said before the replicas are counted
        cfg.data.batch_size, cfg.data.per_device_batch_size, cfg.train.grad_accum = n, None, 1

    try:
        # A few sequences: one device is plenty, unless a parallelism override names a mesh.
        loaded = load(path, overrides, key="path", with_data=False, adjust=as_batch,
                      layout="dp1")
    except ConfigError as e:
        if not str(e).startswith(f"data.batch_size={n} "):
            raise
        raise ConfigError(f"n={n} samples do not split over this mesh's data-parallel "
                          f"replicas ({str(e).split('dp*fsdp=')[1].split(' ')[0]}); ask for a "
                          "multiple of them, or decode on a mesh with dp=fsdp=1 (no "
                          "parallelism override: one device; or parallelism=tp2)") from None
    cfg = loaded.cfg
    no_context_parallel(loaded.exp.plan.cp)
    if cfg.model.moe.n_experts:  # the cached decode runs dense blocks only (tools/decode.py)
        raise ConfigError(f"model.moe.n_experts={cfg.model.moe.n_experts}: dxrun.sample decodes "
                          "dense models only, not a mixture of experts yet; score this run with "
                          "python -m dxrun.evaluate or dxrun.logits")
    if options["top_k"] > cfg.model.vocab_size:
        raise ConfigError(f"top_k={options['top_k']} is larger than the vocabulary "
                          f"(model.vocab_size={cfg.model.vocab_size}); use top_k<="
                          f"{cfg.model.vocab_size}, or top_k=0 for no cut")
    data = hf_prompt_data(path) if is_hf_dir(path) and cfg.data.name == "markov" else cfg.data
    if getattr(data, "_target_", None):  # your own data: ids, or its held-out starts
        chain, tok = None, None
        prompt_BxP = (Data(cfg).local_batch(0, EVAL)[:n, :1] if not options["prompt"] else
                      np.tile(_ids(options["prompt"], cfg.model.vocab_size, "data._target_"),
                              (n, 1)))
    else:
        chain = Data(cfg).markov if data.name == "markov" else None
        prompt_BxP, tok = prompt_tokens(data, cfg.model.vocab_size, options["prompt"], n, chain)
    P, limit = prompt_BxP.shape[1], cfg.model.max_seq_len
    if P >= limit:
        raise ConfigError(f"prompt: {P} tokens leave no room for a new one in "
                          f"model.max_seq_len={limit}; give a prompt of at most {limit - 1} "
                          "tokens")
    if P + new > limit:
        raise ConfigError(f"max_new_tokens={new} after a {P}-token prompt needs {P + new} "
                          f"positions, beyond model.max_seq_len={limit}; use max_new_tokens<="
                          f"{max(limit - P, 0)}")
    if P + new > cfg.data.seq_len:
        log.warning("%d positions (prompt + max_new_tokens) but the model trained on windows "
                    "of data.seq_len=%d: the later positions were never trained", P + new,
                    cfg.data.seq_len)
    from dxrun.tools.decode import Sampling  # imports JAX: after load's (runtime.command_imports)

    s = Sampling(options["temperature"], options["top_k"], options["top_p"], options["seed"])
    generate = make_decoder(loaded, P, new, s, options["steps"], options["unmask"])
    tokens_BxT = np.asarray(generate(loaded.params, prompt_BxP))
    out: dict[str, Any] = {"tokens": tokens_BxT, "prompt_len": P, "step": loaded.step}
    if tok is None:
        out["texts"] = [" ".join(map(str, r[:P])) + " | " + " ".join(map(str, r[P:]))
                        for r in tokens_BxT]
    else:
        texts = []
        for r in tokens_BxT:
            cont = list(r[P:])
            if tok.eot is not None and tok.eot in cont:
                cont = cont[:cont.index(tok.eot)]
            texts.append(options["prompt"] + tok.decode(cont))
        out["texts"] = texts
    if chain is not None:
        out["allowed"] = allowed_transitions(tokens_BxT, chain.succ, chain.S, chain.k, P)
    return out


def run(argv: list[str]) -> None:
    path, options, overrides = split_args("sample", argv, OPTIONS)
    out = sample(path, options, overrides)
    how = ("greedy" if options["temperature"] == 0 else
           f"temperature {options['temperature']}, top_k {options['top_k']}, top_p "
           f"{options['top_p']}, seed {options['seed']}")
    log.info("%d sample(s) of %d new tokens (%s)", options["n"], options["max_new_tokens"], how)
    for i, text in enumerate(out["texts"]):
        print(f"[{i}] {text}")
    if "allowed" in out:
        ok, total = out["allowed"]
        print(f"allowed transitions: {ok}/{total} = {ok / max(total, 1):.1%} of the generated "
              "tokens follow the markov chain from their context")


if __name__ == "__main__":
    main("sample", run)
