"""Fits the rational tanh of the CPU kernels' 16-bit soft-capping (rough_tanh in kernels/cpu/cpu_kernels.cc) and
prints its coefficients with its error evaluated as the kernel evaluates it.

tanh(x) ~ x P(x^2) / Q(x^2) on [0, 9.02] (past which tanh rounds to 1 in fp32; the kernel clamps x there), P of degree
4 and Q of degree 3 with Q(0) = 1, fitted to tanh's relative error by Lawson's iteratively reweighted least squares in
double (its weights tend to those of the minimax fit). Each coefficient is then rounded to fp32 in turn, highest degree
first, and the rest refitted, so that the rounding costs little. The error printed is the fp32 evaluation's, Horner
with fused multiply-adds as the kernel does, against double's tanh over [-12, 12].

usage: python scripts/fit_rough_tanh.py
"""
import numpy as np

CLAMP = 9.02
P_TERMS, Q_TERMS = 5, 4  # P: p0 + p1 s + ... + p4 s^4; Q: 1 + q1 s + q2 s^2 + q3 s^3 (s = x^2)


def fit(s, r, fixed_p, fixed_q, iterations=40):
    """The free coefficients of P and Q (those not in fixed_*) minimising max |P/Q - r| / r over the points."""
    free_p = [i for i in range(P_TERMS) if i not in fixed_p]
    free_q = [j for j in range(1, Q_TERMS) if j not in fixed_q]
    weight, q_before = np.ones_like(s), np.ones_like(s)
    p, q = dict(fixed_p), {0: 1.0, **fixed_q}
    for _ in range(iterations):
        # P - r Q = 0, linear in the free coefficients; the fixed ones move to the right-hand side.
        a = np.vstack([s**i for i in free_p] + [-r * s**j for j in free_q]).T
        b = r - sum(v * s**i for i, v in fixed_p.items()) + sum(r * v * s**j for j, v in fixed_q.items())
        w = weight / (r * q_before)  # relative error of P/Q, with Q from the previous round
        scale = np.abs(a * w[:, None]).max(axis=0)
        c = np.linalg.lstsq(a * w[:, None] / scale, b * w, rcond=None)[0] / scale
        p.update(zip(free_p, c[:len(free_p)]))
        q.update(zip(free_q, c[len(free_p):]))
        q_before = sum(q[j] * s**j for j in range(Q_TERMS))
        error = np.abs((sum(p[i] * s**i for i in range(P_TERMS)) / q_before - r) / r)
        weight = weight * np.sqrt(error) + 1e-300  # Lawson's update
        weight /= weight.max()
    return p, q


def fp32_tanh(x, p, q):
    """The kernel's evaluation in fp32: clamp, s = a a, Horner by fused multiply-adds (exact products in double, one
    rounding to fp32 each), a P / Q."""
    f = np.float32
    a = np.clip(x.astype(f), f(-CLAMP), f(CLAMP))
    s = (a * a).astype(f)

    def horner(cs):
        acc = np.full_like(s, f(cs[-1]))
        for c in reversed(cs[:-1]):
            acc = (acc.astype(np.float64) * s.astype(np.float64) + np.float64(f(c))).astype(f)
        return acc

    return ((a * horner(p)).astype(f) / horner(q)).astype(f)


def main():
    k = np.arange(6000)
    x = np.concatenate([CLAMP / 2 * (1 - np.cos(np.pi * (k + 0.5) / 6000)), np.linspace(1e-4, CLAMP, 6000)])
    s, r = x * x, np.tanh(x) / x
    fixed_p, fixed_q = {}, {}
    for kind, i in sorted([("p", i) for i in range(P_TERMS)] + [("q", j) for j in range(1, Q_TERMS)],
                          key=lambda t: -t[1]):
        p, q = fit(s, r, fixed_p, fixed_q)
        if kind == "p":
            fixed_p[i] = float(np.float32(p[i]))
        else:
            fixed_q[i] = float(np.float32(q[i]))
    p = [fixed_p[i] for i in range(P_TERMS)]
    q = [1.0] + [fixed_q[j] for j in range(1, Q_TERMS)]
    grid = np.linspace(-12, 12, 400001)
    exact = np.tanh(grid.astype(np.float32).astype(np.float64))
    got = fp32_tanh(grid, p, q).astype(np.float64)
    nonzero = exact != 0
    print("P (s^0 .. s^4):", ", ".join(f"{v!r}f" for v in p))
    print("Q (s^0 .. s^3):", ", ".join(f"{v!r}f" for v in q))
    worst = np.max(np.abs(got - exact)[nonzero] / np.abs(exact[nonzero]))
    print(f"largest relative error in fp32 over [-12, 12]: {worst:.3g}")


if __name__ == "__main__":
    main()
