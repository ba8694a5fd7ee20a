"""Training data from files: token ids packed into rows, drawn per step from a seed.

:class:`ByteCorpus` reads text files as bytes (token ids 0-255: a byte-level tokenizer that needs no
files of its own) or, given a ``tokenizer`` (a folder with a transformers tokenizer, or a hub id in the
local cache), as that tokenizer's ids (each file encoded without special tokens, followed by the
tokenizer's end-of-sequence id where it has one). It concatenates them and packs them into rows of
``sequence + 1`` tokens (inputs and their next-token targets), without padding: the tail that does not
fill a row is left out. Each epoch
visits every row once in an order drawn from the seed and the epoch; step s takes the ``global_batch``
rows at its place in its epoch. So a batch is a function of (files, seed, step) alone: a run resumed
from a checkpoint at step k draws exactly the batches an uninterrupted run draws from step k on, and
every rank draws the same global batch, whose data-parallel replicas then take their slices
(``runtime.mesh.replica_batch``).

With no files it reads the Python standard library's own source (``*.py`` under ``sysconfig``'s
``stdlib`` path, sorted, up to ``max_bytes``): text every machine that runs octopipe has.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from octopipe.execute.runtime.models import BuiltModel
from octopipe.execute.training import DataSpec

__all__ = ["BYTE_VOCAB", "ByteCorpus", "stdlib_sources", "with_data"]

#: token ids a byte-level corpus uses
BYTE_VOCAB = 256


def stdlib_sources(max_bytes: int) -> list[Path]:
    """The standard library's ``*.py`` files, sorted by path, until they hold ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.glob("*.py")):
        chosen.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    if not chosen:
        raise ValueError(f"no Python sources under {root}: give data files")
    return chosen


class ByteCorpus:
    """Token rows packed from files (see the module docstring)."""

    def __init__(
        self,
        files: Sequence[str | Path] = (),
        *,
        sequence: int,
        seed: int = 0,
        max_bytes: int = 4 << 20,
        tokenizer: str = "",
    ) -> None:
        if sequence < 1:
            raise ValueError(f"sequence must be >= 1, got {sequence}")
        paths = [Path(f) for f in files] if files else stdlib_sources(max_bytes)
        texts = []
        for path in paths:
            try:
                texts.append(path.read_bytes())
            except OSError as exc:
                raise ValueError(f"data file {path}: {exc.strerror}") from None
        ids = (
            _encode(texts, tokenizer) if tokenizer else torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8)
        )
        rows = len(ids) // (sequence + 1)
        if rows == 0:
            raise ValueError(f"the data files hold {len(ids)} tokens: not one row of {sequence + 1}")
        self.rows = ids[: rows * (sequence + 1)].to(torch.int64).reshape(rows, sequence + 1)
        #: token ids the model's embedding must have: 256 for bytes, the largest id + 1 for a tokenizer
        self.vocabulary = BYTE_VOCAB if not tokenizer else int(self.rows.max()) + 1
        self.files = [str(p) for p in paths]
        self.sequence, self.seed = sequence, seed

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    def steps_per_epoch(self, global_batch: int) -> int:
        steps = self.num_rows // global_batch
        if steps == 0:
            raise ValueError(
                f"the data holds {self.num_rows} rows of {self.sequence + 1} tokens, fewer than one global batch "
                f"of {global_batch}: give more data or a smaller batch"
            )
        return steps

    def batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s global batch: (inputs, next-token targets), each ``global_batch x sequence``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        per_epoch = self.steps_per_epoch(global_batch)
        epoch, place = divmod(step, per_epoch)
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        rows = self.rows[order[place * global_batch : (place + 1) * global_batch]]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def check_vocabulary(self, model: nn.Module) -> None:
        """Refuse a model whose (first) embedding has fewer token ids than the data uses (256 for bytes)."""
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is not None and embedding.num_embeddings < self.vocabulary:
            kind = "byte-level data" if self.vocabulary == BYTE_VOCAB else "the tokenized data"
            raise ValueError(
                f"{kind} needs a vocabulary of at least {self.vocabulary} token ids; the model's embedding has "
                f"{embedding.num_embeddings}: give the model a larger vocabulary (e.g. model config vocab=256)"
            )


def _encode(texts: Sequence[bytes], tokenizer: str) -> torch.Tensor:
    """Each text's ids under ``tokenizer`` (no special tokens), each followed by its end-of-sequence id."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - only a tokenizer needs it

    try:
        encoder = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer {tokenizer!r}: {str(exc).splitlines()[0]}") from None
    ids: list[int] = []
    for text in texts:
        ids += encoder(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if encoder.eos_token_id is not None:
            ids.append(int(encoder.eos_token_id))
    return torch.tensor(ids, dtype=torch.int64)


def with_data(built: BuiltModel, spec: DataSpec) -> BuiltModel:
    """``built`` drawing its batches from ``spec``'s corpus: the same global batch and sequence as the
    model's own batches (so the plan's micro-batches are unchanged), byte tokens instead. A model whose
    vocabulary is under 256 ids is refused; so is one whose batches are not token ids (``batch(0)``'s
    inputs must be a 2-D integer tensor). Targets follow the model's own batches: the next tokens, or the
    inputs themselves where the model's own targets are its inputs (a transformers causal LM's ``labels``)."""
    inputs, own_targets = built.batch(0)
    if inputs.dim() != 2 or inputs.dtype.is_floating_point:
        raise ValueError(f"data files give token ids; this model's inputs are {tuple(inputs.shape)} {inputs.dtype}")
    global_batch, sequence = int(inputs.shape[0]), int(inputs.shape[1])
    corpus = ByteCorpus(
        spec.files, sequence=sequence, seed=spec.seed, max_bytes=spec.max_bytes, tokenizer=spec.tokenizer
    )
    corpus.check_vocabulary(built.model)
    corpus.steps_per_epoch(global_batch)  # at least one batch: refused here, not at the first step

    # the model's own convention: targets that are the inputs (transformers' causal LMs shift labels
    # themselves) or the next tokens
    labels_are_inputs = torch.equal(inputs, own_targets)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = corpus.batch(step, global_batch)
        if labels_are_inputs:
            targets = tokens.clone()
        return tokens.to(inputs.device), targets.to(inputs.device)

    return dataclasses.replace(built, batch=batch)
