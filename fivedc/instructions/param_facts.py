"""What the proof's expander knows of the parameters (a part of `fivedc/instructions/comm_program.py`).

Which parameter instances an op reads (a layer's own, by its qualified name, or the top
level's), where each is first read, and their elements on this rank and in a ZeRO chunk,
each worked out once per parameter of the graph (a repeat's layers share it).
`ParamFacts` is a mixin of the expander: it reads its graph, mesh, sites, units, repeats,
params and caches.
"""

from __future__ import annotations

from fivedc.ir.graph import Op
from fivedc.passes.param_sync import zero_chunk
from fivedc.instructions.sites import Site


class ParamFacts:
    def first_uses(self) -> dict[str, int]:
        """Each parameter instance read by an op -> the index of the first site that reads it;
        a repeat's body worked out once for all its layers."""
        first: dict[str, int] = {}
        offsets: dict[str, list[tuple[int, str, bool]]] = {}  # per repeat: first reads in a layer
        for u, sites in self.unit_sites.items():  # in program order
            start, layer, repeat = self.index[id(sites[0])], self.units[u].layer, sites[0].repeat
            if layer is None or not self.shared:
                for i, site in enumerate(sites):
                    for name in self._param_args(site):
                        first.setdefault(name, start + i)
                continue
            if repeat not in offsets:
                seen: dict[str, tuple[int, str, bool]] = {}
                for j, site in enumerate(sites):
                    for name, own in self._param_refs(site):
                        seen.setdefault(name, (j, name, own))
                offsets[repeat] = list(seen.values())
            for j, name, own in offsets[repeat]:
                first.setdefault(f"{repeat}.{layer}.{name}" if own else name, start + j)
        return first

    def _param_args(self, site: Site) -> list[str]:
        return self._cached("params", site, self._params_read)

    def _params_read(self, site: Site) -> list[str]:
        """The qualified parameters an op reads, in argument order."""
        return [f"{site.repeat}.{site.layer}.{a}" if own else a for a, own in self._param_refs(site)]

    def _param_refs(self, site: Site) -> list[tuple[str, bool]]:
        """The parameters an op reads, in argument order, by name in its block, and whether
        each is its layer's own (of the repeat's body) or the top level's."""
        node = site.node
        if not isinstance(node, Op):
            return []
        body = self._param_names.get(site.repeat)
        if body is None:
            body = self._param_names[site.repeat] = {p.name for p in self.repeats[site.repeat].body.params} \
                if site.repeat else set()
        top = self._param_names.setdefault("", {p.name for p in self.graph.body.params})
        return [(a, a in body) for a in node.reads if a in body or a in top]

    def param_numel(self, name: str) -> int:
        """Elements of a parameter instance's local tensor (once per parameter of the graph: a
        repeat's layers share it)."""
        param = self.params[name]
        if id(param) not in self._numels:
            self._numels[id(param)] = self.graph.local_numel(param.dims, param.sharding, self.mesh)
        return self._numels[id(param)]

    def chunk_numel(self, name: str) -> int:
        """`zero_chunk` of a parameter instance (once per parameter of the graph)."""
        param = self.params[name]
        if (id(param), "zero") not in self._numels:
            self._numels[(id(param), "zero")] = zero_chunk(self.graph, self.mesh, param)
        return self._numels[(id(param), "zero")]
