"""The optimisation loop every trainer shares: AdamW, warmup + cosine schedule, gradient clipping, bfloat16
autocast, a tqdm bar, and resumable checkpoints.

Determinism: the loop draws no random numbers itself. A trainer's `loss_fn(step)` derives its batch from
(seed, step) alone (`step_generator`), so a run resumed from a checkpoint takes exactly the batches an uninterrupted
run would have taken, and the same seed gives the same weights on the same machine and thread count.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

BAR_POSITION = 0   # tqdm line of this process's bars (a second training process uses line 1)
LOG_EVERY = 10     # steps between updates of the bar's loss and metrics


@dataclass(frozen=True)
class OptimConfig:
    steps: int
    lr: float
    warmup: int = 50
    min_lr_ratio: float = 0.1        # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    beta2: float = 0.95
    grad_clip: float = 0.5           # max global grad norm, as the official EAGLE-3 recipe
    bf16: bool = True                # bfloat16 autocast for forwards (GPUs, and AMX/AVX512-BF16 CPUs: 2-3x faster)
    checkpoint_every: int = 100      # steps between checkpoints (0: only at the end)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def seed_everything(seed: int, threads: int | None = None) -> None:
    """Seed torch; pin the intra-op thread count (CPU kernels may reduce differently with another count)."""
    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)


def default_threads() -> int:
    """EAGLEX_TRAIN_THREADS, else all cores up to 2 (what `make tiny` is sized for)."""
    return int(os.environ.get("EAGLEX_TRAIN_THREADS", min(2, os.cpu_count() or 1)))


def digest(*tensors: torch.Tensor) -> str:
    """Short content hash of training data, for checkpoint keys."""
    import hashlib
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random stream of one training step: depends on (seed, step) only, so resuming changes nothing."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def logged(step: int, steps: int) -> bool:
    """Whether train() shows step's metrics: a loss_fn may skip computing them on the other steps."""
    return step % LOG_EVERY == 0 or step == steps - 1


def train(model: nn.Module, loss_fn: Callable[[int], tuple[torch.Tensor, dict]], cfg: OptimConfig,
          checkpoint: Path | None, desc: str, run_key: dict | None = None) -> list[float]:
    """Minimise loss_fn(step) over the trainable parameters of `model`; returns the loss of every step.

    A checkpoint (weights, optimiser, step, losses) is written atomically every `checkpoint_every` steps and at the
    end. If `checkpoint` exists and was written by the same run (`run_key`: the trainer's whole config, plus
    anything else the batches depend on), training resumes from it; otherwise it starts over.
    """
    from tqdm import tqdm

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, cfg.beta2), eps=1e-8, fused=True)
    start, losses = 0, []
    key = {"optim": asdict(cfg), **(run_key or {})}
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if state.get("run_key") == key:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start, losses = state["step"], list(state["losses"])
        else:
            print(f"{checkpoint}: written with other settings; starting over")
    model.train()
    device_type = params[0].device.type
    skipped = 0
    bar = tqdm(range(start, cfg.steps), desc=desc, initial=start, total=cfg.steps, dynamic_ncols=True,
               mininterval=5.0, position=BAR_POSITION)
    t0 = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, metrics = loss_fn(step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
        if torch.isfinite(norm):
            opt.step()
        else:   # a non-finite gradient would poison every weight through Adam: skip the step instead
            skipped += 1
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if logged(step, cfg.steps):
            shown = {k: f"{v:.3f}" for k, v in metrics.items()} | ({"skipped": skipped} if skipped else {})
            bar.set_postfix(loss=f"{sum(losses[-LOG_EVERY:]) / len(losses[-LOG_EVERY:]):.3f}", **shown)
        done = step + 1
        due = done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
        if checkpoint is not None and due:
            _save(checkpoint, {"step": done, "model": model.state_dict(), "optim": opt.state_dict(),
                               "losses": losses, "run_key": key})
    bar.close()
    model.eval()
    if cfg.steps > start:
        print(f"{desc}: {cfg.steps - start} steps in {time.perf_counter() - t0:.0f} s, "
              f"final loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
    return losses


def _save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
