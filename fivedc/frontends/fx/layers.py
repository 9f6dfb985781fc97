"""Lowering handlers for the layer-sized ops: linear, embedding, norms, rope, the loss.

Attention is in `attention_lower.py`, MoE blocks in `moe_lower.py`.

Each handler takes the lowering, the frame, the fx node and its arguments (already
turned into `fivedc.frontends.fx.lower` values) and returns the node's value. Modules are
read from the traced graph (`nn.Linear` ...); the functional forms take parameters
read with `get_attr`. See `fivedc/frontends/fx/ops.py` for the table that routes ops here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fivedc.frontends.fx.build import DParam
from fivedc.frontends.fx.local_moves import in_memory_order, sliced_rows
from fivedc.frontends.fx.values import Const, Frame, ParamRef, Pending, T, TransposedParam

if TYPE_CHECKING:  # the walk that calls these handlers (it imports this module)
    from fivedc.frontends.fx.lower import Lowering
from fivedc.frontends.fx.recognise import rms_eps, rope_theta
from fivedc.ir.graph import DType


def arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _module(frame: Frame, node: fx.Node):
    return frame.traced.gm.get_submodule(node.target)


def _ref(lw: Lowering, node: fx.Node, value, what: str) -> ParamRef:
    if not isinstance(value, ParamRef):
        raise lw.unsupported(node, f"{what} that is computed, not a parameter")
    return value


def _shape(t) -> tuple[int, ...] | None:
    return tuple(t.shape) if t is not None else None


# ---- linear -------------------------------------------------------------------------------
def linear(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> Pending:
    if node.op == "call_module":
        m = _module(frame, node)
        bias = f"{node.target}.bias" if m.bias is not None else None
        keys, shapes, path = (f"{node.target}.weight", bias), (_shape(m.weight), _shape(m.bias)), node.target
    else:
        w = _ref(lw, node, arg(args, kwargs, 1, "weight"), "a linear weight")
        b = arg(args, kwargs, 2, "bias")
        b = _ref(lw, node, b, "a linear bias") if b is not None else None
        keys, shapes = (w.key, b.key if b else None), (_shape(w.value), _shape(b.value) if b else None)
        path = w.key.rpartition(".")[0]
    x = lw.tensor(frame, args[0], node)
    return Pending(x, path, keys[0], keys[1], shapes, (0, shapes[0][0]), "", node)


def materialize(lw: Lowering, frame: Frame, p: Pending) -> T:
    if p.done is not None:
        return p.done
    x, node = p.x, p.node
    gx = lw.groups(x)[-1]
    if gx and lw.ir(x)[-len(gx):] != gx:  # a transposed view: moved into memory order first
        x = in_memory_order(lw, frame, node, x)
    gx, ir = lw.groups(x)[-1], lw.ir(x)
    if not gx:
        raise lw.unsupported(node, "a linear over a dim of size 1")
    tied = lw.tied_table(frame, p.weight) if p.rows == (0, p.shapes[0][0]) else None
    if tied is not None:
        return _tied_linear(lw, frame, p, tied)
    n = p.rows[1] - p.rows[0]
    leaf = p.module.rpartition(".")[2] or "linear"
    out_dim = lw.dims.new(n, f"{leaf}_{p.part}" if p.part else leaf, 1)
    for atom in gx:
        lw.dims.hint(atom, "ffn", 30)
    rows = None if p.rows == (0, p.shapes[0][0]) else p.rows
    w = lw.param(frame, node, key=p.weight, module=p.module, attr="weight", atoms=gx + (out_dim,), init="normal",
                 shape=p.shapes[0], rows=rows, transpose=True, part=p.part, role="a linear weight")
    atoms = ir[: -len(gx)] + (out_dim,)
    base = f"{node.name}_{p.part}" if p.part else node.name
    out = lw.emit(frame, node, "linear", (x.ref, w), atoms, base=base)
    if p.bias is not None:
        b = lw.param(frame, node, key=p.bias, module=p.module, attr="bias", atoms=(out_dim,), init="zeros",
                     shape=p.shapes[1], rows=rows, part=p.part, role="a bias")
        out = lw.emit(frame, node, "add", (out, b), atoms, base=base)
    p.done = T(out, atoms, x.layout[:-1] + ((out_dim,),))
    return p.done


def split(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs):
    """`split`/`chunk` of a fused projection's output along its last dim: one linear per part."""
    x, kind = args[0], lw.op_name(frame, node)
    if not isinstance(x, Pending) or x.done is not None:
        raise lw.unsupported(node, f"{kind} of an activation",
                             "only the output of a fused projection (qkv) can be split, right after the linear")
    ndim = len(x.x.layout)
    dim = arg(args, kwargs, 2, "dim", 0)
    if dim % ndim != ndim - 1:
        raise lw.unsupported(node, f"{kind} of a projection along dim {dim}, not its output dim")
    total = x.rows[1] - x.rows[0]
    if kind == "chunk":
        step = -(-total // args[1])
        sizes = [min(step, total - s) for s in range(0, total, step)]
    else:
        size = arg(args, kwargs, 1, "split_size_or_sections")
        sizes = list(size) if isinstance(size, (list, tuple)) else [min(size, total - s) for s in range(0, total, size)]
    labels = ("q", "k", "v") if len(sizes) == 3 and not x.part else tuple(str(i) for i in range(len(sizes)))
    parts, start = [], x.rows[0]
    for label, size in zip(labels, sizes):
        part = f"{x.part}_{label}" if x.part else label
        parts.append(Pending(x.x, x.module, x.weight, x.bias, x.shapes, (start, start + size), part, x.node))
        start += size
    return tuple(parts)


def _tied_linear(lw: Lowering, frame: Frame, p: Pending, table: DParam) -> T:
    """The output projection whose weight is the embedding table (tied weights): one IR
    parameter [vocab, hidden] that both use, the linear taking it as stored ([out, in]);
    its gradient sums both uses."""
    x, node = p.x, p.node
    gx, ir = lw.groups(x)[-1], lw.ir(x)
    vocab, hidden = table.atoms
    lw.unify(gx, (hidden,), node, "a projection tied to the embedding table contracts its hidden dim")
    atoms = ir[: -len(gx)] + (vocab,)
    out = lw.emit(frame, node, "linear", (x.ref, table), atoms)
    if p.bias is not None:
        b = lw.param(frame, node, key=p.bias, module=p.module, attr="bias", atoms=(vocab,), init="zeros",
                     shape=p.shapes[1], role="a bias")
        out = lw.emit(frame, node, "add", (out, b), atoms)
    p.done = T(out, atoms, x.layout[:-1] + ((vocab,),))
    return p.done


def matmul(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T | Pending:
    a, b = args[0], args[1]
    if isinstance(b, TransposedParam):  # x @ w.T: F.linear(x, w)
        return linear(lw, frame, node, (a, b.ref), {})
    if not isinstance(b, ParamRef) or b.value.dim() != 2:
        raise lw.unsupported(node, "matmul of two activations",
                             "it is understood only inside attention: softmax(q @ k.transpose(-2, -1) / sqrt(d)) @ v")
    x = lw.tensor(frame, a, node)
    gx, ir = lw.groups(x)[-1], lw.ir(x)
    if gx and ir[-len(gx):] != gx:  # a transposed view: moved into memory order first
        x = in_memory_order(lw, frame, node, x)
        gx, ir = lw.groups(x)[-1], lw.ir(x)
    if not gx:
        raise lw.unsupported(node, "a matmul over a dim of size 1")
    out_dim = lw.dims.new(b.value.shape[1], b.key.rpartition(".")[2], 1)
    w = lw.param(frame, node, key=b.key, module=b.key.rpartition(".")[0], attr=b.key.rpartition(".")[2],
                 atoms=gx + (out_dim,), init="normal", shape=_shape(b.value), role="a matmul weight")
    atoms = ir[: -len(gx)] + (out_dim,)
    return T(lw.emit(frame, node, "matmul", (x.ref, w), atoms), atoms, x.layout[:-1] + ((out_dim,),))


def addmm(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    """`torch.addmm(bias, x, w)` with parameters `bias` and `w`: x @ w + bias (GPT-2's Conv1D)."""
    bias = args[0]
    if arg(args, kwargs, 3, "beta", 1) != 1 or arg(args, kwargs, 4, "alpha", 1) != 1 \
            or not isinstance(bias, ParamRef) or bias.value.dim() != 1:
        raise lw.unsupported(node, "addmm other than bias + x @ w with parameters bias and w")
    out = matmul(lw, frame, node, args[1:3], {})
    module, _, attr = bias.key.rpartition(".")
    b = lw.param(frame, node, key=bias.key, module=module, attr=attr, atoms=out.ir[-1:], init="zeros",
                 shape=_shape(bias.value), role="a bias")
    return T(lw.emit(frame, node, "add", (out.ref, b), out.ir), out.ir, out.layout)


# ---- embedding ----------------------------------------------------------------------------
def embedding(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    if node.op == "call_module":
        m = _module(frame, node)
        key, table, extra = f"{node.target}.weight", m.weight, (m.padding_idx, m.max_norm)
    else:
        ref = _ref(lw, node, arg(args, kwargs, 1, "weight"), "an embedding table")
        key, table, extra = ref.key, ref.value, (arg(args, kwargs, 2, "padding_idx"), arg(args, kwargs, 3, "max_norm"))
    padding, max_norm = extra
    if max_norm is not None:
        raise lw.unsupported(node, "embedding with max_norm", "fivedc's embedding is a lookup (padding_idx is fine)")
    rows, cols = table.shape
    attrs = (("padding_idx", int(padding) % rows),) if padding is not None else ()
    hidden = lw.dims.new(cols, "hidden", 80)
    lw.dims.keep_whole(hidden)  # the IR's table is [vocab, hidden]: a later split of it runs as ATen
    module, attr = key.rpartition(".")[0], key.rpartition(".")[2]
    if isinstance(args[0], Const):
        return _positions(lw, frame, node, args[0].value, key, table, hidden)
    tokens = lw.tensor(frame, args[0], node)
    if tokens.dtype != DType.INT:
        raise lw.unsupported(node, "embedding of float values")
    vocab = lw.dims.new(rows, "vocab", 90)
    w = lw.param(frame, node, key=key, module=module, attr=attr, atoms=(vocab, hidden), init="normal",
                 shape=_shape(table), role="an embedding table")
    atoms = lw.ir(tokens) + (hidden,)
    return T(lw.emit(frame, node, "embedding", (tokens.ref, w), atoms, attrs), atoms, tokens.layout + ((hidden,),))


def _positions(lw: Lowering, frame: Frame, node, value: torch.Tensor, key: str, table, hidden: int) -> T:
    """A position table read at constant positions start..start+seq-1: arange(seq), also [1, seq]
    as Hugging Face's position ids, or OPT's offset of 2. The table itself as a [seq, hidden]
    parameter, or, when it has other rows, those (an `aten.slice` of the [positions, hidden]
    parameter along its rows). Positions repeated over leading dims (OPT's, the same row for
    every sequence of the batch) are read once and broadcast, where every use of the result
    adds or multiplies it to a tensor of its whole shape (`_broadcast_uses`)."""
    seq, lead = lw.seq_atom, value.dim() - 1
    n = value.shape[-1] if value.dim() >= 1 else 0
    rows_of = value.reshape(-1, n).cpu() if n else None
    start = int(rows_of[0, 0]) if n else -1
    positions = torch.arange(start, start + n) if n else None
    if not n or start < 0 or start + n > table.shape[0] or seq is None or lw.dims.size(seq) != n \
            or not torch.equal(rows_of, positions.expand_as(rows_of)) \
            or (len(rows_of) > 1 and not _broadcast_uses(frame, node)):
        raise lw.unsupported(node, "an embedding of constant indices other than positions start..start+seq "
                                   "(the same in every row, added to a tensor of the whole shape)")
    layout = ((),) * lead + ((seq,), (hidden,))
    rows = seq if table.shape[0] == n else lw.dims.new(table.shape[0], "positions", 60)
    w = lw.param(frame, node, key=key, module=key.rpartition(".")[0], attr=key.rpartition(".")[2],
                 atoms=(rows, hidden), init="normal", shape=_shape(table), role="a position table")
    if rows == seq:
        return T(w, (seq, hidden), layout)
    first = sliced_rows(lw, frame, node, T(w, (rows, hidden), ((rows,), (hidden,))), seq, n, start)
    return T(first.ref, first.ir, layout)


_CASTS = ("to", "type", "float", "double", "half", "bfloat16")
_BROADCASTING = (torch.add, torch.mul, torch.sub, operator.add, operator.mul, operator.sub)


def _broadcast_uses(frame: Frame, node: fx.Node) -> bool:
    """Whether every use of `node` (through dtype casts) adds it to, multiplies it with or subtracts
    it from one other tensor of its own shape: where it is read as a broadcast of its first row."""
    shape = tuple(frame.traced.values[node].shape)
    for user in node.users:
        if user.op == "call_method" and user.target in _CASTS:
            if not _broadcast_uses(frame, user):
                return False
            continue
        others = [a for a in (*user.args, *user.kwargs.values()) if isinstance(a, fx.Node) and a is not node]
        if user.target not in _BROADCASTING or len(others) != 1 \
                or tuple(getattr(frame.traced.values[others[0]], "shape", ())) != shape:
            return False
    return True


# ---- norms and rope -------------------------------------------------------------------------
def _last(lw: Lowering, node: fx.Node, x: T, what: str) -> int:
    g, ir = lw.groups(x)[-1], lw.ir(x)
    if len(g) != 1 or ir[-1] != g[0]:
        raise lw.unsupported(node, f"{what} over a dim that is not the tensor's last")
    return g[0]


def _norm_param(lw: Lowering, frame: Frame, node: fx.Node, key: str, value, atom: int, init: str, role: str):
    return lw.param(frame, node, key=key, module=key.rpartition(".")[0], attr=key.rpartition(".")[2], atoms=(atom,),
                    init=init, shape=_shape(value), role=role)


def layer_norm(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    if node.op == "call_module":
        m = _module(frame, node)
        shape, eps = tuple(m.normalized_shape), m.eps
        w = (f"{node.target}.weight", m.weight) if m.weight is not None else None
        b = (f"{node.target}.bias", m.bias) if getattr(m, "bias", None) is not None else None
    else:
        shape, eps = tuple(arg(args, kwargs, 1, "normalized_shape")), arg(args, kwargs, 4, "eps", 1e-5)
        refs = [arg(args, kwargs, i, n) for i, n in ((2, "weight"), (3, "bias"))]
        w, b = ((_ref(lw, node, r, "a norm parameter").key, r.value) if r is not None else None for r in refs)
    x = lw.tensor(frame, args[0], node)
    atom = _last(lw, node, x, "layer norm")
    if len(shape) != 1 or w is None:
        raise lw.unsupported(node, "layer norm over several dims or without a weight")
    params = [_norm_param(lw, frame, node, *w, atom, "ones", "a norm weight")]
    if b is not None:
        params.append(_norm_param(lw, frame, node, *b, atom, "zeros", "a bias"))
    out = lw.emit(frame, node, "layernorm", (x.ref, *params), lw.ir(x), (("eps", float(eps)),))
    return T(out, x.ir, x.layout)


def rms_norm(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    """An RMSNorm module, `F.rms_norm(x, shape, weight, eps)` or the pattern's `rms_norm(x, weight, eps=)`."""
    x = lw.tensor(frame, args[0], node)
    if node.op == "call_module":
        m = _module(frame, node)
        name, value = next(iter(m.named_parameters()))
        key, eps = f"{node.target}.{name}", rms_eps(m)
    else:
        at = 2 if node.target is F.rms_norm else 1
        ref = _ref(lw, node, arg(args, kwargs, at, "weight"), "an RMSNorm weight")
        key, value, eps = ref.key, ref.value, arg(args, kwargs, at + 1, "eps")
        eps = eps if eps is not None else torch.finfo(frame.traced.values[node.args[0]].dtype).eps
    atom = _last(lw, node, x, "RMS norm")
    w = _norm_param(lw, frame, node, key, value, atom, "ones", "a norm weight")
    return T(lw.emit(frame, node, "rmsnorm", (x.ref, w), lw.ir(x), (("eps", float(eps)),)), x.ir, x.layout)


def rope(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    """A rotary module called on the tensor it rotates, or the pattern's marker
    `rope(x, theta=, seq_axis=)` (its tables already checked by value)."""
    if node.op == "call_function":
        x = lw.tensor(frame, args[0], node)
        _last(lw, node, x, "rope")
        axis = kwargs.get("seq_axis")
        if lw.seq_atom is None or axis is None:
            raise lw.unsupported(node, "a rotary embedding in a model without a sequence dim")
        # the tables vary along this axis at positions 0..seq-1: it is the sequence
        lw.unify(lw.groups(x)[axis], (lw.seq_atom,), node, "a rotary embedding's positions run along the sequence")
        attrs = (("theta", float(kwargs["theta"])),) + ((("freqs", kwargs["freqs"]),) if kwargs.get("freqs") else ())
        return T(lw.emit(frame, node, "rope", (x.ref,), lw.ir(x), attrs), x.ir, x.layout)
    m = _module(frame, node)
    if len(args) != 1 or kwargs:
        raise lw.unsupported(node, f"rotary module {type(m).__name__} called with more than the tensor to rotate",
                             "call it as rope(x) with x [batch, seq, heads, head_dim]; it keeps its own tables")
    x = lw.tensor(frame, args[0], node)
    groups = lw.groups(x)
    seq = [i for i, g in enumerate(groups) if len(g) == 1 and lw.seq_atom is not None and lw.same(g[0], lw.seq_atom)]
    _last(lw, node, x, "rope")
    theta = rope_theta(m, frame.traced.values[node.args[0]], seq[0]) if seq else None
    if theta is None:
        raise lw.unsupported(
            node, f"rotary module {type(m).__name__}: it does not compute fivedc's rope on a probe",
            "fivedc's rope rotates the two halves of head_dim (x1*cos - x2*sin, x2*cos + x1*sin) at positions "
            "0..seq-1 with frequencies theta**(-i/half); the interleaved (complex) form is not supported",
        )
    return T(lw.emit(frame, node, "rope", (x.ref,), lw.ir(x), (("theta", float(theta)),)), x.ir, x.layout)
