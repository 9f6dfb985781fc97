"""Losses as torch accepts them, by value: cross-entropy over class dim 1, with extra dims and ignore_index.

`F.cross_entropy(logits, targets)` takes logits `[N, C]` or `[N, C, d1, ...]` (the class dim
second, as x-transformers' `rearrange(logits, 'b n c -> b c n')` writes it) and targets
`[N, d1, ...]`; `ignore_index` leaves targets out of the mean. Each form is the IR's one
`cross_entropy` op over the vocabulary (the transpose is a layout, not an op), vocab-parallel
under tp, and trains like the module in float64 at dp2·tp2. x-transformers' own wrapper, whose
loss is written out (`torch_einops_utils.cross_entropy`: a one-hot mask, gather, logsumexp),
compiles and verifies at dp2·tp2 and cp2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Op, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.ops import freqs_text
from fivedc.parallel.check import check_module
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph

pytestmark = pytest.mark.filterwarnings("ignore:size_average and reduce args")  # the legacy form's own (torch's)
HERE = str(Path(__file__).resolve())
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
VOCAB, BATCH, SEQ, IGNORE = 16, 4, 8, 3


class ClassDimLoss(nn.Module):
    """Logits over a vocabulary, the loss taken with the class dim second: `[b, V, n]`, or with the
    sequence cut in two extra dims `[b, V, 2, n/2]` (`extra`)."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.extra = extra
        self.emb = nn.Embedding(VOCAB, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)  # an MLP: column then row over tp
        self.out = nn.Linear(8, VOCAB)  # the head: the vocabulary split over tp

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        logits = self.out(x + self.down(torch.tanh(self.up(x))))  # [b, n, V]
        if self.extra:
            b, n = ids.shape
            logits = logits.reshape(b, 2, n // 2, VOCAB).permute(0, 3, 1, 2)
            targets = targets.reshape(b, 2, n // 2)
        else:
            logits = logits.transpose(1, 2)
        return F.cross_entropy(logits, targets, ignore_index=IGNORE)


def make_model(*, extra: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE  # the last position has no next token; others equal IGNORE by chance
    return ClassDimLoss(extra).double(), (ids, targets)


@pytest.mark.parametrize("extra", [False, True])
def test_a_class_dim_loss_is_the_irs_vocab_parallel_cross_entropy(extra: bool) -> None:
    module, inputs = make_model(extra=extra)
    graph = trace_module(module, inputs).graph
    ops = [op for op, _ in walk_ops(graph.body) if isinstance(op, Op)]
    (loss,) = [op for op in ops if op.kind == "cross_entropy"]
    assert loss.attr("ignore_index") == IGNORE and not [op for op in ops if op.kind == "aten"]
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), dtype="fp64"))
    (planned,) = [op for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) and op.kind == "cross_entropy"]
    assert MeshAxis.TP in planned.arg_sharding(0).axes_of("vocab")  # vocab-parallel: the logits stay split


@pytest.mark.parametrize("extra", [False, True])
def test_a_class_dim_loss_trains_like_the_module(worker_pool, extra: bool) -> None:
    report = check_module(f"{HERE}:make_model", kwargs={"extra": extra}, mesh="2x1x2x1x1", steps=2, dtype="fp64",
                          pool=worker_pool)
    assert report.max_error <= 1e-10, report


