"""Saved-tensor notes (`runtime/saved.py`), on one process: what autograd keeps, and when a note gathers.

A tensor given a note within `saving_scope` must not be kept by autograd (its storage is
not among the saved ones), its every saved view must share the note, the first unpack must
gather once and the last let the whole go (a note freed too early gathers twice), the
gradients must be those of a run without notes, and nothing may be set on the tensor.
Outside a scope a note changes nothing. The runs with collectives are held elsewhere: the
saved bytes against the estimate under SP and ZeRO-3 (`test_memory_measured.py`, a note
not applied keeps the whole), and the runtime's calls against the proof
(`test_agreement.py`, a note freed too early gathers again in backward).
"""

from __future__ import annotations

import gc

import torch

from fivedc.runtime.saved import Note, SavedRecorder, keep_as_note, saving_scope


class CountedNote(Note):
    """Gathers a copy of `whole` (or of each of `parts`), counting the gathers."""

    def __init__(self, whole: torch.Tensor | None = None, parts: dict | None = None) -> None:
        super().__init__()
        self.source = whole.detach().clone() if whole is not None else None
        self.parts = parts
        self.gathers = self.launches = 0

    def gather(self):
        self.gathers += 1
        if self.parts is not None:
            return {name: t.detach().clone() for name, t in self.parts.items()}
        return self.source.clone()

    def launch(self):
        self.launches += 1
        return self.gather


def _two_readers(whole: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two matmuls saving two views of `whole`'s root for dW."""
    return (whole[:2] @ w).pow(2).sum() + (whole[2:] @ w).sin().sum()


def _reference() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    whole = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    _two_readers(whole, w).backward()
    return whole, w.detach().clone(), w.grad.clone()


def test_a_noted_tensor_is_not_kept_and_is_gathered_once_for_all_its_saves() -> None:
    whole, w0, expected = _reference()
    w = w0.clone().requires_grad_(True)
    recorder = SavedRecorder(exclude=[w])
    with saving_scope(recorder):
        gathered = whole.clone()
        note = keep_as_note(gathered, CountedNote(whole))
        loss = _two_readers(gathered, w)
        assert note.packed == 2 and note.gathers == 0  # both saved views hold the note, none the tensor
        assert gathered.untyped_storage().data_ptr() not in recorder.storages
        loss.backward()
    assert note.gathers == 1  # the first unpack gathers; the second finds it (freed early: two)
    assert note.packed == 0 and note.whole is None  # the last unpack let it go
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)
    assert gathered.__dict__ == {}  # nothing set on the tensor


def test_an_early_start_is_what_the_first_unpack_takes() -> None:
    whole, w0, expected = _reference()
    w = w0.clone().requires_grad_(True)
    with saving_scope():
        gathered = whole.clone()
        note = keep_as_note(gathered, CountedNote(whole))
        loss = _two_readers(gathered, w)
        note.start()
        note.start()  # started once
        loss.backward()
    assert (note.launches, note.gathers, note.packed, note.whole, note.pending) == (1, 1, 0, None, None)
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)


def test_members_of_a_group_share_one_note_by_part() -> None:
    torch.manual_seed(1)
    a, b = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ((x @ a) @ b).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with saving_scope():
        ga, gb = a.clone(), b.clone()
        note = CountedNote(parts={"a": a, "b": b})
        keep_as_note(ga, note, "a")
        keep_as_note(gb, note, "b")
        loss = ((x @ ga) @ gb).sum()
        assert note.packed == 2
        loss.backward()
    assert (note.gathers, note.packed, note.whole) == (1, 0, None)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_outside_a_scope_a_note_changes_nothing_and_an_entry_goes_with_its_tensor() -> None:
    whole, w0, expected = _reference()
    w = w0.clone().requires_grad_(True)
    gathered = whole.clone()
    note = keep_as_note(gathered, CountedNote(whole))
    _two_readers(gathered, w).backward()
    assert (note.packed, note.gathers) == (0, 0)
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)
    with saving_scope() as notes:
        gathered = whole.clone()
        keep_as_note(gathered, CountedNote(whole))
        assert len(notes.roots) == 1
        del gathered
        gc.collect()
        assert len(notes.roots) == 0
