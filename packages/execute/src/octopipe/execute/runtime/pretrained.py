"""Weights in and out of a run: a model built with its parameters on the meta device, each rank reading
only its own stages' tensors, and the trained weights written back in HuggingFace's safetensors layout.

With ``WeightsSpec.load`` a rank builds the model inside :func:`params_on_meta` (parameters have a shape
and a dtype but no storage; buffers such as rotary frequencies are computed as usual), captures and
splits it on the meta device (``runtime.stages``), then :func:`materialize` reads from the
:class:`WeightSource` only the tensors of the stages the rank runs and puts them in place of the meta
parameters, wherever the model and its stage modules hold them. Every other parameter stays meta: a
rank's resident parameter bytes are its stages' (:func:`resident_param_bytes`).

A source is a folder of safetensors in HF's layout (``model.safetensors``, or the shards an
``model.safetensors.index.json`` names; read tensor by tensor, never whole files) or one of octopipe's
own checkpoints (``step-<n>``, read through torch.distributed.checkpoint by parameter name). A parameter
the source lacks, or holds in another shape, is refused: a model is never trained from weights it was
not given.

:func:`export_shard` and :func:`finish_export` write the trained weights as HF-layout safetensors: one
shard per rank (its parameters, a tied one by one holder, under every name the source used for it), an
index, the source's buffers and its config and tokenizer files, so ``from_pretrained`` reads the folder.
:func:`causal_lm` is the model source for a transformers checkpoint folder.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from octopipe.transform.device import Device

__all__ = [
    "INDEX_FILE",
    "WeightSource",
    "causal_lm",
    "export_shard",
    "finish_export",
    "materialize",
    "params_on_meta",
    "placeholders",
    "resident_param_bytes",
    "stage_parameter_names",
    "swap_tensors",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: the files of a HuggingFace folder an export copies beside the weights (those the source has)
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


#: safetensors' dtype names
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers goes to the meta device (no storage); buffers stay where
    they are made. It replaces ``nn.Module.register_parameter`` while open (as accelerate's
    ``init_empty_weights`` does), so build one model at a time in a process."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    setattr(nn.Module, "register_parameter", register)  # noqa: B010
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", original)  # noqa: B010


def swap_tensors(roots: Iterable[nn.Module], replacements: Mapping[int, torch.Tensor]) -> None:
    """Put ``replacements[id(t)]`` wherever a module under ``roots`` holds parameter or buffer ``t``."""
    for root in roots:
        for module in root.modules():
            for slots in (module._parameters, module._buffers):
                for key, value in slots.items():
                    if value is not None and id(value) in replacements:
                        slots[key] = replacements[id(value)]  # type: ignore[assignment]


def stage_parameter_names(model: nn.Module, stages: Sequence[nn.Module], mine: Iterable[int]) -> list[str]:
    """The model's names (a tied parameter under its first) of the parameters stages ``mine`` hold."""
    held = {id(p) for s in mine for p in stages[s].parameters()}
    return [name for name, param in model.named_parameters() if id(param) in held]


def placeholders(model: nn.Module, device: torch.device) -> None:
    """Put in place of each meta parameter zeros on ``device`` expanded from one element (one per dtype,
    shared): a real tensor to capture and split the model with, holding no storage of its own."""
    bases: dict[torch.dtype, torch.Tensor] = {}
    replacements = {}
    for param in model.parameters():
        if param.is_meta:
            base = bases.setdefault(param.dtype, torch.zeros((), dtype=param.dtype, device=device))
            replacements[id(param)] = nn.Parameter(base.expand(param.shape), param.requires_grad)
    swap_tensors([model], replacements)


