"""Weights in and out (issue 22, item 2): a model built with meta parameters, each rank reading only its
stages' tensors from HF safetensors or an octopipe checkpoint, and the trained weights exported in HF's
layout that ``transformers`` reads back. Real transformers models from configs, real 2-rank gloo runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from octopipe.execute.runs import RunOptions, weights_problem
from octopipe.execute.runtime import build_model, reference_run, run_local, workload_reference
from octopipe.execute.runtime.checkpoint import save_checkpoint
from octopipe.execute.runtime.data import with_data
from octopipe.execute.runtime.pipeline import baseline_plan
from octopipe.execute.runtime.pretrained import WeightSource, materialize, params_on_meta, placeholders
from octopipe.execute.runtime.whole_model import whole_model_stages
from octopipe.execute.training import DataSpec, Optimization, WeightsSpec
from octopipe.plan.v1 import plan_pb2
from octopipe.transform.device import CPU

SOURCE = "octopipe.execute.runtime.pretrained:causal_lm"


def _save_llama(folder: Path, *, tied: bool = True, shard: str | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(7)  # weights no seed of a run would make: a run that ignored the files could not match
    model = LlamaForCausalLM(config)
    if shard:
        model.save_pretrained(folder, max_shard_size=shard)
    else:
        model.save_pretrained(folder)
    return model


def _hf_reference(folder: Path) -> plan_pb2.ModelReference:
    reference = plan_pb2.ModelReference(name="llama-hf", source=SOURCE)
    reference.config.update({"path": str(folder), "sequence": "8", "global_batch": "4"})
    return reference


def _stage_bytes(model: torch.nn.Module, plan: plan_pb2.Plan, rank: int) -> int:
    """Bytes of the parameters of ``rank``'s stages, from the whole model split as the runtime splits it."""
    names = ("input_ids", "labels")
    ids = torch.zeros(2, 8, dtype=torch.int64)
    whole = whole_model_stages(model, names, (ids, ids), [list(s.layer_names) for s in plan.stages])
    held = {id(p): p for s, stage in enumerate(plan.stages) if stage.rank == rank for p in whole.stages[s].parameters()}
    return sum(p.nbytes for p in held.values())


def test_a_sharded_hf_checkpoint_is_read_tensor_by_tensor_and_equals_the_model(tmp_path: Path) -> None:
    model = _save_llama(tmp_path, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()  # several shards and their index
    source = WeightSource(tmp_path)
    state = dict(model.named_parameters())
    headers = source.meta()  # shapes and dtypes from the headers, nothing read
    assert {n: (t.shape, t.dtype) for n, t in headers.items()} == {n: (p.shape, p.dtype) for n, p in state.items()}
    loaded = source.read({name: p for name, p in state.items()})
    assert all(torch.equal(loaded[name], p) for name, p in state.items())
    with params_on_meta():  # the model's own source, built with meta parameters, then every one read
        built = build_model(_hf_reference(tmp_path))
    assert all(p.is_meta for p in built.model.parameters())
    assert all(not b.is_meta for b in built.model.buffers())  # rotary frequencies are computed, not loaded
    materialize(built.model, [], list(state), source, CPU)
    assert all(torch.equal(p, state[name]) for name, p in built.model.named_parameters())


def test_a_missing_or_misshapen_weight_is_refused_in_one_line(tmp_path: Path) -> None:
    model = _save_llama(tmp_path / "good")
    tensors = {n: p.detach().clone() for n, p in model.named_parameters() if n != "model.norm.weight"}
    (tmp_path / "short").mkdir()
    save_file(tensors, str(tmp_path / "short" / "model.safetensors"))
    wanted: dict[str, torch.Tensor] = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"lacks 1 of the model's parameters \(model.norm.weight\)") as missing:
        WeightSource(tmp_path / "short").read(wanted)
    assert "\n" not in str(missing.value)
    wanted["model.norm.weight"] = torch.empty(5, device="meta")
    with pytest.raises(ValueError, match=r"model.norm.weight is \(32,\), the model's is \(5,\)"):
        WeightSource(tmp_path / "good").read(wanted)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        WeightSource(tmp_path / "nothing")


def test_loading_or_exporting_with_a_mesh_is_refused() -> None:
    plan = baseline_plan(workload_reference("llama-8", tiny=True), num_ranks=1, num_microbatches=2)
    meshed = plan_pb2.Plan()
    meshed.CopyFrom(plan)
    meshed.mesh.dp = 2
    assert "dp=2" in weights_problem(meshed, WeightsSpec(load="x"))
    assert weights_problem(plan, WeightsSpec(load="x")) == ""
    assert weights_problem(meshed, None) == ""
    meshed.mesh.dp, meshed.mesh.tp = 1, 2  # tensor-parallel slices under whole names: refused as well
    assert "tp=2" in weights_problem(meshed, WeightsSpec(export="x"))
    meshed.mesh.tp, meshed.mesh.cp = 1, 2
    assert "cp=2" in weights_problem(meshed, WeightsSpec(load="x"))


def test_byte_data_for_a_model_whose_labels_are_its_inputs_keeps_that_convention(tmp_path: Path) -> None:
    _save_llama(tmp_path)
    built = build_model(_hf_reference(tmp_path))
    inputs, labels = with_data(built, DataSpec(max_bytes=20_000)).batch(3)
    assert torch.equal(inputs, labels)  # transformers shifts them; next-token targets would shift twice


