"""Error-feedback residuals that stay with their parameters: across DDP's bucket rebuild, host slices and checkpoints.

A residual is per element of what a rank pushes, so it may only ever be added
to the same elements of the same parameters it came from. A bucket's index does
not say which those are, nor do its parameters' shapes: DDP rebuilds its buckets
after the first iteration (model order becomes gradient-ready order) and a
resumed run starts again from the initial layout, so bucket 0 can hold other
parameters of the very same shapes at the same offsets. This module names each
parameter by a *serial*, the order in which the first iteration's buckets list
them (the same in every process of the same model), and knows where each
parameter lies in its bucket:

- while a bucket index keeps its parameters, its residuals stay where the
  client keeps them (by round key, on the bucket's device);
- when DDP hands an index other parameters, every bucket not yet pushed in this
  iteration has its residuals cut into per-parameter *pieces* and its round
  keys freed (the old layout's memory goes), and each bucket of the new layout
  gets back the pieces of its own parameters, zeros where this rank held none;
- ``state_dict()`` saves the pieces by parameter serial and element range;
  after ``load_state_dict()`` they go back to their parameters when these first
  appear, whatever the layout then.

A rank pushes *segments* of a bucket: the whole bucket on the flat path, the
slices it owns under two-level aggregation (gradq.client.session.host_groups). A
piece is the part of one parameter inside one segment, so a residual moves with
its parameter where this rank pushes it again, and is dropped where it does not.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradq.client.session.placement import quantizes_on_device
from gradq.client.worker import WorkerClient
from gradq.qcore.arrays import ResidualStore

__all__ = ["ParameterResiduals", "Segment"]

log = logging.getLogger(__name__)

# (round key handed to the client, begin, end): elements [begin, end) of a tensor that this rank pushes.
Segment = tuple[int, int, int]

# A checkpoint's residual piece: "param<serial> <dtype>[<shape>] [<start>:<stop>]" (elements of that parameter).
_PIECE_NAME = re.compile(r"^param(\d+) (\S+) \[(\d+):(\d+)\]$")


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one parameter lies in its bucket."""

    serial: int
    offset: int
    numel: int


@dataclass(slots=True)
class _Layout:
    """What a bucket index holds now, and what this rank pushes of it."""

    params: list[torch.Tensor]  # compared by identity with the next iteration's
    slots: list[_Slot] | None  # None: the bucket is not its parameters laid end to end (its residual cannot move)
    segments: list[Segment]
    device: torch.device


