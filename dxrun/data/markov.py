"""A learnable synthetic language with an exactly known loss floor.

A random sparse Markov chain of order ``k`` over ``S`` symbols: each context (the previous k
tokens) has ``branching`` possible successors with random probabilities. Sequences start from the
chain's stationary distribution, so every position is distributed alike and the best achievable
mean cross-entropy over a window is known exactly (``entropy_floor``). With k >= 2 a model needs
attention to do better than bigram statistics.

The global batch of step ``n`` depends only on (seed, stream, n): never on the mesh or the number
of processes, so every parallelism trains on identical data.
"""

from __future__ import annotations

import numpy as np

from dxrun.config import ConfigError

TRAIN, EVAL = 0, 1  # independent streams of the same chain
MAX_TABLE_BYTES = 2 * 2**30  # refuse chains whose tables need more (validation.validate)


def table_bytes(symbols: int, order: int, branching: int) -> int:
    """Peak memory of building the chain: per context, a row of ``symbols`` random float64 and
    its int64 argsort (alive together), then successors, probabilities, cumulative
    probabilities and the stationary solve's edge lists (a few ``branching``-long rows)."""
    return symbols**order * (16 * symbols + 48 * branching + 24)


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


class MarkovSource:
    def __init__(self, symbols: int, order: int, branching: int, seed: int,
                 batch_size: int, seq_len: int, max_iter: int = 100_000):
        self.S, self.k, self.batch_size, self.seq_len, self.seed = (
            symbols, order, batch_size, seq_len, seed)
        n_ctx = symbols**order
        rng = np.random.default_rng([seed, 0xC4A1])
        # Successors of each context and their probabilities (Dirichlet(1): varied entropies).
        # (a copy: the full argsort is n_ctx x symbols and must not outlive this line)
        self.succ = np.argsort(rng.random((n_ctx, symbols)), axis=1)[:, :branching].copy()
        self.prob = rng.dirichlet(np.ones(branching), size=n_ctx)
        self.cum = np.cumsum(self.prob, axis=1)
        self.cum[:, -1] = 1.0
        self.pi = self._stationary(max_iter)
        self.entropy_rate = float((self.pi * np.array([_entropy(p) for p in self.prob])).sum())
        self.entropy_floor = self._window_floor()

    def _next_ctx(self, ctx: np.ndarray, token: np.ndarray) -> np.ndarray:
        return (ctx * self.S + token) % (self.S**self.k)

    def _stationary(self, max_iter: int) -> np.ndarray:
        """Stationary distribution by power iteration of the lazy chain (P+I)/2, which has the
        same stationary distributions as P and converges even where P is periodic. A chain that
        mixes too slowly is refused: its entropy floor would be a wrong number."""
        n_ctx = self.S**self.k
        src = np.repeat(np.arange(n_ctx), self.succ.shape[1])
        dst = self._next_ctx(src, self.succ.reshape(-1))
        w = self.prob.reshape(-1)
        pi = np.full(n_ctx, 1.0 / n_ctx)
        for _ in range(max_iter):
            new = 0.5 * pi + 0.5 * np.bincount(dst, weights=pi[src] * w, minlength=n_ctx)
            change, pi = np.abs(new - pi).sum(), new
            if change < 1e-13:
                return pi / pi.sum()
        raise ConfigError(
            f"data.symbols={self.S}, data.order={self.k}, data.seed={self.seed}: the chain's "
            f"stationary distribution did not converge in {max_iter:,} iterations (last change "
            f"{change:.1e}), so its entropy floor is unknown; try another data.seed or a "
            "larger data.branching")

    def _window_floor(self) -> float:
        """Best mean loss over the seq_len targets of one window: target j (predicted from the
        j tokens before it) costs H(X_j | X_<j), which is the entropy rate once j >= order."""
        joint = self.pi.reshape((self.S,) * self.k)  # law of k consecutive tokens
        cond = []
        for j in range(1, self.k):
            h_j = _entropy(joint.sum(axis=tuple(range(j + 1, self.k))).ravel())
            h_prev = _entropy(joint.sum(axis=tuple(range(j, self.k))).ravel())
            cond.append(h_j - h_prev)
        full = max(0, self.seq_len - len(cond))
        return (sum(cond[: self.seq_len]) + full * self.entropy_rate) / self.seq_len

    def window_entropy(self) -> float:
        """The entropy of seq_len consecutive tokens, per token: the floor of a model of a
        window's joint law (``model.objective=mdlm``, whose bound lies above it). As
        ``entropy_floor`` but the first token costs its own entropy, H(X_0), and the window
        ends a token earlier (seq_len > order: that token costs the entropy rate)."""
        joint = self.pi.reshape((self.S,) * self.k)
        first = _entropy(joint.sum(axis=tuple(range(1, self.k))).ravel())
        return self.entropy_floor + (first - self.entropy_rate) / self.seq_len

    def batch(self, step: int, stream: int = TRAIN) -> np.ndarray:
        """Tokens [batch_size, seq_len + 1] (int32) of global step ``step``."""
        rng = np.random.default_rng([self.seed, stream, step])
        B, T = self.batch_size, self.seq_len + 1
        ctx = rng.choice(self.pi.size, size=B, p=self.pi)
        out = np.empty((B, T), np.int32)
        for i in range(self.k):  # the first k tokens are the digits of the starting context
            out[:, i] = (ctx // self.S ** (self.k - 1 - i)) % self.S
        u = rng.random((B, T))
        for t in range(self.k, T):
            idx = np.minimum((self.cum[ctx] < u[:, t:t + 1]).sum(axis=1), self.succ.shape[1] - 1)
            out[:, t] = self.succ[ctx, idx]
            ctx = self._next_ctx(ctx, out[:, t])
        return out
