"""Divisors by factorisation: the search's meshes and microbatch counts for any size in microseconds.

`fivedc search --gpus N` and `--global-batch B` list the divisors of N and of each data
rank's batch; trial division up to n took minutes for n near 10^9. Here n is factored
(small primes by trial division, a large cofactor by Miller-Rabin and Pollard's rho) and
the divisors are the products of the prime powers.
"""

from __future__ import annotations

import math


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, from its prime factors (n up to 2^63 in
    milliseconds: trial division up to sqrt(n) would take minutes for n near 10^12)."""
    if n < 1:
        return []
    out = [1]
    for prime, power in _factors(n):
        out = [d * prime**k for d in out for k in range(power + 1)]
    return sorted(out)


def _factors(n: int) -> list[tuple[int, int]]:
    """(prime, power) of n: trial division by 2, 3 and 6k +- 1 below 2^16 (a cluster's or a
    batch's sizes have small factors), then what is left split by Miller-Rabin and Pollard's rho."""
    found: dict[int, int] = {}
    for p in (2, 3):
        while n % p == 0:
            found[p] = found.get(p, 0) + 1
            n //= p
    p = 5
    while p * p <= n and p < 1 << 16:
        for q in (p, p + 2):
            while n % q == 0:
                found[q] = found.get(q, 0) + 1
                n //= q
        p += 6
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            found[m] = found.get(m, 0) + 1
        else:
            d = _rho(m)
            stack += [d, m // d]
    return sorted(found.items())


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the bases that decide every n below 3.3 * 10^24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in bases:
        return True
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int:
    """A non-trivial factor of the composite n (Pollard's rho, Floyd's cycle)."""
    if n % 2 == 0:
        return 2
    for c in range(1, n):
        x = y = 2
        d = 1
        while d == 1:
            x = (x * x + c) % n
            y = (y * y + c) % n
            y = (y * y + c) % n
            d = math.gcd(abs(x - y), n)
        if d != n:
            return d
    return n