class WrittenOutLoss(nn.Module):
    """x-transformers' patterns without the library: `forward(x, **kwargs)`, a ModuleList with an
    empty place, a softmax asked for in float32 and cast back (`.type(dtype)`), and the loss written out
    over the class dim as torch_einops_utils does (a one-hot mask of `arange(C) == target`)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.norms = nn.ModuleList([nn.LayerNorm(8), None, nn.LayerNorm(8)])
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        inp, target = x[:, :-1], x[:, 1:]
        h = self.norms[0](self.emb(torch.where(inp == IGNORE, 0, inp)))
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        attn = F.softmax(torch.einsum("bid,bjd->bij", q, k), dim=-1, dtype=torch.float32).type(h.dtype)
        logits = self.out(self.norms[2](h + torch.einsum("bij,bjd->bid", attn, v)))
        z, valid = logits.transpose(1, 2).movedim(1, -1), target != IGNORE
        t = torch.where(valid, target, 0)[..., None]
        is_target = torch.arange(z.shape[-1]) == t
        m = -torch.logsumexp(torch.where(is_target, -float("inf"), z - z.gather(-1, t)), dim=-1)
        return torch.where(valid, F.softplus(-m), 0.).sum() / valid.sum()


def test_a_written_out_loss_over_the_class_dim_computes_the_modules_loss() -> None:
    from fivedc.frontends.fx.precision import float64_everywhere
    from test_frontend_fx import assert_same_as_module

    torch.manual_seed(0)
    module, x = WrittenOutLoss().double(), torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    x[0, -2:] = IGNORE
    traced = trace_module(module, (x,))
    with float64_everywhere():  # the module's float32 softmax read as float64, as a float64 check reads it
        assert_same_as_module(traced, module, (x,))


@pytest.mark.parametrize("mesh", ["2x1x2x1x1", "1x1x1x2x1"])
def test_x_transformers_autoregressive_wrapper_trains_like_the_module(worker_pool, mesh: str) -> None:
    """The library's README model at its defaults: its loss over the class dim is written out
    (a one-hot mask `arange(C) == target`, gather, logsumexp, `where(valid, ..., 0)`), its
    attention softmax asks for float32; it compiles (no refusal) and trains as the module does."""
    pytest.importorskip("x_transformers")
    report = check_module(f"{EXAMPLES / 'x_transformers_models.py'}:autoregressive", mesh=mesh, steps=2,
                          dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]


SMOOTH = 0.2
FORMS = {  # each form of the loss as a user writes it: (how the IR op reads it, the loss of module m)
    "sum": ({"reduction": "sum"}, lambda m, z, t: F.cross_entropy(z, t, reduction="sum")),
    "sum_ignoring": ({"reduction": "sum", "ignore_index": IGNORE},
                     lambda m, z, t: F.cross_entropy(z, t, ignore_index=IGNORE, reduction="sum")),
    "smoothed": ({"label_smoothing": SMOOTH}, lambda m, z, t: F.cross_entropy(z, t, label_smoothing=SMOOTH)),
    "smoothed_ignoring": ({"label_smoothing": SMOOTH, "ignore_index": IGNORE},
                          lambda m, z, t: F.cross_entropy(z, t, ignore_index=IGNORE, label_smoothing=SMOOTH)),
    "smoothed_sum": ({"label_smoothing": SMOOTH, "reduction": "sum", "ignore_index": IGNORE},
                     lambda m, z, t: nn.CrossEntropyLoss(ignore_index=IGNORE, reduction="sum",
                                                         label_smoothing=SMOOTH)(z, t)),
    "none_sum": ({"reduction": "sum", "ignore_index": IGNORE},
                 lambda m, z, t: F.cross_entropy(z, t, ignore_index=IGNORE, reduction="none").sum()),
    "none_mean": ({"reduction": "sum", "ignore_index": IGNORE},  # the mean of all tokens: a sum, divided
                  lambda m, z, t: F.cross_entropy(z, t, ignore_index=IGNORE, reduction="none").mean()),
    "none_torch_sum": ({"reduction": "sum"}, lambda m, z, t: torch.sum(F.cross_entropy(z, t, reduction="none"))),
    "none_torch_mean_keywords": ({"reduction": "sum"}, lambda m, z, t: torch.mean(
        F.cross_entropy(input=z, target=t, reduction="none"))),
    "legacy_size_average": ({"reduction": "sum"}, lambda m, z, t: F.cross_entropy(z, t, size_average=False)),
    "weighted": ({"ignore_index": IGNORE, "weight": True},
                 lambda m, z, t: F.cross_entropy(z, t, weight=m.class_weight, ignore_index=IGNORE)),
    "weighted_sum": ({"reduction": "sum", "weight": True},
                     lambda m, z, t: F.cross_entropy(z, t, m.class_weight, reduction="sum")),
    "weighted_none_mean": ({"reduction": "sum", "weight": True},
                           lambda m, z, t: F.cross_entropy(z, t, m.class_weight, reduction="none").mean()),
    "weighted_smoothed_module": ({"ignore_index": IGNORE, "label_smoothing": SMOOTH, "weight": True},
                                 lambda m, z, t: m.criterion(z, t)),
}


class LossForm(ClassDimLoss):
    """ClassDimLoss's model with the loss in one of torch's forms (FORMS), over logits `[b, n, V]`;
    class weights are a buffer (and nn.CrossEntropyLoss's own, in `criterion`)."""

    def __init__(self, form: str) -> None:
        super().__init__(extra=False)
        self.form = form
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, VOCAB))
        self.criterion = nn.CrossEntropyLoss(weight=self.class_weight.clone(), ignore_index=IGNORE,
                                             label_smoothing=SMOOTH)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        logits = self.out(x + self.down(torch.tanh(self.up(x))))
        return FORMS[self.form][1](self, logits.flatten(0, 1), targets.flatten())


def make_form(*, form: str, seed: int = 0):
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = FORMS[form][0].get("ignore_index", -100)  # torch's default ignores -100 too
    return LossForm(form).double(), (ids, targets)


def weighted_smoothed(*, seed: int = 0):
    """nn.CrossEntropyLoss with class weights, label smoothing and ignore_index (tests/test_agreement.py)."""
    return make_form(form="weighted_smoothed_module", seed=seed)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_of_the_loss_is_the_irs_cross_entropy_with_its_attrs(form: str) -> None:
    module, inputs = make_form(form=form)
    ops = [op for op, _ in walk_ops(trace_module(module, inputs).graph.body) if isinstance(op, Op)]
    (loss,) = [op for op in ops if op.kind == "cross_entropy"]
    assert not [op for op in ops if op.kind == "aten"]
    want = {"reduction": "mean", "label_smoothing": 0.0, "ignore_index": -100, "weight": ""} | FORMS[form][0]
    if want["weight"]:
        want["weight"] = freqs_text(module.class_weight.tolist())  # by value, every class's
    assert {k: loss.attr(k, v) for k, v in want.items()} == want
    assert [op.kind for op in ops[ops.index(loss) + 1:]] == (["div"] if "mean" in form and "none" in form else [])


