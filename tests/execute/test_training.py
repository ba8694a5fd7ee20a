"""The optimizer step of a training job (``training.Optimization``, ``runtime.optim``): AdamW and SGD,
weight-decay groups, warm-up and decay, and global gradient-norm clipping over every stage and replica,
against the single-process eager reference that uses ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from octopipe.execute.runs import RunOptions, optimization_problem
from octopipe.execute.runtime import build_model, reference_run, run_local, workload_reference
from octopipe.execute.runtime.data import BYTE_VOCAB, ByteCorpus, with_data
from octopipe.execute.runtime.optim import clip_global_norm, make_optimizer
from octopipe.execute.training import DataSpec, Optimization
from octopipe.ir import with_collectives
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, one_f_one_b, zb_h1

M = 4
#: clips on every step of these tiny models (their gradient norms are ~1-3): the clipping is exercised
CLIPPING = Optimization(
    learning_rate=1e-2,
    weight_decay=0.1,
    decay_norms_and_biases=False,
    warmup_steps=1,
    schedule="cosine",
    total_steps=3,
    min_lr_ratio=0.1,
    clip_grad_norm=0.5,
)


def _plan(ranks: int, dp: int = 1) -> plan_pb2.Plan:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=dp * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = (zb_h1 if dp == 1 else one_f_one_b)(ranks, M, layer_names=equal_partition(names, ranks))
    plan.model.CopyFrom(reference)
    if dp > 1:
        plan.mesh.dp = dp
        plan = with_collectives(plan)
    return plan


def test_the_learning_rate_warms_up_then_decays_to_its_floor() -> None:
    cosine = Optimization(learning_rate=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    rates = [cosine.lr_at(s) for s in range(8)]
    assert rates[:2] == [0.5, 1.0]  # linear warm-up: (s + 1) / warmup
    assert rates[2] == 1.0 and rates[6] == rates[7] == pytest.approx(0.1)  # from the peak to the floor, then kept
    assert rates[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    linear = Optimization(learning_rate=2.0, schedule="linear", total_steps=4)
    assert [linear.lr_at(s) for s in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    assert Optimization().lr_at(1000) == 1e-3  # the default: constant
    with pytest.raises(ValueError, match="make total_steps larger than warmup_steps"):
        Optimization(schedule="cosine", warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="optimizer must be one of adamw, sgd, got 'lion'"):
        Optimization(optimizer="lion")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="betas must be two numbers in"):
        Optimization(betas=(0.9, 1.0))


def test_norms_and_biases_can_go_without_weight_decay() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    params = dict(model.named_parameters())
    ndims = {n: p.ndim for n, p in params.items()}
    groups = make_optimizer(params, ndims, Optimization(decay_norms_and_biases=False, weight_decay=0.1)).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (3, 0.0)]  # weight | bias, norm
    sgd = make_optimizer(params, ndims, Optimization(optimizer="sgd", momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD) and len(sgd.param_groups) == 1  # default: decay on every parameter
    with pytest.raises(ValueError, match="not the model's"):
        make_optimizer(params, {}, Optimization())


def test_clipping_one_process_is_clip_grad_norm() -> None:
    torch.manual_seed(0)
    grads = {f"p{i}": torch.randn(5, 3) for i in range(4)}
    copies = [g.clone() for g in grads.values()]
    holders = [nn.Parameter(torch.zeros_like(g)) for g in copies]
    for holder, copy in zip(holders, copies, strict=True):
        holder.grad = copy
    expected = torch.nn.utils.clip_grad_norm_(holders, 1.0, foreach=False)
    norm = clip_global_norm(grads, list(grads), 1.0, exchange=False)
    assert norm == float(expected)
    assert all(h.grad is not None and torch.equal(g, h.grad) for g, h in zip(grads.values(), holders, strict=True))


@pytest.mark.slow
def test_global_norm_clipping_over_two_stages_equals_clip_grad_norm_bitwise() -> None:
    """pp=2 (ZB-H1): each stage's norms are assembled into the model's vector on every rank; the losses, the
    norms, the gradients and the weights after 3 steps (warm-up, cosine, no decay on norms) are bitwise the
    single process's with ``clip_grad_norm_``."""
    plan = _plan(2)
    run = run_local(plan, RunOptions(steps=3, optimization=CLIPPING, keep_grads=True, keep_params=True))
    ref = reference_run(plan.model, num_microbatches=M, steps=3, optimization=CLIPPING)
    assert run.grad_norms == ref.grad_norms and all(n > CLIPPING.clip_grad_norm for n in ref.grad_norms)
    assert run.losses == ref.losses
    for expected, got in ((ref.grads, run.grads), (ref.params, run.params)):
        assert sorted(expected) == sorted(got)
        for name, value in expected.items():
            assert torch.equal(value, got[name]), name
    # the first half of the model's gradients alone (about one stage) has a smaller norm: a run that left a
    # stage's norms out would clip by another coefficient and fail the comparisons above
    names = list(ref.grads)
    part = torch.stack([torch.linalg.vector_norm(ref.grads[n]) for n in names[: len(names) // 2]])
    assert float(torch.linalg.vector_norm(part)) < ref.grad_norms[0]


@pytest.mark.slow
def test_global_norm_clipping_over_replicas_equals_clip_grad_norm() -> None:
    """pp=1 x dp=2: each parameter's norm from its two FSDP shards (the quick loop's 2-process check; pp=2
    x dp=2 below, extended)."""
    plan = _plan(1, dp=2)
    sgd = dataclasses.replace(CLIPPING, optimizer="sgd", momentum=0.9)
    run = run_local(plan, RunOptions(steps=2, optimization=sgd, keep_params=True, pin_cores=False))
    ref = reference_run(plan.model, num_microbatches=2 * M, steps=2, optimization=sgd)
    assert run.grad_norms == pytest.approx(ref.grad_norms, rel=1e-6)
    assert all(n > CLIPPING.clip_grad_norm for n in ref.grad_norms)
    for name, value in ref.params.items():
        torch.testing.assert_close(run.params[name], value, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[misc]


@pytest.mark.slow
@pytest.mark.extended  # 4 processes (20 s): CI's budget; pp=2 bitwise and pp=1 x dp=2 run by default
def test_global_norm_clipping_over_stages_and_replicas_equals_clip_grad_norm() -> None:
    """pp=2 x dp=2 (FSDP shards): a parameter's norm is the root of its shards' squares, summed over the
    replicas; equal to the single process up to the float32 order of those sums (as every dp run is). SGD with
    momentum: its step is linear in the gradient, where AdamW's first step is about ``lr * sign(g)`` and turns
    a last-bit difference of a near-zero gradient into a whole step."""
    plan = _plan(2, dp=2)
    sgd = dataclasses.replace(CLIPPING, optimizer="sgd", momentum=0.9)
    options = RunOptions(steps=2, optimization=sgd, keep_params=True, timeout_s=180, pin_cores=False)
    run = run_local(plan, options)
    ref = reference_run(plan.model, num_microbatches=2 * M, steps=2, optimization=sgd)
    assert run.grad_norms == pytest.approx(ref.grad_norms, rel=1e-6)
    assert all(n > CLIPPING.clip_grad_norm for n in ref.grad_norms)
    assert run.losses == pytest.approx(ref.losses, rel=1e-6)
    for name, value in ref.params.items():
        torch.testing.assert_close(run.params[name], value, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[misc]


def test_clipping_with_expert_parallelism_is_refused_in_one_line() -> None:
    reference = workload_reference("moe-ep-4", tiny=True, sequence=8, global_batch=2 * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(1, M, layer_names=equal_partition(names, 1))
    plan.model.CopyFrom(reference)
    plan.mesh.dp, plan.mesh.ep = 2, 2
    assert "gradient clipping with expert parallelism (ep=2) is not built yet" in optimization_problem(plan, CLIPPING)
    assert optimization_problem(plan, Optimization()) == ""


def _text_files(folder: Path) -> list[str]:
    files = []
    for index in range(3):
        path = folder / f"part{index}.txt"
        lines = (hashlib.sha256(f"{index}.{k}".encode()).hexdigest() for k in range(24))  # no two rows alike
        path.write_text("\n".join(lines) + "\n")
        files.append(str(path))
    return files


def test_a_byte_corpus_visits_every_row_once_an_epoch_and_draws_each_step_from_its_seed(tmp_path: Path) -> None:
    files = _text_files(tmp_path)
    corpus = ByteCorpus(files, sequence=15, seed=3)
    size = sum(Path(f).stat().st_size for f in files)
    assert corpus.num_rows == size // 16 and corpus.rows.max() < BYTE_VOCAB  # packed, no padding
    per_epoch = corpus.steps_per_epoch(4)
    assert per_epoch == corpus.num_rows // 4
    seen = torch.cat([torch.cat(corpus.batch(s, 4), dim=1) for s in range(per_epoch)])
    inputs, targets = corpus.batch(0, 4)
    assert inputs.shape == targets.shape == (4, 15) and torch.equal(inputs[:, 1:], targets[:, :-1])  # next token
    assert len({tuple(row.tolist()) for row in seen}) == per_epoch * 4  # no row twice in an epoch
    # a batch is a function of (files, seed, step): a resumed run draws what an uninterrupted one draws
    again = ByteCorpus(files, sequence=15, seed=3)
    assert all(
        torch.equal(a, b)
        for s in (0, 5, per_epoch + 1)
        for a, b in zip(corpus.batch(s, 4), again.batch(s, 4), strict=True)
    )
    assert not torch.equal(corpus.batch(per_epoch, 4)[0], corpus.batch(0, 4)[0])  # each epoch its own order
    assert not torch.equal(ByteCorpus(files, sequence=15, seed=4).batch(0, 4)[0], inputs)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        corpus.steps_per_epoch(corpus.num_rows + 1)
    with pytest.raises(ValueError, match=r"missing\.txt: No such file"):
        ByteCorpus([str(tmp_path / "missing.txt")], sequence=15)
    stdlib = ByteCorpus(sequence=31, max_bytes=20_000)  # the default: the standard library's own source
    assert stdlib.num_rows >= 20_000 // 32 and all(f.endswith(".py") for f in stdlib.files)


def test_a_tokenizer_folder_gives_its_own_ids_each_file_ended_by_its_eos(tmp_path: Path) -> None:
    """A transformers tokenizer (a byte-level BPE trained here, saved with save_pretrained: no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    files = _text_files(tmp_path)
    texts = [Path(f).read_text() for f in files]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet)
    )
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    encoder = AutoTokenizer.from_pretrained(tmp_path / "tok")
    expected = [i for text in texts for i in [*encoder(text, add_special_tokens=False)["input_ids"], 1]]
    corpus = ByteCorpus(files, sequence=15, tokenizer=str(tmp_path / "tok"))
    assert corpus.rows.reshape(-1).tolist() == expected[: corpus.num_rows * 16]  # packed in file order
    assert len(expected) < sum(len(t) for t in texts) and corpus.vocabulary > BYTE_VOCAB  # merged, not bytes
    built = build_model(workload_reference("llama-8", tiny=True, sequence=15, global_batch=M, vocab=300))
    with pytest.raises(ValueError, match=rf"tokenized data needs a vocabulary of at least {corpus.vocabulary}"):
        with_data(built, DataSpec(files=tuple(files), tokenizer=str(tmp_path / "tok")))
    with pytest.raises(ValueError, match=r"tokenizer '.*nothing'"):
        ByteCorpus(files, sequence=15, tokenizer=str(tmp_path / "nothing"))


def test_byte_data_needs_a_vocabulary_of_256() -> None:
    built = build_model(workload_reference("llama-8", tiny=True, sequence=8, global_batch=M))  # vocab 64
    with pytest.raises(ValueError, match=r"vocabulary of at least 256 token ids; the model's embedding has 64"):
        with_data(built, DataSpec())


@pytest.mark.slow
def test_a_pipeline_trains_on_files_as_the_single_process_does_and_resumes_on_the_same_batches(
    tmp_path: Path,
) -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=15, global_batch=M, vocab=256)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = zb_h1(2, M, layer_names=equal_partition(names, 2))
    plan.model.CopyFrom(reference)
    data = DataSpec(files=tuple(_text_files(tmp_path)), seed=1)
    checkpoints = str(tmp_path / "checkpoints")
    options = RunOptions(steps=3, data=data, keep_params=True, checkpoint_dir=checkpoints, checkpoint_every=2)
    whole = run_local(plan, options)
    ref = reference_run(reference, num_microbatches=M, steps=3, data=data)
    assert whole.losses == ref.losses
    assert all(torch.equal(value, whole.params[name]) for name, value in ref.params.items())
    resumed = run_local(plan, dataclasses.replace(options, steps=1, start_step=2, resume=True, checkpoint_every=0))
    assert resumed.losses == whole.losses[2:]  # the step after the checkpoint draws the same batch
    assert all(torch.equal(value, resumed.params[name]) for name, value in whole.params.items())


@pytest.mark.slow
@pytest.mark.extended  # a HF model on 2 ranks (about 20 s): CI's budget
def test_clipping_counts_a_tied_weight_once_across_its_holders() -> None:
    """A transformers llama with tied embeddings on 2 ranks: both holders have the summed gradient and only
    the first use's holder adds its norm; the norms and losses are bitwise the single process's."""
    from tests.execute.test_whole_model_runtime import plans
    from tests.execute.test_whole_model_runtime import reference as hf_reference

    plan = plans(hf_reference("llama", tied="true"), 2, [one_f_one_b])[0]
    tight = Optimization(clip_grad_norm=0.05)
    run = run_local(plan, RunOptions(steps=2, optimization=tight, pin_cores=False))
    ref = reference_run(plan.model, num_microbatches=plan.num_microbatches, steps=2, optimization=tight)
    assert run.grad_norms == ref.grad_norms and all(n > 0.05 for n in ref.grad_norms)
    assert run.losses == ref.losses
