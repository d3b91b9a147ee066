"""Learnable normalizers under DDP and FSDP2 on two CPU processes (gloo).

Reference: the same model trained in this process on the global batch.  Two spawned
ranks each train on half of it; DDP all-reduces (averages) the gradients of ``s``,
``bias`` and ``alpha_logit`` with the rest, so after every step both ranks hold the
same parameters, equal to the single-process run.  FSDP2 (``fully_shard``) shards the
per-head parameters along the head axis and must reach the same values.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import attnorm

WORLD, BATCH, LENGTH, DIM, HEADS, STEPS, VOCAB = 2, 8, 6, 16, 2, 3, 11
TIMEOUT_S = 120


class TinyModel(nn.Module):
    """Two causal attention layers: learnable per-head ssmax, then learnable per-head entmax."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(2))
        self.normalizers = nn.ModuleList([
            attnorm.make("ssmax:learnable=true", num_heads=HEADS),
            attnorm.Entmax(alpha=1.5, learnable=True, num_heads=HEADS),
        ])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, L, D)
        for qkv, normalizer in zip(self.qkv, self.normalizers, strict=True):
            q, k, v = qkv(x).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)  # (B, H, L, hd) each
            x = x + attnorm.attention(q, k, v, normalizer, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(x)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _train(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """SGD steps on the mean loss; the gradients of the normalizer parameters after each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grads = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        grads.append({
            name.removeprefix("module."): _full(p.grad).clone()
            for name, p in model.named_parameters() if "normalizers" in name
        })
        optimizer.step()
    return grads


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _fresh_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyModel()


def _worker(rank: int, init_file: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        ids, targets = _data()
        local = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        ddp = nn.parallel.DistributedDataParallel(_fresh_model())
        grads = _train(ddp, ids[local], targets[local])
        results[("ddp", rank)] = (grads, {n.removeprefix("module."): p.detach().clone()
                                         for n, p in ddp.named_parameters()})
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = _fresh_model()
            mesh = init_device_mesh("cpu", (WORLD,))
            # The normalizers shard with the root: attnorm.attention reads their parameters without
            # calling them (the SDPA route), so they must not be FSDP units of their own.
            for block in model.qkv:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            grads = _train(model, ids[local], targets[local])
            outcome = (grads, {n: _full(p).clone() for n, p in model.named_parameters()})
        except Exception as error:  # noqa: BLE001  (reported to the parent as the skip reason)
            outcome = f"{type(error).__name__}: {error}"
        results[("fsdp", rank)] = outcome
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory) -> dict:
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    init_file = str(tmp_path_factory.mktemp("dist") / "init")
    context = mp.start_processes(_worker, args=(init_file, results), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed training did not finish in {TIMEOUT_S} s")
    return dict(results)


@pytest.fixture(scope="module")
def single_process():
    model = _fresh_model()
    grads = _train(model, *_data())
    return grads, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow  # two spawned processes: about 25 s on 2 busy cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process_on_the_global_batch(strategy, distributed_results, single_process):
    outcome = [distributed_results[(strategy, rank)] for rank in range(WORLD)]
    if isinstance(outcome[0], str):
        pytest.skip(f"FSDP2 does not run on CPU with gloo here: {outcome[0]}")
    expected_grads, expected_params = single_process
    assert len(expected_grads[0]) == 3  # s, bias, alpha_logit
    for grads, params in outcome:
        for step, (got, expected) in enumerate(zip(grads, expected_grads, strict=True)):
            assert set(got) == set(expected)
            for name in expected:
                assert expected[name].abs().sum() > 0
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7,
                                           msg=lambda m, name=name, step=step: f"{name} step {step}: {m}")
        for name, value in expected_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
    first, second = (params for _, params in outcome)
    assert all(torch.equal(first[name], second[name]) for name in first)  # identical across ranks
