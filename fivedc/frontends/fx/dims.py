"""Dim variables of a traced model: created by ops, merged as torch's semantics demand, named last.

The fx frontend does not know a tensor's dim names while it walks the graph: the
output dim of `c_fc` only becomes `ffn` once we know what consumes it, and the out
dim of a fused `c_attn` only becomes `[heads, head_dim]` at the `view` that splits
it. So every dim starts as an anonymous *atom* with a size. Ops that need two dims
to be the same (a residual add, a linear contracting its input, attention's q and
k) merge their atoms (union-find); a `view` that splits a dim *refines* its atom
into parts, row-major, everywhere it occurs (the weight that produced it too), unless an op
recorded it as one dim (attention's sequence, an embedding's hidden, the batch and sequence
of an ATen call: `keep_whole`); a view that would split such a dim has no rule, and runs as
its ATen call (`fivedc/frontends/fx/generic.py`). The dims of one parameter never merge
(`keep_apart`: a square weight whose output a residual adds to its input); an op that would
merge them has no rule either. A unify that fails changes nothing.
Roles seen along the way leave *hints* (`heads`, `vocab`, ...) with a priority; at
the end `DimTable.names` gives each atom class the best hint as its name. Two
classes never merge because their sizes happen to be equal; they share a name only
when they carry the same hint and size and never meet in one tensor (the token
embedding's and the LM head's `vocab`), which the frontend checks afterwards by
re-running shape inference on the finished graph.
"""

from __future__ import annotations

import math

ROLE = 30  # hints from this priority up name a role (batch, hidden, heads, ffn...), not a module

Group = tuple[int, ...]  # the atoms of one torch dim, row-major; () is a size-1 dim


class DimMismatch(Exception):
    """Two dims that torch treats as one cannot be merged (sizes or splits disagree)."""


