"""Rewrites of the exported ATen graph into ops that say the same and have sharding rules.

- `stack_as_cat`: `aten.stack(tensors, dim)` is the `cat` of each tensor unsqueezed at
  `dim`, which is what it computes; the views and the cat have rules (the cat runs along
  the new dim, on shards of the others), so a stack in a rotary embedding (torchtune's)
  does not run replicated.
- `complex_products_as_real`: `view_as_real(view_as_complex(x) * c)`, x real with a
  last dim of 2 and c a complex tensor (torchtitan's rotary embedding: the pairs of
  head_dim as complex numbers, times a complex table), is the complex product written
  out on the real and imaginary parts, stacked back into the last dim:
  `stack((xr cr - xi ci, xr ci + xi cr), -1)` with `xr, xi = x[..., 0], x[..., 1]` and
  `cr, ci` the same of `view_as_real(c)`. fivedc's IR is real: with the product written
  out, only the table's own ops (computed from buffers) see complex values.
- `unbind_as_selects`: each result `i` of `aten.unbind(x, dim)` that is read is `select(x, dim,
  i)`, which is what it is; a select runs along `dim` on shards of the others, so q, k and v
  unbound from one fused projection viewed as `[batch, seq, 3, heads, head_dim]` keep the
  sequence and the heads (an unbind runs replicated, with dims of its own).
- `numpy_T_as_permute`: `x.T` (`aten.numpy_T`) is the permute that reverses x's dims;
  a permute is a view the frontend follows (`w.T` of a 2-D parameter under a matmul is
  a linear: Falcon's `input @ self.weight.T`).
- `constant_index_as_slice`: `x[..., [i, i+k, ...], ...]`, an `aten.index` by one constant
  list of evenly spaced, increasing positions (Falcon's fused QKV split by
  `fused[..., [-2], :]`), is the slice `x[..., i:j:k, ...]`: the same values, and a
  slice runs on shards where an index by a tensor runs replicated.
- `computed_norm_weights_apart`: `layer_norm(x, shape, w, b)` and `rms_norm(x, shape, w)` whose
  weight or bias is computed, not a parameter (Nemotron's `F.layer_norm(x, shape, self.weight
  + 1, self.bias)`), are the norm without them, times `w`, plus `b`: a norm without a weight
  runs along the dims it normalises and the product and sum are pointwise, all on shards,
  where the fused call with a computed weight would run replicated.
- `baddbmm_written_out`: `baddbmm(bias, a, b, beta=, alpha=)` is `beta * bias + alpha * (a @ b)`
  (BLOOM's ALiBi attention scores): the product a matmul of two activations and the rest
  pointwise, all on shards, where the fused call would run replicated.
- `constant_expand_as`: `c.expand_as(x)` with c computed from neither an input nor a parameter
  (torchtitan's positions, `arange(seq).expand_as(input_ids)`) is `c.expand(x's shape)`: the
  shape is fixed at capture, so what is computed from c (a flex attention mask's document
  ends) stays a constant the frontend folds, not a value of the inputs.

Each rewrite keeps the replaced node's user stack trace and module path on the new nodes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fivedc.frontends.fx.recognise import depends_on
from fivedc.ir.aten_call import bind

aten = torch.ops.aten


def stack_as_cat(graph: fx.Graph) -> None:
    def cat(node: fx.Node, value: torch.Tensor) -> fx.Node:
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % value.dim()
        parts = [call_like(graph, node, aten.unsqueeze.default, (t, dim), _val(t, lambda v: v.unsqueeze(dim)))
                 for t in node.args[0]]
        return call_like(graph, node, aten.cat.default, (parts, dim), value)

    _replace_calls(graph, aten.stack.default, cat)


def unbind_as_selects(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if not _is(node, aten.unbind.int) or not all(_is(u, operator.getitem) for u in node.users):
            continue
        x, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        for user in list(node.users):
            i = user.args[1]
            with graph.inserting_before(user):
                select = call_like(graph, user, aten.select.int, (x, dim, i), _val(x, lambda v: v.select(dim, i)))
            select.meta = {**user.meta, **select.meta}
            user.replace_all_uses_with(select)
            graph.erase_node(user)
        graph.erase_node(node)


def numpy_T_as_permute(graph: fx.Graph) -> None:  # noqa: N802 (the operator's name)
    def permute(node: fx.Node, value: torch.Tensor) -> fx.Node:
        return call_like(graph, node, aten.permute.default, (node.args[0], list(range(value.dim()))[::-1]), value)

    _replace_calls(graph, aten.numpy_T.default, permute)


def constant_index_as_slice(graph: fx.Graph, constants: dict[str, torch.Tensor]) -> None:
    """`constants`: the tensor constants the graph's placeholders stand for, by node name."""
    def slice_of(node: fx.Node, value: torch.Tensor) -> fx.Node | None:
        x, indices = node.args[0], node.args[1]
        tensors = [(dim, i) for dim, i in enumerate(indices) if i is not None]
        if len(tensors) != 1:
            return None
        dim, index = tensors[0]
        positions = _constant(index, constants)
        size = x.meta["val"].shape[dim] if isinstance(x.meta.get("val"), torch.Tensor) else None
        if positions is None or positions.dim() != 1 or not len(positions) or size is None:
            return None
        start, *rest = (int(p) % size for p in positions.tolist())
        step = rest[0] - start if rest else 1
        if step <= 0 or [start + step * k for k in range(len(positions))] != [start, *rest]:
            return None
        return call_like(graph, node, aten.slice.Tensor, (x, dim, start, start + step * (len(positions) - 1) + 1, step),
                     value)

    _replace_calls(graph, aten.index.Tensor, slice_of)