def resident_param_bytes(model: nn.Module) -> int:
    """Bytes of storage the model's parameters hold, measured on their storages (each counted once: a tied
    parameter, or the placeholders sharing one element); meta parameters hold none."""
    storages = {}
    for param in model.parameters():
        if not param.is_meta:
            storage = param.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class WeightSource:
    """The tensors of a safetensors folder (HF layout) or an octopipe checkpoint, read by name."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        self.checkpoint = False
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map: not a safetensors index")
            self.files = {str(name): self.folder / str(file) for name, file in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), framework="pt") as handle:
                self.files = {name: single for name in handle.keys()}  # noqa: SIM118 - a safetensors handle
        elif (self.folder / ".metadata").is_file():
            metadata = dcp.FileSystemReader(str(self.folder)).read_metadata().state_dict_metadata
            self.checkpoint = True
            self.files = {key.removeprefix("param/"): self.folder for key in metadata if key.startswith("param/")}
            self._stored = {key.removeprefix("param/"): meta for key, meta in metadata.items()}
        else:
            raise FileNotFoundError(
                f"{self.folder}: no {SINGLE_FILE}, {INDEX_FILE} or octopipe checkpoint (.metadata): give a folder "
                "of HuggingFace safetensors or a step-<n> checkpoint folder"
            )

    @property
    def names(self) -> list[str]:
        return sorted(self.files)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor's shape and dtype as a meta tensor, from the files' headers (nothing read)."""
        if self.checkpoint:
            out = {}
            for name, stored in self._stored.items():
                if name in self.files:
                    info: Any = stored
                    out[name] = torch.empty(tuple(info.size), dtype=info.properties.dtype, device="meta")
            return out
        out = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle
                    if self.files.get(name) == file:
                        view = handle.get_slice(name)
                        dtype = _SAFETENSORS_DTYPES[view.get_dtype()]
                        out[name] = torch.empty(tuple(view.get_shape()), dtype=dtype, device="meta")
        return out

    def read(self, wanted: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors named by ``wanted``'s keys, on the CPU as stored; ``wanted``'s values (meta tensors
        will do) give the shape each must have. Only these tensors are read."""
        missing = sorted(set(wanted) - set(self.files))
        if missing:
            raise ValueError(
                f"{self.folder} lacks {len(missing)} of the model's parameters ({', '.join(missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''}): octopipe trains a model only from weights it was given; "
                "give this model's checkpoint"
            )
        out: dict[str, torch.Tensor] = {}
        if self.checkpoint:
            state = {}
            for name in wanted:
                stored: Any = self._stored[name]
                state[f"param/{name}"] = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
            dcp.load(state, checkpoint_id=str(self.folder), no_dist=True)  # this rank's tensors only
            out = {name: state[f"param/{name}"] for name in wanted}
        else:
            by_file: dict[Path, list[str]] = {}
            for name in wanted:
                by_file.setdefault(self.files[name], []).append(name)
            for file, names in by_file.items():
                with safe_open(str(file), framework="pt") as handle:
                    for name in names:
                        out[name] = handle.get_tensor(name)
        for name, like in wanted.items():
            if tuple(out[name].shape) != tuple(like.shape):
                raise ValueError(
                    f"{self.folder}: {name} is {tuple(out[name].shape)}, the model's is {tuple(like.shape)}: "
                    "the checkpoint is of another configuration"
                )
        return out


def materialize(
    model: nn.Module, roots: Sequence[nn.Module], names: Iterable[str], source: WeightSource, device: Device
) -> None:
    """Read ``names`` (model parameter names) from ``source`` onto ``device``, in the dtype of the (meta or
    placeholder) parameters they replace, wherever ``model`` and ``roots`` hold those."""
    params = dict(model.named_parameters())
    wanted = {name: params[name] for name in names}
    loaded = source.read(wanted)
    replacements = {
        id(params[name]): nn.Parameter(device.put(tensor.to(params[name].dtype)), params[name].requires_grad)
        for name, tensor in loaded.items()
    }
    swap_tensors([model, *roots], replacements)


def _shard_name(rank: int, world: int) -> str:
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def export_shard(
    folder: str | Path,
    params: Mapping[str, torch.Tensor],
    aliases: Mapping[str, Sequence[str]],
    rank: int,
    world: int,
    source_names: Iterable[str] = (),
) -> Path:
    """Write rank ``rank``'s trained ``params`` (model names) as its shard of an export. ``aliases[name]``:
    the other names the model has for a tied parameter; each alias the source stored is written too."""
    known = set(source_names)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        value = tensor.detach().to("cpu").contiguous()
        tensors[name] = value
        for alias in aliases.get(name, ()):
            if alias in known:
                tensors[alias] = value.clone()  # safetensors stores no shared tensors
    path = Path(folder) / _shard_name(rank, world)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def finish_export(folder: str | Path, world: int, source: WeightSource | None, written_by: str = "octopipe") -> Path:
    """After every rank wrote its shard: the index, the source's tensors no rank wrote (buffers it stored),
    and the source's config and tokenizer files. Returns the index's path."""
    out = Path(folder)
    weight_map: dict[str, str] = {}
    for rank in range(world):
        name = _shard_name(rank, world)
        with safe_open(str(out / name), framework="pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), name))
    if source is not None:
        rest = [name for name in source.names if name not in weight_map]
        if rest:
            save_file(_read_as_stored(source, rest), str(out / "model-extra.safetensors"), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(rest, "model-extra.safetensors"))
        for file in _COPIED:
            if (source.folder / file).is_file():
                shutil.copyfile(source.folder / file, out / file)
    total = 0
    for file in sorted(set(weight_map.values())):
        with safe_open(str(out / file), framework="pt") as handle:
            total += sum(handle.get_tensor(key).nbytes for key in handle.keys())  # noqa: SIM118
    index = out / INDEX_FILE
    metadata = {"total_size": total, "written_by": written_by}
    index.write_text(json.dumps({"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    return index


def _read_as_stored(source: WeightSource, names: Sequence[str]) -> dict[str, torch.Tensor]:
    if source.checkpoint:
        raise ValueError(f"{source.folder} is an octopipe checkpoint: its tensors are all parameters")
    out = {}
    for name in names:
        with safe_open(str(source.files[name]), framework="pt") as handle:
            out[name] = handle.get_tensor(name).contiguous()
    return out


def causal_lm(path: str, sequence: str = "64", global_batch: str = "8") -> tuple[nn.Module, Callable[..., Any]]:
    """A model source (``octopipe.execute.runtime.pretrained:causal_lm``): the transformers causal LM that
    ``path``'s ``config.json`` describes (a local folder, or a hub id in the local cache), built from the
    config, and batches of ``global_batch`` x ``sequence`` random token ids with ``labels`` equal to the
    inputs (transformers' causal LMs shift the labels themselves). Its weights come from ``WeightsSpec``."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 - only this source needs it

    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config)
    vocab, rows, length = int(config.vocab_size), int(global_batch), int(sequence)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(step))
        return ids, ids.clone()

    return model, batch
