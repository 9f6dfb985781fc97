"""Which operators an `aten` op may name: an allow-list, since a plan file is untrusted input.

A plan is JSON anyone can edit or send, and an `aten` op's `target` is called by shape
inference (on meta tensors, during `fivedc check`) and by every rank's kernel. ATen
has operators that read files (`aten.from_file`), write them (`aten.save`), seed the
random generator or sleep; that an operator does not mutate its arguments says nothing
about what else it does. So a target must be one of the pure tensor operators the fx
frontend emits (`allowed`), checked where the frontend makes an `aten` op
(`fivedc/frontends/fx/generic.py` through `resolve`), where a plan is loaded
(`refuse_unlisted`, before anything is called) and where the op is called (`resolve`,
from shape inference and the kernel): compile and load agree.

The list (`ALLOWED_NAMES`, by ATen packet name; every overload of a listed packet that
is pure passes):

- the operators torch tags `pointwise` or `reduction` (elementwise math, comparisons,
  sums and norms: about 190 packets, none of them I/O);
- those the sharding rules name (`fivedc/ir/aten_layout.py`: scans, slices, joins,
  norms without weights, matmuls, the untagged pointwise ones);
- `REVIEWED`: what the frontend keeps replicated or as views for library models (views
  and reshapes, indexing and gathers, joins, masks built in the graph, fused attention,
  embeddings of computed indices, zeros/ones of a computed shape). Measured against
  the ops the examples and the library models emit (tests/test_untrusted_plans.py).

A library's own operator (`transformers.NAME.OVERLOAD`, registered with
`torch.library.custom_op` by a library the user's code imported) stays allowed as
before: it exists only in a process where the user imported that library, never in
`fivedc check` of a plan alone; torch's own namespaces are not a library's.
"""

from __future__ import annotations

import functools

from fivedc.ir.aten_layout import ALONG, MATMULS, UNTAGGED_POINTWISE, AtenCallError

REVIEWED = frozenset({
    # views, reshapes and copies
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "numpy_T", "unsqueeze", "squeeze",
    "flatten", "unflatten", "contiguous", "alias", "clone", "lift_fresh_copy", "expand_as", "view_as",
    "movedim", "diagonal", "unbind", "type_as", "to", "_to_copy", "broadcast_tensors", "broadcast_to",
    # joins, repeats, flips
    "stack", "hstack", "vstack", "repeat", "tile", "flip", "roll", "rot90",
    # indexing and gathers
    "index", "index_select", "gather", "take_along_dim", "embedding", "one_hot",
    "index_put", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill",
    "slice_scatter", "select_scatter", "diagonal_scatter", "masked_scatter", "bucketize", "searchsorted",
    "tril", "triu", "diag_embed", "diag", "block_diag",
    # masks, positions and constants built in the graph (of a shape the graph computes)
    "arange", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
    "new_full", "scalar_tensor", "linspace", "fill", "masked_fill", "tril_indices", "triu_indices",
    "empty", "empty_like", "new_empty", "empty_strided",
    # products and fused blocks the patterns do not read
    "addmm", "baddbmm", "addbmm", "einsum", "outer", "linear", "tensordot", "dot", "mv", "addmv",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math", "group_norm", "native_layer_norm", "_softmax_backward_data",
    "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss_nd", "log_softmax", "glu",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "soft_margin_loss", "cosine_similarity", "cosine_embedding_loss",
    "cumsum", "cummax", "cummin", "sort", "argsort", "topk", "kthvalue", "median", "mode",
    # counts (an MoE's tokens per expert: transformers' grouped experts)
    "histc", "bincount",
})
DENIED_FRAGMENTS = ("file", "save", "load", "seed", "print", "sleep", "_assert", "record", "profil", "storage")
TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "higher_order", "debug_mode_ops", "quantized", "_c10d_functional",
                              "c10d", "c10d_functional", "_dtensor", "profiler", "inductor", "mkldnn", "_quantized",
                              "fivedc"})


@functools.cache
def _tagged() -> frozenset[str]:
    """The ATen packets torch tags pointwise or reduction."""
    import torch

    out = set()
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        packet, _, overload = name.removeprefix("aten::").partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        tags = getattr(op, "tags", ())
        if torch.Tag.pointwise in tags or torch.Tag.reduction in tags:
            out.add(packet)
    return frozenset(out)


def allowed_names() -> frozenset[str]:
    """Every ATen packet an `aten` op may name (the module docstring: tagged, ruled, reviewed)."""
    names = _tagged() | ALONG | MATMULS | UNTAGGED_POINTWISE | REVIEWED
    return frozenset(n for n in names if not any(bad in n for bad in DENIED_FRAGMENTS)
                     and not (n.endswith("_") and not n.endswith("__")))  # add_, ...: in place


def check_allowed(target: str, overload=None) -> None:
    """Refuse an operator outside the allow-list (`overload`: the resolved object, for a library's)."""
    namespace, _, rest = target.partition(".")
    packet = rest.partition(".")[0]
    if namespace == "aten" and packet in allowed_names():
        return
    if namespace != "aten" and namespace not in TORCH_NAMESPACES and overload is not None and _library_op(overload):
        return
    raise AtenCallError(f"{target} is not on fivedc's allow-list of pure tensor operators",
                        hint="recompile the model with fivedc compile: a plan names only what its frontend emits")


def _library_op(overload) -> bool:
    """A custom operator a library outside torch registered with `torch.library.custom_op`."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"{overload.namespace}::{overload.overloadpacket.__name__}")
    module = getattr(getattr(opdef, "_init_fn", None), "__module__", "") or ""
    return opdef is not None and module != "torch" and not module.startswith("torch.")


def refuse_unlisted(graph, *, source: str = "<plan>") -> None:
    """Before anything is called: every `aten` op of a loaded plan names an allowed operator.
    Library operators are judged where they resolve (they exist only where imported)."""
    from fivedc.errors import PlanError
    from fivedc.ir.graph import Op, walk_ops

    for node, repeat in walk_ops(graph.body):
        if not isinstance(node, Op) or node.kind != "aten":
            continue
        target = str(node.attr("target", ""))
        if target.partition(".")[0] != "aten" and target.partition(".")[0] not in TORCH_NAMESPACES:
            continue
        try:
            check_allowed(target)
        except AtenCallError as error:
            where = f"{repeat.name}.*.{node.out}" if repeat else node.out
            raise PlanError(f"{source}: op {where} (at {node.loc or 'no location'}) names an operator "
                            f"fivedc does not call:\n  {error.message}", hint=error.hint) from None