PIPELINE = {"schedule": "1f1b", "microbatches": 2, "stage_boundaries": ("down",)}


@pytest.mark.parametrize("mesh, options", [("1x1x1x1x1", {}), ("2x1x2x1x1", {}), ("1x1x1x2x1", {}),
                                           ("2x2x1x1x1", PIPELINE)])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_of_the_loss_trains_like_the_module(worker_pool, form: str, mesh: str, options: dict) -> None:
    """One rank, dp2·tp2 (vocab-parallel: smoothing's mean over the classes summed over the tp shards),
    cp2 and dp2·pp2 (the count, or the class weights' sum, taken for the step before its microbatches): a
    sum is the sum over the token shards, a mean divides by the whole batch's count."""
    report = check_module(f"{HERE}:make_form", kwargs={"form": form}, mesh=mesh, steps=2, dtype="fp64",
                          pool=worker_pool, **options)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]


class ItemsInBatch(nn.Module):
    """A Hugging Face model as its Trainer calls it under gradient accumulation: `num_items_in_batch`
    given, so `ForCausalLMLoss` takes `cross_entropy(..., ignore_index=-100, reduction="sum")` and
    divides by that number (the labels' count over the whole step, not this batch's mean)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items_in_batch,
                          use_cache=False).loss


def hf_items_in_batch(*, seed: int = 0):
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_models", EXAMPLES / "hf_models.py")
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    model, (ids, labels) = hf.build("llama", seed=seed)
    labels[:, :2] = -100  # a prompt left out of the loss
    # the Trainer counts the labels of the whole step: here as if this batch were one of 3 accumulated
    return ItemsInBatch(model.model), (ids, labels, 3 * int((labels[:, 1:] != -100).sum()))


def test_hf_loss_with_num_items_in_batch_is_a_sum_divided_by_that_number() -> None:
    pytest.importorskip("transformers")
    module, inputs = hf_items_in_batch()
    ops = [op for op, _ in walk_ops(trace_module(module, inputs).graph.body) if isinstance(op, Op)]
    assert [(op.kind, op.attrs) for op in ops[-2:]] == [
        ("cross_entropy", (("ignore_index", -100), ("reduction", "sum"))), ("div", ())]
    assert ops[-1].args[1] == float(inputs[2])


@pytest.mark.parametrize("mesh, options", [("1x1x1x1x1", {}), ("2x1x2x1x1", {}), ("1x1x1x2x1", {}),
                                           ("1x2x1x2x1", {"schedule": "1f1b", "microbatches": 2})])
def test_hf_loss_with_num_items_in_batch_trains_like_the_module(worker_pool, mesh: str, options: dict) -> None:
    """transformers' `ForCausalLMLoss` with `num_items_in_batch`: its sum is the sum over the token
    shards (dp, cp, the microbatches of a pipeline) and the vocab shards (tp), divided by the step's count."""
    pytest.importorskip("transformers")
    report = check_module(f"{HERE}:hf_items_in_batch", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool,
                          **options)
    assert report.max_error <= 1e-10, report


class RefusedLoss(ClassDimLoss):
    """Forms of the loss the plan does not compute: per-token losses averaged per sequence first
    (`none_per_row`), class weights that are a trained parameter (`trained_weights`)."""

    def __init__(self, form: str) -> None:
        super().__init__(extra=False)
        self.form = form
        self.class_weight = nn.Parameter(torch.ones(VOCAB))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.emb(ids)).flatten(0, 1)
        if self.form == "none_per_row":
            per_token = F.cross_entropy(logits, targets.flatten(), reduction="none")  # the refused line
            return per_token.view(BATCH, SEQ).mean(1).sum()
        return F.cross_entropy(logits, targets.flatten(), weight=self.class_weight)  # the refused line


@pytest.mark.parametrize("form, what", [("none_per_row", "reduction='none') used other than"),
                                        ("trained_weights", "class weights that are trained")])
def test_a_form_of_the_loss_the_plan_does_not_compute_is_refused_at_its_line(form: str, what: str) -> None:
    from fivedc.errors import NotSupportedError
    from fivedc.frontends.fx.values import Unrecognised

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with pytest.raises(NotSupportedError) as info:
        trace_module(RefusedLoss(form).double(), (ids, ids))
    error = info.value
    assert not isinstance(error, Unrecognised)  # refused, not kept as a replicated aten call
    assert what in error.message and error.hint
    lines = Path(HERE).read_text().splitlines()
    assert error.loc.file == HERE and "# the refused line" in lines[error.loc.line - 1]