def computed_norm_weights_apart(graph: fx.Graph, parameters: set[str]) -> None:
    """`parameters`: the names of the placeholders that are the module's parameters."""
    def apart(node: fx.Node, value: torch.Tensor) -> fx.Node | None:
        bound = _bound(node)
        weight, bias = bound.get("weight"), bound.get("bias")
        if all(t is None or (isinstance(t, fx.Node) and t.op == "placeholder" and t.name in parameters)
               for t in (weight, bias)):
            return None
        plain = dict(bound, weight=None) | ({"bias": None} if "bias" in bound else {})
        out = call_like(graph, node, node.target, tuple(plain.values()), value)
        if weight is not None:
            out = call_like(graph, node, aten.mul.Tensor, (out, weight), value)
        if bias is not None:
            out = call_like(graph, node, aten.add.Tensor, (out, bias), value)
        return out

    for target in (aten.layer_norm.default, aten.rms_norm.default):
        _replace_calls(graph, target, apart)


def baddbmm_written_out(graph: fx.Graph) -> None:
    def written_out(node: fx.Node, value: torch.Tensor) -> fx.Node:
        bound = _bound(node)
        a, b, bias = bound["batch1"], bound["batch2"], bound["self"]
        product = call_like(graph, node, aten.bmm.default, (a, b), _val2(a, b, torch.bmm))
        if bound["alpha"] != 1:
            product = call_like(graph, node, aten.mul.Tensor, (product, bound["alpha"]), product.meta.get("val"))
        if bound["beta"] == 0:
            return product
        if bound["beta"] != 1:
            scaled = _val(bias, lambda v: v * bound["beta"])
            bias = call_like(graph, node, aten.mul.Tensor, (bias, bound["beta"]), scaled)
        return call_like(graph, node, aten.add.Tensor, (bias, product), value)

    _replace_calls(graph, aten.baddbmm.default, written_out)


def constant_expand_as(graph: fx.Graph, variable: set[str]) -> None:
    """`c.expand_as(x)` as `c.expand(x's shape)` where c reads none of the placeholders in
    `variable` (the inputs and parameters)."""
    def expand(node: fx.Node, value: torch.Tensor) -> fx.Node | None:
        if depends_on(node.args[0], lambda n: n.op == "placeholder" and n.name in variable):
            return None
        return call_like(graph, node, aten.expand.default, (node.args[0], [int(s) for s in value.shape]), value)

    _replace_calls(graph, aten.expand_as.default, expand)


def _bound(node: fx.Node) -> dict:
    """The call's arguments by name (defaults filled in), in the schema's order."""
    schema = node.target._schema
    bound = bind(schema, node.args, node.kwargs)
    return {a.name: bound[a.name] for a in schema.arguments}


def _constant(node, constants: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The integer tensor constant `node` reads (through export's copies of it), or None."""
    while _is(node, aten.lift_fresh_copy.default) or _is(node, aten.clone.default):
        node = node.args[0]
    value = constants.get(node.name) if isinstance(node, fx.Node) and node.op == "placeholder" else None
    return value if isinstance(value, torch.Tensor) and not value.is_floating_point() else None


def _replace_calls(graph: fx.Graph, target, build) -> None:
    """Each call of `target` whose value is a tensor replaced by the node `build(node, value)`
    inserts before it (where it gives one: None leaves the call)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not target:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        with graph.inserting_before(node):
            new = build(node, value)
        if new is None:
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def complex_products_as_real(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.view_as_real.default:
            continue
        product = node.args[0]
        if not isinstance(product, fx.Node) or product.target is not aten.mul.Tensor or len(product.users) != 1:
            continue
        for z, c in (product.args, product.args[::-1]):
            if _is(z, aten.view_as_complex.default) and isinstance(c, fx.Node) and _is_complex(c):
                _write_out(graph, node, z.args[0], c)
                break
    graph.eliminate_dead_code()


def _write_out(graph: fx.Graph, node: fx.Node, x: fx.Node, c: fx.Node) -> None:
    """Replace `node` (view_as_real of view_as_complex(x) * c) by the product on real parts."""
    with graph.inserting_before(node):
        table = call_like(graph, node, aten.view_as_real.default, (c,), _val(c, torch.view_as_real))

        def part(t, i):
            return call_like(graph, node, aten.select.int, (t, -1, i), _val(t, lambda v: v.select(-1, i)))

        def binary(target, fn, a, b):
            return call_like(graph, node, target, (a, b), _val2(a, b, fn))

        def mul(a, b):
            return binary(aten.mul.Tensor, torch.mul, a, b)

        xr, xi, cr, ci = part(x, 0), part(x, 1), part(table, 0), part(table, 1)
        real = binary(aten.sub.Tensor, torch.sub, mul(xr, cr), mul(xi, ci))
        imag = binary(aten.add.Tensor, torch.add, mul(xr, ci), mul(xi, cr))
        stacked = call_like(graph, node, aten.stack.default, ([real, imag], -1), node.meta.get("val"))
    node.replace_all_uses_with(stacked)
    graph.erase_node(node)


def call_like(graph: fx.Graph, like: fx.Node, target, args: tuple, val, kwargs: dict | None = None) -> fx.Node:
    """A call of `target` at the graph's insertion point, with `like`'s user stack trace and
    module path, and `val` (a fake tensor) as its example value where there is one."""
    new = graph.call_function(target, args, kwargs or {})
    new.meta = {k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")}
    if val is not None:
        new.meta["val"] = val
    return new


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _is_complex(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_complex()


def _val(node, fn):
    """The example value (a fake tensor) of `fn` on `node`'s, or None where it has none."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return fn(value) if isinstance(value, torch.Tensor) else None


def _val2(a, b, fn):
    va, vb = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (a, b))
    return fn(va, vb) if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) else None
