"""Sibling projections that read one input, run as one quantized kernel call.

A Llama-style layer calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same tensor, then
``gate_proj`` and ``up_proj`` on another. At one row per call (decode), each call of the
CPU int4/int8 kernels is mostly fixed cost, and with two threads each is one more wake-up of
a sleeping thread: stacking the siblings' weights along the output dimension turns seven
calls per layer into four.

Exactness: these kernels compute each output column from that column's weight rows alone,
so a stacked call gives every member the bits it computes alone. That is not assumed: each
group is built only after a check, on this machine's kernel, that its stacked outputs equal
the separate ones bit for bit (at one row and at several); a group that fails stays unfused.

How it plugs in without rewriting the model's attention: each member keeps its name and
place (``self_attn.k_proj`` ...). The first member called on a tensor computes its own
columns and those of every member after it, and hands the later ones theirs when they are
called on the same tensor object; a member called on any other tensor (the cache's K/V
replay calls ``k_proj`` and ``v_proj`` alone) computes from its own columns on. So the
result never depends on call order, only the number of calls does.
"""

from __future__ import annotations

import torch
from torch import nn

from kvchat.engine.models import int4_kernel
from kvchat.engine.models.heap import return_freed_memory
from kvchat.engine.models.qlinear import (
    Int4Embedding,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    int4_mm,
    int8_mm,
    int8_rows_independent,
)

# The group's name on the parent module, its members in the order they are stacked, and the
# members a call may start from (each needs its own copy of the scales from there on; k_proj
# is one because the cache's K/V replay calls k_proj and v_proj without q_proj). A call on
# another member starts from the nearest one before it and drops the columns before its own.
SIBLINGS = (
    ("qkv_stacked", ("q_proj", "k_proj", "v_proj"), (0, 1)),
    ("gate_up_stacked", ("gate_proj", "up_proj"), (0,)),
)
_CHECK_ROWS = (1, 3)

__all__ = ["FusedProjection", "ProjectionGroup", "fuse_siblings", "stacked_group", "weight_widths"]