class DimTable:
    def __init__(self) -> None:
        self._parent: list[int] = []
        self._size: list[int] = []
        self._parts: dict[int, tuple[int, ...]] = {}  # root -> its refinement
        self._hints: dict[int, list[tuple[int, int, str]]] = {}  # root -> (-priority, order, name)
        self._order = 0
        self._whole: set[int] = set()  # roots an op reads as one dim: never refined
        self._apart: dict[int, set[int]] = {}  # root -> atoms its class never merges with

    # ---- atoms ----------------------------------------------------------------------
    def new(self, size: int, hint: str | None = None, prio: int = 0) -> int:
        atom = len(self._parent)
        self._parent.append(atom)
        self._size.append(int(size))
        if hint:
            self.hint(atom, hint, prio)
        return atom

    def find(self, atom: int) -> int:
        root = atom
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[atom] != root:
            self._parent[atom], atom = root, self._parent[atom]
        return root

    def size(self, atom: int) -> int:
        return self._size[self.find(atom)]

    def leaves(self, atoms: tuple[int, ...]) -> tuple[int, ...]:
        """The atoms with every refinement expanded, as class roots."""
        out: list[int] = []
        for atom in atoms:
            root = self.find(atom)
            parts = self._parts.get(root)
            out.extend(self.leaves(parts) if parts else (root,))
        return tuple(out)

    def numel(self, atoms: tuple[int, ...]) -> int:
        return math.prod(self.size(a) for a in atoms)

    def hint(self, atom: int, name: str, prio: int) -> None:
        for leaf in self.leaves((atom,)):
            self._hints.setdefault(leaf, []).append((-prio, self._order, name))
            self._order += 1

    def best_hint(self, atom: int) -> tuple[str | None, int]:
        hints = self._hints.get(self.find(atom))
        if not hints:
            return None, -1
        prio, _, name = min(hints)
        return name, -prio

    # ---- merging and splitting ------------------------------------------------------
    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self._size[ra] != self._size[rb]:
            raise DimMismatch(f"sizes {self._size[ra]} and {self._size[rb]}")
        if {ra, rb} & self._whole and (ra in self._parts or rb in self._parts):
            raise DimMismatch(f"a dim of size {self._size[ra]} read whole meets one split into parts")
        if self._kept_apart(ra, rb):
            raise DimMismatch(f"two dims of one parameter (size {self._size[ra]}) would be one dim")
        pa, pb = self._parts.pop(ra, None), self._parts.pop(rb, None)
        self._parent[rb] = ra
        if rb in self._whole:
            self._whole.add(ra)
        if rb in self._apart:
            self._apart.setdefault(ra, set()).update(self._apart.pop(rb))
        self._hints.setdefault(ra, []).extend(self._hints.pop(rb, []))
        if pa and pb:
            self._parts[ra] = pa
            self.unify(pa, pb)
        elif pa or pb:
            self._parts[ra] = pa or pb

    def keep_apart(self, atoms: tuple[int, ...]) -> None:
        """The dims of one parameter never become one dim (a square weight [hidden, hidden] whose
        output a residual adds to its input): a merge of two of them is a `DimMismatch`."""
        for a in atoms:
            self._apart.setdefault(self.find(a), set()).update(b for b in atoms if b != a)

    def _kept_apart(self, ra: int, rb: int) -> bool:
        return any(rb in self.leaves((z,)) for z in self._apart.get(ra, ())) or \
            any(ra in self.leaves((z,)) for z in self._apart.get(rb, ()))

    def keep_whole(self, atom: int) -> None:
        """Mark a leaf atom's class as one dim for good (attention's sequence): `refine` refuses
        it. An atom already split is left as it is (the op read its parts)."""
        root = self.find(atom)
        if root not in self._parts:
            self._whole.add(root)

    def refine(self, atom: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Split a leaf atom row-major into parts of `sizes`; returns the parts."""
        root = self.find(atom)
        if root in self._parts or math.prod(sizes) != self._size[root]:
            raise DimMismatch(f"cannot split a dim of size {self._size[root]} into {sizes}")
        if root in self._whole:
            raise DimMismatch(f"a dim of size {self._size[root]} that an op reads as one (attention's "
                              f"sequence, an embedding's hidden, an ATen call's tokens) cannot be split")
        parts = tuple(self.new(s) for s in sizes)
        self._parts[root] = parts
        for part in parts:  # apart from what the whole was apart from
            self._apart[part] = set(self._apart.get(root, ()))
        return parts

    def unify(self, g1: tuple[int, ...], g2: tuple[int, ...]) -> None:
        """Make two runs of atoms (row-major, equal total size) the same, splitting where needed.
        A merge that must not happen (`keep_whole`, `keep_apart`) is refused before anything
        changes, so a failed unify leaves the table as it was."""
        self._check_merges(g1, g2)
        l1, l2 = list(self.leaves(g1)), list(self.leaves(g2))
        i = j = 0
        while i < len(l1) and j < len(l2):
            s1, s2 = self.size(l1[i]), self.size(l2[j])
            if s1 == 1 and s2 != 1:
                i += 1
            elif s2 == 1 and s1 != 1:
                j += 1
            elif s1 == s2:
                self.union(l1[i], l2[j])
                i, j = i + 1, j + 1
            elif s1 > s2 and s1 % s2 == 0:
                l1[i : i + 1] = self.refine(l1[i], (s2, s1 // s2))
            elif s2 > s1 and s2 % s1 == 0:
                l2[j : j + 1] = self.refine(l2[j], (s1, s2 // s1))
            else:
                raise DimMismatch(f"dims of sizes {s1} and {s2} do not line up")
        if any(self.size(a) != 1 for a in l1[i:] + l2[j:]):
            raise DimMismatch("the two shapes have different sizes")

    def _check_merges(self, g1: tuple[int, ...], g2: tuple[int, ...]) -> None:
        """`unify` without changing anything: a `DimMismatch` where it would split a dim read whole
        or merge two dims kept apart (a part of a split stands for its atom, whose apart-set
        it inherits)."""
        l1 = [(a, self.size(a)) for a in self.leaves(g1)]
        l2 = [(a, self.size(a)) for a in self.leaves(g2)]
        i = j = 0
        while i < len(l1) and j < len(l2):
            (a, s1), (b, s2) = l1[i], l2[j]
            if s1 == 1 and s2 != 1:
                i += 1
            elif s2 == 1 and s1 != 1:
                j += 1
            elif s1 == s2:
                if self.find(a) != self.find(b) and self._kept_apart(self.find(a), self.find(b)):
                    raise DimMismatch(f"two dims of one parameter (size {s1}) would be one dim")
                i, j = i + 1, j + 1
            elif s1 % s2 == 0 or s2 % s1 == 0:
                big, small, run, k = (a, s2, l1, i) if s1 > s2 else (b, s1, l2, j)
                if self.find(big) in self._whole:
                    raise DimMismatch(f"a dim of size {max(s1, s2)} that an op reads whole cannot be split")
                run[k : k + 1] = [(big, small), (big, max(s1, s2) // small)]
            else:
                return  # unify itself says why

    def regroup(self, groups: tuple[Group, ...], shape: tuple[int, ...], *,
                tokens: frozenset[int] = frozenset()) -> tuple[Group, ...]:
        """The groups of a `view`/`reshape` of a tensor with `groups` to `shape` (row-major).

        A dim of size 1 that has an atom (one head, a batch of one) is a dim of the IR
        value, so it stays in the layout: a size-1 torch dim takes it when it comes
        next; else it joins the next larger torch dim (merging [.., 1, head_dim] into
        [.., hidden] keeps the head), unless it is one of the `tokens` (batch, seq: the
        roots of their classes), which joins the one before (flattening [batch, 1, vocab]
        to [batch, vocab] keeps the sequence with the batch); trailing ones the last."""
        atoms = list(self.leaves(tuple(a for g in groups for a in g)))
        out: list[Group] = []
        i = 0
        for want in shape:
            if want == 1:
                take = i < len(atoms) and self.size(atoms[i]) == 1
                out.append((atoms[i],) if take else ())
                i += take
                continue
            group: list[int] = []
            have = 1
            while have < want:
                while i < len(atoms) and self.size(atoms[i]) == 1:
                    if out and not group and self.find(atoms[i]) in tokens:
                        out[-1] += (atoms[i],)
                    else:
                        group.append(atoms[i])
                    i += 1
                if i >= len(atoms):
                    raise DimMismatch(f"cannot view as {tuple(shape)}")
                size = self.size(atoms[i])
                need = want // have
                if want % have == 0 and need % size == 0:
                    group.append(atoms[i])
                    have *= size
                    i += 1
                elif want % have == 0 and size % need == 0:
                    head, rest = self.refine(atoms[i], (need, size // need))
                    group.append(head)
                    atoms[i] = rest
                    have = want
                else:
                    raise DimMismatch(f"cannot view as {tuple(shape)}")
            out.append(tuple(group))
        if any(self.size(a) != 1 for a in atoms[i:]):
            raise DimMismatch(f"cannot view as {tuple(shape)}")
        if atoms[i:]:
            if not out:
                raise DimMismatch(f"a view to {tuple(shape)} drops a named dim of size 1")
            out[-1] += tuple(atoms[i:])
        return tuple(out)

    # ---- names ----------------------------------------------------------------------
    def names(self, tensors: list[tuple[int, ...]], *, share: bool = True) -> dict[int, str]:
        """A name for every atom class in `tensors` (lists of leaf atoms, in first-use order).

        The best hint names a class; a second class with the same hint gets a numbered
        name, unless `share`, the hint names a role, and it has the same size and never
        shares a tensor with the first (then both are one dim of the IR, as the DSL
        would write it: the token embedding's and the LM head's `vocab`)."""
        meets: dict[int, set[int]] = {}
        order: list[int] = []
        for atoms in tensors:
            roots = [self.find(a) for a in atoms]
            for root in roots:
                if root not in meets:
                    meets[root] = set()
                    order.append(root)
                meets[root].update(roots)
        taken: dict[str, list[int]] = {}
        out: dict[int, str] = {}
        for root in order:
            hint, prio = self.best_hint(root)
            base = _identifier(hint or "dim")
            same = taken.get(base, [])
            role = prio >= ROLE
            if share and role and same and all(self.size(r) == self.size(root) and root not in meets[r] for r in same):
                out[root] = base
                same.append(root)
                continue
            name, n = base, 2
            while name in taken:
                name, n = f"{base}_{n}", n + 1
            taken[name] = [root]
            out[root] = name
        return out


def _identifier(text: str) -> str:
    clean = "".join(c if c.isalnum() or c == "_" else "_" for c in text) or "dim"
    return clean if not clean[0].isdigit() else f"d{clean}"