class ParameterResiduals:
    """Keeps a session's residuals on the parameters they belong to (see the module docstring).

    Args:
        client: the connected client whose stores hold the residuals by round key
            (None under a fallback: nothing is pushed, so nothing is kept).
        codec: the configured codec, which says which store a tensor's residual is in.
    """

    __slots__ = (
        "_client",
        "_codec",
        "_described",
        "_layouts",
        "_loaded",
        "_loose",
        "_observed",
        "_parameters",
        "_serials",
    )

    def __init__(self, client: WorkerClient | None, codec: str) -> None:
        self._client, self._codec = client, codec
        self._serials: dict[int, int] = {}  # id(parameter) -> serial
        self._parameters: list[torch.Tensor] = []  # by serial; held so that no other tensor reuses an id
        self._described: list[str] = []  # by serial: "dtype[shape]", checked against a checkpoint's pieces
        self._layouts: dict[int, _Layout] = {}  # bucket index -> its current layout
        self._loose: dict[int, list[tuple[int, torch.Tensor]]] = {}  # serial -> pieces held outside the client
        self._loaded: dict[int, str] = {}  # serial -> "dtype[shape]" of a checkpoint's pieces not yet matched
        self._observed: set[int] = set()  # bucket indices already pushed in this iteration

    # -- the session's side ----------------------------------------------------------------------

    def observe(
        self,
        key: int,
        params: list[torch.Tensor],
        numel: int,
        device: torch.device,
        segments: Sequence[Segment],
    ) -> None:
        """Before the tensor under ``key`` is pushed: move residuals if the caller changed what the key holds.

        Args:
            key: the tensor's key in its step (DDP: the bucket index), in call order.
            params: the parameters the tensor lays end to end ([] if it does not).
            numel: the tensor's elements.
            device: where it lives.
            segments: what this rank pushes of it.
        """
        known = self._layouts.get(key)
        if known is None or known.segments != list(segments) or not _same_tensors(known.params, params):
            if known is not None:
                self._cut_unpushed()
            slots = self._slots_of(params, numel) if params else None
            layout = _Layout(params, slots, list(segments), device)
            self._layouts[key] = layout
            if self._loose:
                self._give_back(layout)
        self._observed.add(key)

    def _slots_of(self, params: list[torch.Tensor], numel: int) -> list[_Slot] | None:
        slots, offset = [], 0
        for param in params:
            slots.append(_Slot(self._serial_of(param), offset, param.numel()))
            offset += param.numel()
        if offset != numel:
            log.warning("a bucket of %d elements holds parameters of %d: its residual resets", numel, offset)
            return None
        return slots

    def _serial_of(self, param: torch.Tensor) -> int:
        serial = self._serials.get(id(param))
        if serial is not None:
            return serial
        serial = self._serials[id(param)] = len(self._parameters)
        self._parameters.append(param)
        self._described.append(_describe(param))
        expected = self._loaded.pop(serial, None)
        if expected is not None and expected != self._described[serial]:
            log.warning(
                "checkpointed residual of parameter %d is for %s, the parameter is %s; dropped",
                serial,
                expected,
                self._described[serial],
            )
            self._loose.pop(serial, None)
        return serial

    def _cut_unpushed(self) -> None:
        """Every bucket not yet pushed this iteration: its residuals become loose pieces, its round keys are freed."""
        for index in [index for index in self._layouts if index not in self._observed]:
            layout = self._layouts.pop(index)
            for key, begin, end in layout.segments:
                residual = self._read_segment(key, end - begin, layout.device)
                self._forget_segment(key, end - begin, layout.device)
                if residual is not None and layout.slots is not None:
                    for serial, start, values in _cut(layout.slots, begin, end, residual):
                        self._loose.setdefault(serial, []).append((start, values.clone()))

    def _give_back(self, layout: _Layout) -> None:
        """Assemble the new layout's segment residuals from the loose pieces of its parameters."""
        if layout.slots is None:
            return
        for key, begin, end in layout.segments:
            residual: torch.Tensor | None = None
            for slot in layout.slots:
                for start, values in self._loose.get(slot.serial, ()):
                    first = max(begin, slot.offset + start)
                    last = min(end, slot.offset + min(start + values.numel(), slot.numel))
                    if first >= last:
                        continue
                    if residual is None:
                        residual = torch.zeros(end - begin, dtype=torch.float32)
                    source = first - slot.offset - start
                    residual[first - begin : last - begin] = values[source : source + last - first].cpu()
            if residual is not None:
                self._write_segment(key, residual, layout.device)
        for slot in layout.slots:  # what this rank does not push again is dropped: that part resets
            self._loose.pop(slot.serial, None)

    def end_step(self) -> None:
        """The step's last tensor was observed: what was cut and not given back is dropped."""
        self._observed.clear()
        if self._loaded:
            log.warning(
                "checkpointed residuals of %d parameter(s) matched no parameter of this model (serials %s); "
                "their error feedback restarts from zero",
                len(self._loaded),
                ", ".join(str(serial) for serial in sorted(self._loaded)),
            )
            self._loaded.clear()
        self._loose.clear()

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Piece name -> flat float32 CPU tensor, for every parameter element this rank holds a residual of."""
        pieces: dict[str, torch.Tensor] = {}
        for serial, loose in self._loose.items():
            for start, values in loose:
                pieces[self._piece_name(serial, start, values)] = values.detach().float().cpu()
        if self._client is None:
            return pieces
        for layout in self._layouts.values():
            if layout.slots is None:
                continue
            for key, begin, end in layout.segments:
                residual = self._read_segment(key, end - begin, layout.device)
                if residual is not None:
                    for serial, start, values in _cut(layout.slots, begin, end, residual):
                        pieces[self._piece_name(serial, start, values)] = values.detach().float().cpu().clone()
        return pieces

    def _piece_name(self, serial: int, start: int, values: torch.Tensor) -> str:
        described = self._described[serial] if serial < len(self._described) else self._loaded[serial]
        return f"param{serial} {described} [{start}:{start + values.numel()}]"

    def load_state_dict(self, pieces: Mapping[str, Any]) -> None:
        """Hold a checkpoint's pieces (``state_dict``'s output) until their parameters appear.

        Raises:
            ValueError: a piece's name or tensor is malformed (nothing is taken then).
        """
        loose: dict[int, list[tuple[int, torch.Tensor]]] = {}
        described: dict[int, str] = {}
        outdated = []
        for name, values in pieces.items():
            match = _PIECE_NAME.match(str(name))
            if match is None:
                if "#" in str(name):  # keyed by bucket signature, as gradq before 0.2 saved them
                    outdated.append(name)
                    continue
                raise ValueError(
                    f"residuals key {name!r} is invalid; expected 'param<serial> <dtype>[<shape>] [<start>:<stop>]'"
                )
            serial, start, stop = int(match[1]), int(match[3]), int(match[4])
            if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() != stop - start:
                raise ValueError(
                    f"residuals[{name!r}] is {type(values).__name__}"
                    f"{list(values.shape) if isinstance(values, torch.Tensor) else ''}; "
                    f"expected a flat torch.Tensor of {max(stop - start, 0)} elements"
                )
            loose.setdefault(serial, []).append((start, values.detach().float().cpu()))
            described[serial] = match[2]
        if outdated:
            log.warning(
                "%d checkpointed residual(s) are keyed by bucket signature (an older gradq); "
                "they cannot be placed on their parameters and are dropped: error feedback restarts from zero",
                len(outdated),
            )
        self._loose, self._loaded = loose, described

    # -- by round key: for adapters whose tensors do not lay parameters end to end (FSDP's shards) -----

    def read(self, key: int, numel: int, device: torch.device) -> torch.Tensor | None:
        """The residual of the tensor pushed whole under ``key``, as float32 on the host; None if it has none."""
        return self._read_segment(key, numel, device)

    def write(self, key: int, residual: torch.Tensor, device: torch.device) -> None:
        """Make ``residual`` (flat) the error feedback of the tensor pushed whole under ``key`` on ``device``."""
        self._write_segment(key, residual.detach().reshape(-1).float().cpu(), device)

    # -- where the client keeps them -----------------------------------------------------------------
    # One store per array library, by round key: tensors quantized on their device keep
    # theirs there, host arrays in numpy. The client says which keys carry a segment.

    def _store(self, device: torch.device) -> tuple[ResidualStore | None, bool]:
        """(the store a tensor on ``device`` keeps its residuals in, whether it holds tensors)."""
        assert self._client is not None, "residuals are read and written only while connected"
        on_device = quantizes_on_device(device, self._codec)
        return self._client.residuals("torch" if on_device else "numpy"), on_device

    def _read_segment(self, key: int, numel: int, device: torch.device) -> torch.Tensor | None:
        """The segment's residual (zeros in chunks that have none yet), on the host; None if it has none."""
        store, _ = self._store(device)
        assert self._client is not None
        if store is None:
            return None
        chunks = [(store.residual(chunk), begin, end) for chunk, begin, end in self._client.round_keys(key, numel)]
        if all(piece is None for piece, _, _ in chunks):
            return None
        residual = torch.zeros(numel, dtype=torch.float32)
        for piece, begin, end in chunks:
            if piece is not None and len(piece) == end - begin:
                residual[begin:end] = (
                    piece.detach().cpu() if isinstance(piece, torch.Tensor) else torch.from_numpy(piece)
                )
        return residual

    def _forget_segment(self, key: int, numel: int, device: torch.device) -> None:
        store, _ = self._store(device)
        assert self._client is not None
        if store is not None:
            for chunk, _, _ in self._client.round_keys(key, numel):
                store.reset(chunk)

    def _write_segment(self, key: int, residual: torch.Tensor, device: torch.device) -> None:
        store, holds_tensors = self._store(device)
        assert self._client is not None
        if store is None:
            return
        for chunk, begin, end in self._client.round_keys(key, residual.numel()):
            if holds_tensors:
                store.set_residual(chunk, residual[begin:end].to(device, torch.float32).clone())
            else:
                store.set_residual(chunk, np.array(residual[begin:end].numpy(), dtype=np.float32))


def _same_tensors(known: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    return len(known) == len(params) and all(a is b for a, b in zip(known, params, strict=True))


def _describe(param: torch.Tensor) -> str:
    return f"{str(param.dtype).removeprefix('torch.')}[{','.join(str(size) for size in param.shape)}]"


def _cut(slots: list[_Slot], begin: int, end: int, residual: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(serial, start within the parameter, values) of each parameter part inside segment [begin, end)."""
    parts = []
    for slot in slots:
        first, last = max(begin, slot.offset), min(end, slot.offset + slot.numel)
        if first < last:
            parts.append((slot.serial, first - slot.offset, residual[first - begin : last - begin]))
    return parts
