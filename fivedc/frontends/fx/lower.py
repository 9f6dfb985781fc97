"""Lowering traced fx graphs to the draft IR (`fivedc/frontends/fx/build.py`): the walk and its values.

Every fx node becomes one of:
- `T`: a tensor: the IR value (or parameter) holding it, its dims in the IR's order
  and its torch *layout* (which atoms each torch dim is). Views, transposes and
  casts change the layout only; no IR op is emitted for them.
- `Pending`: a linear's output whose op is emitted at its first use, so that a
  fused projection followed by `split`/`chunk` becomes one linear per part.
- `ParamRef`: a parameter read with `get_attr`; the op that uses it decides its IR
  layout (a linear transposes it, an elementwise op takes it as it is).
- `Const`: a tensor that depends on neither inputs nor parameters (`arange`, a
  mask buffer); only the ops that understand one accept it.
- `RepeatedKV`: k or v repeated over heads for grouped-query attention.
- plain Python values (sizes, dtypes, numbers), read from the example run.

The values are defined in `fivedc/frontends/fx/values.py`; the handlers per op live in `fivedc/frontends/fx/ops.py`. Anything else
runs replicated as its ATen call (`fivedc/frontends/fx/generic.py`), with the reason at the user's line; what cannot
even be that is a `NotSupportedError` naming the op and the line: never a silent guess.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from fivedc.errors import FivedcError, NotSupportedError, PassError, SourceLoc
from fivedc.frontends.fx.build import DBlock, DOp, DParam, DRepeat, DValue, Draft, Source
from fivedc.frontends.fx.dims import DimMismatch, DimTable
from fivedc.frontends.fx.local_moves import repeated
from fivedc.frontends.fx.layers import materialize
from fivedc.frontends.fx.locs import def_loc, node_loc, scope
from fivedc.frontends.fx.ops import dispatch
from fivedc.frontends.fx.recognise import op_name
from fivedc.frontends.fx.trace import RepeatSpec, Trace
from fivedc.frontends.fx.values import (DYNAMIC, SIZE_ONE_HINT, Const, Frame, ParamRef, Pending,
                               RepeatedKV, RouterLogits, T, TransposedParam, Unrecognised)
from fivedc.frontends.fx.warning import FxWarning
from fivedc.ir.graph import DType


class Lowering:
    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.dims = DimTable()
        self.warned: list[str] = []
        self.repeats = {spec.calls[0]: spec for spec in trace.repeats}
        self.later = {n for spec in trace.repeats for n in spec.calls[1:]}
        self.ahead: dict[fx.Node, object] = {}  # nodes an earlier node's handler lowered with it (a loss's mean)
        self.seq_atom: int | None = None
        self.token_atoms: list[int] = []  # the inputs' batch and sequence dims
        self.owners: dict[int, tuple[str, str]] = {}  # id of a parameter tensor -> (key, role) of its first use
        self.inputs: list = []

    # ---- entry --------------------------------------------------------------------
    def draft(self, name: str) -> Draft:
        root = self.trace.top.root
        frame = Frame(self.trace.top, DBlock(), {}, {})
        loc = def_loc(type(root).forward)
        self.bind_inputs(frame, loc)
        loss = self.walk(frame)
        if isinstance(loss, (tuple, list, dict)):
            loss = self.pick_loss(loss, _output(frame))
        if not isinstance(loss, T) or self.dims.leaves(loss.ir) or loss.dtype != DType.FLOAT:
            raise NotSupportedError(
                f"{type(root).__name__}.forward must return the loss, one float scalar",
                loc=node_loc(_output(frame)) or loc, hint="return F.cross_entropy(...), not logits or a tuple",
            )
        frame.block.yields = [self.value_of(frame, loss, _output(frame))]
        return Draft(name, self.inputs, frame.block, self.dims, loc.file if loc else "", loc)

    def pick_loss(self, outputs, node: fx.Node):
        """Of several outputs (`return logits, loss`), the one float scalar: the loss."""
        items = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
        scalars = [x for x in items if isinstance(x, T) and not self.dims.leaves(x.ir) and x.dtype == DType.FLOAT]
        if len(scalars) != 1:
            return outputs
        self.warn(node, f"forward returns {len(items)} values; the plan computes only the loss, the one scalar")
        return scalars[0]

    def bind_inputs(self, frame: Frame, loc: SourceLoc | None) -> None:
        batch = None
        for node in frame.traced.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            name = str(node.target).lstrip("*")
            example = self.trace.inputs.get(name)
            if example is None:
                frame.syms[node] = frame.traced.values.get(node)
                continue
            dtype = DType.FLOAT if example.is_floating_point() else DType.INT
            atoms = tuple(self.dims.new(s, h, p) for s, (h, p) in zip(example.shape, _INPUT_HINTS))
            if not atoms:
                raise NotSupportedError(f"input {name} is a scalar; inputs start with the batch dim", loc=loc)
            self.token_atoms.extend(atoms[:2])
            if batch is None:
                batch, self.seq_atom = atoms[0], atoms[1] if len(atoms) > 1 else None
            else:
                self.unify((batch,), atoms[:1], node, f"input {name} must start with the batch dim")
            value = DValue(name, atoms, dtype)
            self.inputs.append((name, value, loc))
            frame.syms[node] = T(value, atoms, tuple((a,) for a in atoms), dtype)

    def walk(self, frame: Frame):
        for node in frame.traced.gm.graph.nodes:
            if node.op == "placeholder" or node in self.later:
                continue
            if node in self.ahead:
                frame.syms[node] = self.ahead.pop(node)
                continue
            if node.op == "output":
                return fx.node.map_arg(node.args[0], lambda n: frame.syms[n])
            if node in self.repeats and frame.traced is self.trace.top:
                frame.syms[self.repeats[node].calls[-1]] = self.repeat(frame, self.repeats[node], node)
                continue
            try:
                frame.syms[node] = dispatch(self, frame, node)
            except FivedcError:
                raise
            except Exception as error:  # a bug in the frontend: say where, keep the cause
                raise PassError(f"the fx frontend failed on node {node.name} ({type(error).__name__}: {error})",
                                loc=node_loc(node)) from error
        raise AssertionError("an fx graph always ends with its output node")

    def repeat(self, frame: Frame, spec: RepeatSpec, node: fx.Node) -> T:
        carried = self.tensor(frame, frame.syms[node.args[0]], node)
        arg = DValue("x", carried.ir, carried.dtype)
        inner = Frame(spec.body, DBlock(args=[arg]), {}, {})
        placeholders = [n for n in spec.body.gm.graph.nodes if n.op == "placeholder"]
        inner.syms[placeholders[0]] = T(arg, carried.ir, carried.layout, carried.dtype)
        outer_args = fx.node.map_arg((node.args[1:], node.kwargs), lambda n: frame.syms[n])
        for ph, value in zip(placeholders[1:], outer_args[0]):
            inner.syms[ph] = value
        for ph in placeholders[1:]:
            name = str(ph.target).lstrip("*")
            inner.syms.setdefault(ph, outer_args[1].get(name, spec.body.values.get(ph)))
        out = self.walk(inner)
        if not isinstance(out, DYNAMIC):
            raise NotSupportedError(f"layer {spec.path}.0 must return one tensor", loc=node_loc(node))
        out = self.tensor(inner, out, _output(inner))
        self.unify(_flat(out.layout), _flat(carried.layout), node, "a layer must return a tensor shaped like its input")
        if self.dims.leaves(out.ir) != self.dims.leaves(carried.ir):
            odd = set(self.dims.leaves(out.ir)) ^ set(self.dims.leaves(carried.ir))
            if odd and all(self.dims.size(a) == 1 for a in odd):
                raise NotSupportedError(
                    f"layer {spec.path}.0 returns a tensor whose size-1 dims ({self.describe(odd)}) are not its "
                    "input's: a dim of size 1 cannot be told apart from the others it is viewed with",
                    loc=node_loc(node), hint=SIZE_ONE_HINT)
            raise NotSupportedError(f"layer {spec.path}.0 returns its input's dims in another order", loc=node_loc(node))
        inner.block.yields = [self.value_of(inner, out, _output(inner))]
        name = "layers" if not any(isinstance(i, DRepeat) and i.name == "layers" for i in frame.block.items) else spec.path
        result = DValue("x", carried.ir, carried.dtype)
        start = self.value_of(frame, carried, node)
        frame.block.items.append(DRepeat(name.replace(".", "_"), spec.path, len(spec.calls), [start], inner.block,
                                         [result], node_loc(node)))
        return T(result, carried.ir, carried.layout, carried.dtype)

    # ---- helpers for the handlers ---------------------------------------------------
    def ir(self, t: T) -> tuple[int, ...]:
        return self.dims.leaves(t.ir)

    def groups(self, t: T) -> tuple[tuple[int, ...], ...]:
        return tuple(self.dims.leaves(g) for g in t.layout)

    def tokens(self) -> frozenset[int]:
        """The classes of the batch and sequence dims (a size-1 one stays with the other in a view)."""
        return frozenset(self.dims.find(a) for a in self.token_atoms)

    def describe(self, atoms) -> str:
        """Dims by their best name so far: `heads (size 1), batch (size 1)`."""
        return ", ".join(f"{self.dims.best_hint(a)[0] or 'a dim'} (size {self.dims.size(a)})" for a in atoms)

    def same(self, a: int, b: int) -> bool:
        return self.dims.find(a) == self.dims.find(b)

    def unify(self, g1, g2, node: fx.Node, what: str) -> None:
        try:
            self.dims.unify(tuple(g1), tuple(g2))
        except DimMismatch as error:  # no rule for this use: the op may still run replicated
            raise Unrecognised(f"{what}: {error}", loc=node_loc(node)) from None

    def emit(self, frame: Frame, node: fx.Node, kind: str, args: tuple, atoms: tuple[int, ...],
             attrs: tuple = (), base: str | None = None) -> DValue:
        out = DValue(base or node.name, atoms)
        frame.block.items.append(DOp(out, kind, args, attrs, node_loc(node), scope(node)))
        return out

    def param(self, frame: Frame, node: fx.Node, *, key: str, module: str, attr: str, atoms: tuple[int, ...],
              init: str, shape: tuple[int, ...], rows=None, transpose=False, part: str = "", role: str = "",
              stack: tuple[str, ...] = (), axis: int = 0) -> DParam:
        """The IR parameter of state-dict entry `key` (relative to the frame's module), or of the
        entries `stack` (each `shape`) stacked along its first dim; `rows` a range of its dim `axis`."""
        key = stack[0] if stack else key
        cache = (key, rows, role)
        if cache not in frame.params:
            for k in stack or (key,):
                self._claim(frame, node, k, role)
            source = Source(key, shape, rows, transpose, tuple(stack), axis)
            p = DParam(module, attr, part, atoms, init, source, node_loc(node))
            self.dims.keep_apart(atoms)  # one tensor: its dims stay distinct (a square weight)
            frame.params[cache] = p
            frame.block.params.append(p)
        return frame.params[cache]

    def _claim(self, frame: Frame, node: fx.Node, key: str, role: str) -> None:
        """A parameter tensor has one use and one layout in the IR: tied weights are refused."""
        tensor = frame.traced.root.get_parameter(key)
        first = self.owners.setdefault(id(tensor), (key, role))
        uses = {r for k, _, r in frame.params if k == key} | ({first[1]} if first[0] != key else set())
        if first[0] != key or uses - {role}:
            raise NotSupportedError(
                f"parameter {key} is used both as {uses.pop() or 'a tensor'} and as {role} "
                f"(tied weights{': the same tensor as ' + first[0] if first[0] != key else ''})",
                loc=node_loc(node), hint="untie the weights: the IR gives every parameter one use and one layout",
            )

    def tied_table(self, frame: Frame, key: str) -> DParam | None:
        """The embedding table a linear weight is the same tensor as (tied weights: the table
        [vocab, hidden] is the weight [out, in] of the output projection), if in this frame."""
        first = self.owners.get(id(frame.traced.root.get_parameter(key)))
        if first is None or first[1] != "an embedding table":
            return None
        return frame.params.get((first[0], None, first[1]))

    def tensor(self, frame: Frame, sym, node: fx.Node) -> T:
        """A value an ordinary op can take: emits a pending linear, lays out a parameter."""
        if isinstance(sym, T):
            return sym
        if isinstance(sym, Pending):
            return materialize(self, frame, sym)
        if isinstance(sym, ParamRef):
            # a parameter's size-1 dims are broadcast dims ([1, seq, hidden] added to [batch, seq, hidden]),
            # not model dims: the IR parameter leaves them out
            shape = tuple(sym.value.shape)
            keep = [s != 1 for s in shape] if any(s != 1 for s in shape) else [True] * len(shape)
            layout = tuple((self.dims.new(s),) if k else () for s, k in zip(shape, keep))
            atoms = _flat(layout)
            owner, _, attr = sym.key.rpartition(".")
            p = self.param(frame, node, key=sym.key, module=owner, attr=attr, atoms=atoms, init="normal",
                           shape=shape, role="a tensor")
            if p.atoms != atoms:  # read before: its dims are the ones it was given then
                given = iter(p.atoms)
                layout = tuple((next(given),) if group else () for group in layout)
                atoms = p.atoms
            return T(p, atoms, layout)
        if isinstance(sym, TransposedParam):
            t = self.tensor(frame, sym.ref, node)
            return T(t.ref, t.ir, t.layout[::-1], t.dtype)
        if isinstance(sym, RouterLogits):
            raise self.logits_used(sym, node)
        if isinstance(sym, RepeatedKV):  # attention written out by hand that no pattern recognised
            return repeated(self, frame, node, sym)
        if isinstance(sym, Const):
            raise self.unsupported(node, f"a constant tensor of shape {tuple(sym.value.shape)} used as data",
                                   "fivedc's IR has no constant tensors (buffers); compute it from the inputs")
        raise self.unsupported(node, f"a {type(sym).__name__} where a tensor is expected")

    def value_of(self, frame: Frame, t: T, node: fx.Node) -> DValue:
        """An IR value holding `t` (a parameter returned as it is gets an explicit copy)."""
        if isinstance(t.ref, DValue):
            return t.ref
        return self.emit(frame, node, "mul", (t.ref, 1.0), t.ir)

    def unsupported(self, node: fx.Node, what: str, hint: str = "") -> NotSupportedError:
        """No rule for this op or this use of it: the walk keeps it replicated where it can (`fx/generic.py`)."""
        return Unrecognised(f"not supported by the fx frontend: {what} (fx node {node.name})",
                            loc=node_loc(node), hint=hint)

    def logits_used(self, logits: RouterLogits, node: fx.Node) -> NotSupportedError:
        at = node_loc(logits.node)
        return NotSupportedError(
            f"the router logits that MoE block {logits.block} returns{f' (at {at})' if at else ''} are used here; "
            "fivedc's moe op routes inside and gives no logits out",
            loc=node_loc(node),
            hint="fivedc's moe adds the Switch load-balancing loss to the gradients itself: compute the loss without "
            f"the router logits (use only `out, _ = moe(x)`) and set `fivedc_aux_loss = 0.01` (your coefficient) on "
            f"{logits.cls}, as the DSL writes `moe(..., aux_loss=0.01)`",
        )

    def warn(self, node: fx.Node, message: str) -> None:
        loc = node_loc(node)
        text = f"{loc}: {message}" if loc else message
        self.warned.append(text)
        if loc:
            warnings.warn_explicit(message, FxWarning, loc.file, loc.line)
        else:
            warnings.warn(message, FxWarning, stacklevel=2)

    def op_name(self, frame: Frame, node: fx.Node) -> str | None:
        return op_name(node, frame.traced.gm)


_INPUT_HINTS = [("batch", 100), ("seq", 100), ("hidden", 10)] + [(None, 0)] * 16


def _output(frame: Frame) -> fx.Node:
    return next(n for n in reversed(frame.traced.gm.graph.nodes) if n.op == "output")


def _flat(layout) -> tuple[int, ...]:
    return tuple(a for g in layout for a in g)