def test_an_hf_checkpoint_trains_stage_by_stage_and_exports_what_from_pretrained_reads(tmp_path: Path) -> None:
    """The issue's round trip: save_pretrained -> 3 steps on 2 ranks, each reading only its stages' tensors
    -> exported -> from_pretrained. Weights bitwise octopipe's; losses and clipped norms bitwise the single
    process's with the same AdamW, warm-up + cosine schedule and clipping (the norm is above the clip)."""
    from transformers import LlamaForCausalLM

    original = _save_llama(tmp_path / "in")
    reference = _hf_reference(tmp_path / "in")
    plan = baseline_plan(reference, num_ranks=2, num_microbatches=2)
    optimization = Optimization(learning_rate=1e-2, warmup_steps=1, schedule="cosine", total_steps=3)
    optimization = Optimization(**{**optimization.__dict__, "clip_grad_norm": 0.05})
    weights = WeightsSpec(load=str(tmp_path / "in"), export=str(tmp_path / "out"))
    options = RunOptions(steps=3, optimization=optimization, weights=weights, keep_params=True, pin_cores=False)
    run = run_local(plan, options)
    ref = reference_run(reference, num_microbatches=2, steps=3, optimization=optimization, weights=weights)
    assert run.losses == ref.losses and run.grad_norms == ref.grad_norms
    inputs, labels = build_model(reference).batch(0)  # the first step's loss is the saved model's own
    with torch.no_grad():
        own = [original(input_ids=x, labels=y).loss for x, y in zip(inputs.chunk(2), labels.chunk(2), strict=True)]
    assert run.losses[0] == float(torch.stack(own).sum() * (torch.ones(()) / 2))
    assert all(norm > 0.05 for norm in run.grad_norms)
    assert all(torch.equal(value, run.params[name]) for name, value in ref.params.items())
    # every rank checked its stages against their own ops on the loaded weights (no rank holds the model)
    assert all(figures["whole_model_checked"] == 0.0 for figures in run.numerics.values())
    total = sum(p.nbytes for p in original.parameters())
    for rank in range(2):  # each rank's parameter storage is its stages' (plus one placeholder element)
        assert _stage_bytes(original, plan, rank) <= run.param_bytes[rank] <= _stage_bytes(original, plan, rank) + 4
        assert run.param_bytes[rank] < total
    back = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    reloaded = dict(back.named_parameters())
    assert sorted(reloaded) == sorted(run.params)
    assert all(torch.equal(reloaded[name], value) for name, value in run.params.items())
    assert back.config.tie_word_embeddings and back.lm_head.weight is back.model.embed_tokens.weight


def test_an_octopipe_checkpoint_loads_stage_by_stage_bitwise(tmp_path: Path) -> None:
    """A zoo model (its layer list) from one of octopipe's own checkpoints: the loaded weights are the
    checkpoint's, bitwise, and each rank holds only its stages'."""
    reference = workload_reference("llama-8", tiny=True)
    built = build_model(reference, seed=3)
    saved = {name: (p.detach() + 0.25).clone() for name, p in built.model.named_parameters()}
    params = {name: torch.nn.Parameter(t) for name, t in saved.items()}
    save_checkpoint(tmp_path, 5, params, torch.optim.AdamW(params.values()))
    plan = baseline_plan(reference, num_ranks=2, num_microbatches=2)
    weights = WeightsSpec(load=str(tmp_path / "step-5"))
    run = run_local(plan, RunOptions(steps=0, weights=weights, keep_params=True, pin_cores=False))
    assert sorted(run.params) == sorted(saved)
    assert all(torch.equal(run.params[name], value) for name, value in saved.items())
    total = sum(t.nbytes for t in saved.values())
    assert sum(run.param_bytes.values()) <= total + 2 * 4  # the stages split the model; a placeholder each
    assert all(bytes_ < total for bytes_ in run.param_bytes.values())


def test_placeholders_hold_one_element_of_storage() -> None:
    with params_on_meta():
        built = build_model(workload_reference("llama-8", tiny=True))
    placeholders(built.model, torch.device("cpu"))
    storages = {p.untyped_storage().data_ptr() for p in built.model.parameters()}
    assert len(storages) == 1 and next(built.model.parameters()).untyped_storage().nbytes() == 4


@pytest.mark.slow
@pytest.mark.extended  # two more 2-rank runs; the llama-8 test above loads the same way
@pytest.mark.parametrize("workload", ["moe-ep-4", "nemotronh-16"])
def test_loaded_moe_and_mamba_models_train_bitwise_as_the_single_process(tmp_path: Path, workload: str) -> None:
    """Stages compiled on zeros after loading (routing, scans): no value is baked into the graphs."""
    reference = workload_reference(workload, tiny=True)
    built = build_model(reference, seed=3)
    params = {n: torch.nn.Parameter((p.detach() * 1.1).clone()) for n, p in built.model.named_parameters()}
    save_checkpoint(tmp_path, 1, params, torch.optim.AdamW(params.values()))
    plan = baseline_plan(reference, num_ranks=2, num_microbatches=2)
    weights = WeightsSpec(load=str(tmp_path / "step-1"))
    run = run_local(plan, RunOptions(steps=2, weights=weights, keep_params=True, pin_cores=False))
    ref = reference_run(reference, num_microbatches=2, steps=2, weights=weights)
    assert run.losses == ref.losses
    assert all(torch.equal(ref.params[name], run.params[name]) for name in ref.params)