class ProjectionGroup(nn.Module):
    """The stacked weights of sibling projections, and the columns one call left for later
    members."""

    def __init__(
        self, members: list[Int4Linear | Int8Linear], entries: tuple[int, ...] = (0,)
    ) -> None:
        super().__init__()
        self.entries = entries
        self.int4 = isinstance(members[0], Int4Linear)
        # Which kernel runs the stack: "kvchat" or "torch" (int4, Int4Linear.form), "int8".
        self.form = members[0].form if self.int4 else "int8"
        self.in_features = members[0].in_features
        widths = [m.out_features for m in members]
        self.starts = [sum(widths[:i]) for i in range(len(widths) + 1)]
        if self.form == "kvchat":
            self.register_buffer("packed", torch.cat([m.packed for m in members]))
            scales = [m.scale_min for m in members]
            if len({s.shape[1] for s in scales}) > 1:  # symmetric beside asymmetric
                scales = [int4_kernel.full_form(s) for s in scales]
        elif self.int4:
            self.register_buffer("packed", torch.cat([m.packed for m in members]))
            scales = [m.scales_and_zeros for m in members]
        else:
            self.register_buffer("packed", torch.cat([m.qweight for m in members]))
            scales = [m.kernel_scales for m in members]
        # The kernels take contiguous scales: one tensor per first member (a few KB each).
        for i in entries:
            tail = torch.cat(scales[i:], dim=-2 if self.form == "torch" else 0).contiguous()
            self.register_buffer(f"scales_from_{i}", tail)
        for i, m in enumerate(members):
            if m.bias is not None:
                self.register_buffer(f"bias_{i}", m.bias.detach())
        self.members = len(members)
        self.widths = widths
        self.has_bias = any(m.bias is not None for m in members)
        # The leading members whose columns may take the int4 kernel's tiled path (q_proj's,
        # not the replayed k_proj's and v_proj's: Int4Linear.tiled).
        tiled = [getattr(m, "tiled", False) for m in members]
        self.tiled_members = tiled.index(False) if False in tiled else len(tiled)
        self._stash = _Stash(self.members)
        self._plans: list[_Plan] | None = None

    def _apply(self, fn, recurse=True):  # moved or cast: the plans point at old tensors
        out = super()._apply(fn, recurse)
        self._plans = None
        return out

    def _plan(self, index: int) -> _Plan:
        """What a call starting at member ``index`` runs (tensors looked up once: a decode
        step makes ~150 of these calls, and nn.Module attribute lookups add up)."""
        if self._plans is None:
            plans = []
            for i in range(self.members):
                entry = max(e for e in self.entries if e <= i)
                base = self.starts[entry]
                cuts = []
                for j in range(i, self.members):
                    bias = getattr(self, f"bias_{j}", None)
                    cuts.append((self.starts[j] - base, self.starts[j + 1] - base, bias))
                weight = self.packed[base:]
                tiled = max(0, self.starts[self.tiled_members] - base)
                plans.append(_Plan(weight, getattr(self, f"scales_from_{entry}"), cuts, tiled))
            self._plans = plans
        return self._plans[index]

    def columns(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``x`` ([rows, out] for [..., in])."""
        stash = self._stash
        if stash.input is x and stash.left[index] is not None:
            out, stash.left[index] = stash.left[index], None
            if all(t is None for t in stash.left):
                stash.input = None
            return out
        plan = self._plan(index)
        parts = _cut(self._run(plan, x), plan.cuts)
        stash.left = [None] * (index + 1) + parts[1:]
        stash.input = x if len(parts) > 1 else None
        return parts[0]

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's columns side by side (``[rows, sum(widths)]``), biases not added:
        the one kernel call a decode step makes (``kvchat.engine.models.decode_step``)."""
        return self._run(self._plan(0), x)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked weight and scales one :meth:`stacked` call hands the kernel."""
        plan = self._plan(0)
        return plan.weight, plan.scales

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's output for ``x`` (``[rows, width]``, bias added), from one call."""
        plan = self._plan(0)
        return _cut(self._run(plan, x), plan.cuts)

    def _run(self, plan: _Plan, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.form == "kvchat":
            n, t = plan.weight.shape[0], plan.tiled
            if t and int4_kernel.takes_tiles(rows.shape[0]):
                w, s = plan.weight, plan.scales
                y = int4_kernel.matmul(rows, w[:t], s[:t], t, tiled=True)
                if t < n:
                    y = torch.cat([y, int4_kernel.matmul(rows, w[t:], s[t:], n - t)], dim=1)
            else:
                y = int4_kernel.matmul(rows, plan.weight, plan.scales, n)
            return y.to(rows.dtype)
        return (int4_mm if self.int4 else int8_mm)(rows, plan.weight, plan.scales)

    def biases(self) -> list[torch.Tensor | None]:
        """Each member's bias (None for a member without one)."""
        return [getattr(self, f"bias_{i}", None) for i in range(self.members)]

    def forget(self) -> None:
        self._stash = _Stash(self.members)


def _cut(y: torch.Tensor, cuts: list[tuple[int, int, torch.Tensor | None]]) -> list[torch.Tensor]:
    """The members' column ranges of a stacked output, each with its bias added."""
    return [
        y[:, lo:hi] if bias is None else y[:, lo:hi] + bias.to(y.dtype) for lo, hi, bias in cuts
    ]


class _Stash:
    """The input of the last stacked call and the columns it left for later members."""

    __slots__ = ("input", "left")

    def __init__(self, members: int) -> None:
        self.input: torch.Tensor | None = None
        self.left: list[torch.Tensor | None] = [None] * members


class _Plan:
    __slots__ = ("cuts", "scales", "tiled", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        cuts: list[tuple[int, int, torch.Tensor | None]],
        tiled: int,
    ) -> None:
        self.weight, self.scales, self.cuts = weight, scales, cuts
        self.tiled = tiled  # the weight's leading rows a call of many rows may tile


class FusedProjection(nn.Module):
    """One member of a :class:`ProjectionGroup`, in the place of the layer it replaces."""

    def __init__(self, group: ProjectionGroup, index: int, name: str) -> None:
        super().__init__()
        # Not a submodule: the group is registered once, on the parent (its weights counted
        # once by named_buffers and state_dict).
        object.__setattr__(self, "group", group)
        self.index = index
        self.name = name
        self.in_features = group.in_features
        self.out_features = group.starts[index + 1] - group.starts[index]

    @property
    def rows_independent(self) -> bool:
        """As the member's own layer's, for the kernel that runs the group and this member's
        columns (int8's, or int4's tiled or not)."""
        if self.group.form == "int8":
            return int8_rows_independent()
        return self.group.form == "kvchat" and self.index >= self.group.tiled_members

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.columns(self.index, x)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "int4" if self.group.int4 else "int8"
        return f"in={self.in_features}, out={self.out_features}, {kind}, stacked with siblings"


def stacked_group(members: list[nn.Module]) -> ProjectionGroup | None:
    """The group ``members`` are, in stacking order and all of it, else None."""
    if not members or not all(isinstance(m, FusedProjection) for m in members):
        return None
    group = members[0].group
    whole = group.members == len(members)
    ordered = all(m.group is group and m.index == i for i, m in enumerate(members))
    return group if whole and ordered else None


def fuse_siblings(model: nn.Module) -> int:
    """Stack every set of :data:`SIBLINGS` that are quantized CPU layers of one kind and pass
    the bit-for-bit check; returns how many groups were made."""
    made = 0
    # Names, not modules: a list of the modules would keep every replaced layer alive until
    # the end, so the stacked copies of all of them would exist beside the originals (1.1 GB
    # over the final RSS for Gemma 3 4B in int4); by name, each layer's originals are freed
    # as soon as its group replaces them.
    for parent_name in [name for name, _ in model.named_modules()]:
        parent = model.get_submodule(parent_name)
        for group_name, names, entries in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not _fusable(members):
                continue
            group = ProjectionGroup(members, entries)
            if not _same_bits(group, members):
                continue
            parent.add_module(group_name, group)
            for i, name in enumerate(names):
                setattr(parent, name, FusedProjection(group, i, name))
            made += 1
            del members, group
            # glibc keeps the originals' memory as free heap the next (larger) stack does
            # not fit in: returned now, the stacking adds no peak (see quantized_load).
            return_freed_memory()
    return made


def _fusable(members: list[nn.Module | None]) -> bool:
    if any(m is None for m in members):
        return False
    kind = type(members[0])
    if kind is Int4Linear:
        forms = {m.form for m in members if type(m) is Int4Linear}
        ok = all(type(m) is Int4Linear for m in members) and len(forms) == 1
        ok = ok and "portable" not in forms
    elif kind is Int8Linear:
        ok = all(type(m) is Int8Linear and m.qweight.is_cpu and not m.refine_top for m in members)
    else:
        return False
    return ok and len({m.in_features for m in members}) == 1


def _same_bits(group: ProjectionGroup, members: list[nn.Module]) -> bool:
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in _CHECK_ROWS:
            x = torch.randn(rows, group.in_features, generator=generator)
            alone = [m(x) for m in members]
            for first in range(len(members)):
                group.forget()
                got = [group.columns(i, x) for i in range(first, len(members))]
                if not all(torch.equal(a, b) for a, b in zip(alone[first:], got)):
                    group.forget()
                    return False
    group.forget()
    return True


def weight_widths(model: nn.Module) -> set[int]:
    """The bit widths of the quantized weights ``model`` holds (empty: float weights only).
    Here, not in ``quantize``, so that ``decode_step`` can ask too: ``quantize`` drops a
    model's step when it replaces layers, and importing it from there would be a cycle."""
    widths = set()
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8Embedding)):
            widths.add(8)
        elif isinstance(module, (Int4Linear, Int4Embedding)):
            widths.add(4)
        elif isinstance(module, ProjectionGroup):
            widths.add(4 if module.int4 else 8)
    return widths
