"""FlexAttention, captured as the attention it computes (torchtitan's default attention).

`flex_attention(q, k, v, block_mask=...)` reaches an exported graph as torch's
`flex_attention` higher-order op: q, k, v, a `score_mod` graph, the block mask (its block
tables and its `mask_mod` graph) and the buffers `mask_mod` reads (a document mask's ends
per token). Where `score_mod` is the identity and only the attention's output is read (not
its log-sum-exp), that is `scaled_dot_product_attention(q, k, v, attn_mask=M, scale=...)`
with M the `mask_mod` evaluated at every (batch, head, query, key) by torch's own
`create_mask`; the block tables only skip work. M is computed from the buffers `mask_mod`
reads, constants where the model builds them from positions, so the fx frontend folds it,
and a causal M becomes `is_causal=True` (`patterns.causal_mask`), the IR's attention, as does a
causal sliding window's band (its `window=W`: `attention_patterns.band_window`). SDPA
with any other mask runs replicated (an ATen op with no sharding rule, listed in the plan
with its line); a score_mod, or a read log-sum-exp, is refused at the call.

The capture and the float64 reference run the model under `flex_attention_on_cpu`: torch
refuses flex attention on CPU tensors that need gradients, and the reference computes with
torch's eager flex_attention op, which has a CPU backward and float64, in place of the
compiled kernels a library asks for.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx.aten_rewrites import call_like
from fivedc.frontends.fx.locs import node_loc


@contextlib.contextmanager
def flex_attention_on_cpu(*, eager: bool):
    """FlexAttention with gradients on CPU, where torch refuses it (its compiled kernels have no
    CPU backward and take no float64): the refusal lifted, and with `eager`, torch's eager
    flex_attention op, which has both, in place of the compiled kernels (`torch.compile`d
    callables of the model run as the Python they wrap): for the model's runs, the float64
    reference among them. Without `eager`, for torch.export (inside the former too): it
    captures flex_attention as one op, its mask's closures lifted as buffers, through torch's
    own compile of that op. The plan computes the attention with its own kernels."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:  # a torch without FlexAttention: nothing to change
        yield
        return
    changes = {"_validate_device": lambda *args, **kwargs: None, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG": eager}
    saved = {name: getattr(module, name) for name in changes if hasattr(module, name)}
    for name in saved:
        setattr(module, name, changes[name])
    try:
        with torch.compiler.set_stance("force_eager" if eager else "default"):
            yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


class DenseMask:
    """A flex block mask's `mask_mod` at every (batch, head, query, key): SDPA's boolean mask."""

    def __init__(self, mask_mod: fx.GraphModule, shape: tuple[int, int, int, int]) -> None:
        self.mask_mod, self.shape = mask_mod, shape
        self.__name__ = "flex_dense_mask"

    def __call__(self, *buffers: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_mask

        b, h, q, kv = self.shape
        device = buffers[0].device if buffers else "cpu"

        def mask_mod(batch, head, q_idx, kv_idx):  # four named arguments: create_mask counts them
            return self.mask_mod(batch, head, q_idx, kv_idx, *buffers)

        return create_mask(mask_mod, b, h, q, kv, device=device)


def flex_attention_as_sdpa(gm: fx.GraphModule) -> bool:
    """Replace each flex_attention op of `gm` (an exported graph) by SDPA with its dense mask;
    whether there was one (its block tables are then dead code: `drop_dead`)."""
    graph, rewritten = gm.graph, False
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    for node in list(graph.nodes):
        if flex is None or node.op != "call_function" or node.target is not flex:
            continue
        q, k, v, score_mod, block_mask, scale, _, score_buffers, mask_buffers = node.args[:9]
        where = node_loc(node)
        if not _identity(getattr(gm, score_mod.target)) or score_buffers:
            raise NotSupportedError("flex_attention with a score_mod: fivedc's attention adds no score terms",
                                    loc=where, hint="leave score_mod out (masks go in the block mask)")
        read = [u for u in node.users if u.users]
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in read):
            raise NotSupportedError("flex_attention's log-sum-exp or max scores are read: fivedc's attention "
                                    "returns its output only", loc=where)
        shape_q, shape_k = (tuple(int(size) for size in t.meta["val"].shape) for t in (q, k))
        dense = DenseMask(getattr(gm, block_mask[-1].target), (shape_q[0], shape_q[1], shape_q[2], shape_k[2]))
        with graph.inserting_before(node):
            mask = call_like(graph, node, dense, tuple(mask_buffers), None)
            sdpa = call_like(graph, node, torch.ops.aten.scaled_dot_product_attention.default, (q, k, v), None,
                             {"attn_mask": mask, "scale": float(scale), "enable_gqa": shape_q[1] != shape_k[1]})
        for user in list(node.users):
            if user.users:
                user.replace_all_uses_with(sdpa)
            graph.erase_node(user)
        graph.erase_node(node)
        rewritten = True
    return rewritten


def drop_dead(graph: fx.Graph) -> None:
    """Erase what computed only the block tables (vmapped ops, a write into a fresh tensor made
    pure by then, export's dtype checks on them): dead code, the checks included."""
    check = torch.ops.aten._assert_tensor_metadata.default
    graph.eliminate_dead_code(is_impure_node=lambda n: n.target is not check and n.is_impure())


def _identity(score_mod: fx.GraphModule) -> bool:
    """Whether a score_mod graph returns its first argument (the score) unchanged."""
    placeholders = [n for n in score_mod.graph.nodes if n.op == "placeholder"]
    output = next(n for n in score_mod.graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return bool(placeholders) and result is placeholders[0]
