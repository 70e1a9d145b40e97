"""What a step costs, learnt from the steps the engine runs: an exponentially weighted least-squares
fit of step seconds ~ a + b * decode rows + c * prefill tokens. No torch.

The scheduler sizes each step's prefill to a target time per output token (option.target_tpot_ms):
every running sequence gets one token a step, so a step's time is each one's TPOT. The fit forgets
old steps (weight HALF_LIFE_STEPS), so it follows a host whose load changes; until it has seen
enough different steps to tell decode from prefill (MIN_STEPS), it makes no estimate and the
scheduler keeps option.max_rolling_batch_prefill_tokens as its budget.
"""
from __future__ import annotations

# A step's weight halves after this many newer steps.
HALF_LIFE_STEPS = 64
# Steps seen before the fit is trusted.
MIN_STEPS = 8
# A small ridge (relative, on the diagonal) keeps the 3x3 system solvable before decode and
# prefill have varied apart.
RIDGE = 1e-6


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b for a 3x3 system (Gaussian elimination with pivoting); None when singular."""
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-15:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, 4):
                    m[r][k] -= f * m[col][k]
    return [m[i][3] / m[i][i] for i in range(3)]


class StepCostModel:
    def __init__(self, half_life_steps: int = HALF_LIFE_STEPS):
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.xx = [[0.0] * 3 for _ in range(3)]     # weighted sum of x x^T, x = (1, rows, tokens)
        self.xy = [0.0] * 3                         # weighted sum of x * seconds
        self.steps = 0
        self.coef: tuple[float, float, float] | None = None    # (a, b, c) once trusted

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One step's shape and its measured time."""
        x = (1.0, float(decode_rows), float(prefill_tokens))
        for i in range(3):
            self.xy[i] = self.xy[i] * self.decay + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = self.xx[i][j] * self.decay + x[i] * x[j]
        self.steps += 1
        if self.steps >= MIN_STEPS:
            a = [[v * (1.0 + RIDGE) if i == j else v for j, v in enumerate(row)]
                 for i, row in enumerate(self.xx)]
            sol = _solve3(a, self.xy)
            if sol is not None:
                # Costs are never negative: a noisy fit must not promise free tokens.
                self.coef = (max(sol[0], 0.0), max(sol[1], 0.0), max(sol[2], 0.0))

    def predict(self, decode_rows: int, prefill_tokens: int) -> float | None:
        """Seconds a step of this shape is expected to take (None: not enough steps seen)."""
        if self.coef is None:
            return None
        a, b, c = self.coef
        return a + b * decode_rows + c * prefill_tokens

    def prefill_budget(self, decode_rows: int, target_s: float) -> int | None:
        """The most prefill tokens a step with `decode_rows` decode rows can take and still be
        expected to end within target_s (0 when the decode rows alone fill it; None: no estimate)."""
        base = self.predict(decode_rows, 0)
        if base is None:
            return None
        c = self.coef[2]
        room = target_s - base
        if room <= 0:
            return 0
        if c <= 0:
            return None     # prefill looks free: nothing to bound it by but the hard cap
        return int(room / c)
