"""``octopipe train``'s configuration: a TOML file a user can read and diff, checked key by key (no torch).

Every key, its type, default and meaning is in :data:`KEYS`; ``octopipe train --help`` prints them. An
unknown section or key, or a value of the wrong type, is a one-line ``ValueError`` naming it. With no
file, every default holds: the embedded default job (a small heterogeneous model from the zoo, trained on
the Python standard library's own source as bytes).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octopipe.execute.runs import STAGE_BACKENDS
from octopipe.execute.training import DataSpec, Optimization

__all__ = ["KEYS", "TrainConfig", "keys_help", "load_train_config"]

#: section -> key -> (type, default, what it means); a default of None means "unset"
KEYS: dict[str, dict[str, tuple[type, Any, str]]] = {
    "model": {
        "workload": (str, "nemotronh-16", "a zoo workload: llama-8, jamba-8, nemotronh-16 or moe-ep-4"),
        "tiny": (bool, True, "the zoo's unit-test sizes (hidden 32) instead of the standard ones"),
        "vocab": (int, 256, "the zoo model's token ids (byte-level data needs at least 256)"),
        "hf": (
            str,
            "",
            "a transformers causal-LM folder (config.json + safetensors; or a hub id in the local cache) "
            "instead of the zoo: its weights are loaded stage by stage",
        ),
        "source": (str, "", "package.module:function returning (model, batch_fn(step)) instead of the zoo"),
        "options": (dict, {}, "keyword arguments for source, as strings"),
        "sequence": (int, 64, "tokens per sequence (zoo and hf)"),
        "global_batch": (int, 8, "sequences per step, over all micro-batches and replicas (zoo and hf)"),
    },
    "weights": {
        "load": (
            str,
            "",
            "initial weights: an HF safetensors folder or an octopipe step-<n> checkpoint; default: "
            "[model] hf's folder, else random from [run] seed",
        ),
        "export": (str, "", "write the trained weights here as HF-layout safetensors (+ the source's config)"),
    },
    "data": {
        "enabled": (bool, True, "false: the model's own batches (random token ids for hf) instead of files"),
        "files": (list, [], "text files read as bytes; empty: the Python standard library's own source"),
        "seed": (int, 0, "the order rows are drawn in (each epoch its own)"),
        "max_bytes": (int, 1 << 20, "how much of the standard library to read when no files are given"),
        "tokenizer": (
            str,
            "",
            "'bytes', or a transformers tokenizer folder (or hub id in the local cache); empty: [model] hf's own "
            "tokenizer when its folder has one, else bytes",
        ),
    },
    "optimizer": {
        "name": (str, "adamw", "adamw or sgd"),
        "learning_rate": (float, 3e-3, "the peak learning rate"),
        "weight_decay": (float, 0.1, "decoupled (AdamW) or L2 (SGD) weight decay"),
        "decay_norms_and_biases": (bool, False, "false: no weight decay on 1-D parameters"),
        "betas": (list, [0.9, 0.95], "AdamW's betas"),
        "momentum": (float, 0.0, "SGD's momentum"),
        "clip_grad_norm": (float, 1.0, "clip the global gradient norm (over every stage) to this; 0: off"),
    },
    "schedule": {
        "warmup_steps": (int, 20, "linear warm-up steps"),
        "kind": (str, "cosine", "after the warm-up: constant, linear or cosine"),
        "total_steps": (int, 0, "where the decay ends; 0: the run's steps"),
        "min_lr_ratio": (float, 0.1, "the floor, as a fraction of the peak"),
    },
    "plan": {
        "file": (str, "", "a plan file to run (its model must be this config's); empty: make one"),
        "schedule": (
            str,
            "zb-h1",
            "1f1b or zb-h1 on equal layer counts, or tune: profile this model's layers, then search partition x "
            "placement x schedule (and predict each step)",
        ),
        "tune_budget_s": (float, 10.0, "the tuner's time budget (schedule = tune)"),
        "ranks": (int, 2, "pipeline ranks (local CPU processes)"),
        "microbatches": (int, 4, "micro-batches per step"),
    },
    "metrics": {
        "tensorboard": (bool, True, "also write TensorBoard event files (needs tensorboardX)"),
        "peak_gflops": (float, 0.0, "one rank's peak GFLOP/s for MFU; 0: measure one core's fp32 matmul rate"),
        "profile": (str, "", "a Profile of this model (octopipe profile): predicted step time and bubble per step"),
    },
    "run": {
        "steps": (int, 200, "optimizer steps"),
        "seed": (int, 0, "the model's initial weights"),
        "checkpoint_dir": (str, "", "where checkpoints go; empty: none"),
        "checkpoint_every": (int, 0, "steps between checkpoints"),
        "checkpoint_async": (bool, False, "write checkpoints in the background while the next steps run"),
        "checkpoint_keep": (int, 0, "keep only the newest this many checkpoints; 0: all"),
        "timeout_s": (float, 120.0, "seconds any rank may wait for a message"),
        "compile": (
            str,
            "auto",
            "stage graphs: auto (compiled where the compile cache is warm and faster), inductor, or eager (bitwise)",
        ),
    },
}


def keys_help() -> str:
    """Every key with its type, default and meaning, section by section (for ``--help``)."""
    lines = ["configuration keys (TOML sections and keys; every one optional):"]
    for section, keys in KEYS.items():
        lines.append(f"  [{section}]")
        for key, (kind, default, text) in keys.items():
            lines.append(f"    {key} ({kind.__name__}, default {default!r}): {text}")
    return "\n".join(lines)


@dataclass(frozen=True)
class TrainConfig:
    """A checked configuration: every section as a dict of its keys (defaults filled in)."""

    values: dict[str, dict[str, Any]]
    source: str = "the embedded default"

    def section(self, name: str) -> dict[str, Any]:
        return self.values[name]

    @property
    def steps(self) -> int:
        return int(self.values["run"]["steps"])

    def optimization(self, steps: int | None = None) -> Optimization:
        """The optimizer and schedule; ``steps`` (default the config's) ends the decay when total_steps is 0 (a
        run shorter than the warm-up then warms up over all but its last step)."""
        o, s = self.values["optimizer"], self.values["schedule"]
        total = s["total_steps"] or (steps if steps is not None else self.steps)
        warmup = s["warmup_steps"]
        if not s["total_steps"] and s["kind"] != "constant":
            warmup = min(warmup, max(0, total - 1))
        return Optimization(
            optimizer=o["name"],
            learning_rate=o["learning_rate"],
            weight_decay=o["weight_decay"],
            decay_norms_and_biases=o["decay_norms_and_biases"],
            betas=tuple(o["betas"]),
            momentum=o["momentum"],
            clip_grad_norm=o["clip_grad_norm"],
            warmup_steps=warmup,
            schedule=s["kind"],
            total_steps=total,
            min_lr_ratio=s["min_lr_ratio"],
        )

    def data(self) -> DataSpec:
        d = self.values["data"]
        tokenizer = d["tokenizer"]
        hf = self.values["model"]["hf"]
        if not tokenizer and hf and any((Path(hf) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = hf  # the model's own tokenizer
        return DataSpec(
            files=tuple(d["files"]),
            seed=d["seed"],
            max_bytes=d["max_bytes"],
            tokenizer="" if tokenizer == "bytes" else tokenizer,
        )


def _checked(section: str, key: str, value: object) -> object:
    kind = KEYS[section][key][0]
    where = f"[{section}] {key}"
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {type(value).__name__} {value!r}")
        return value
    if kind is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str | int | float | bool) for v in value.values()):
            raise ValueError(f"{where} must be a table of plain values, got {value!r}")
        return value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where} must be {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def load_train_config(path: Path | None) -> TrainConfig:
    """The configuration in ``path`` (TOML), or the embedded default; a one-line ValueError names a bad key."""
    given: dict[str, Any] = {}
    if path is not None:
        try:
            given = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the configuration: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not TOML: {exc}") from None
    values = {section: {k: v[1] for k, v in keys.items()} for section, keys in KEYS.items()}
    for section, keys in given.items():
        if section not in KEYS:
            raise ValueError(f"[{section}] is not a section: use {', '.join(f'[{s}]' for s in KEYS)}")
        if not isinstance(keys, dict):
            raise ValueError(f"{section} must be a [section] of keys, got {keys!r}")
        for key, value in keys.items():
            if key not in KEYS[section]:
                raise ValueError(f"[{section}] {key} is not a key: use one of {', '.join(KEYS[section])}")
            values[section][key] = _checked(section, key, value)
    betas = values["optimizer"]["betas"]
    if len(betas) != 2 or not all(isinstance(b, int | float) and not isinstance(b, bool) for b in betas):
        raise ValueError(f"[optimizer] betas must be two numbers, got {betas!r}")
    if values["run"]["compile"] not in STAGE_BACKENDS:
        raise ValueError(f"[run] compile must be one of {', '.join(STAGE_BACKENDS)}, got {values['run']['compile']!r}")
    if not all(isinstance(f, str) for f in values["data"]["files"]):
        raise ValueError(f"[data] files must be a list of paths, got {values['data']['files']!r}")
    config = TrainConfig(values, source=str(path) if path is not None else "the embedded default")
    config.optimization()  # the optimizer's own checks (a schedule without room to decay, ...), said now
    return config
