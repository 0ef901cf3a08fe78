"""Bi-level training of one user's CoMiGS model (paper Alg. 1, first-order alternating minimisation).

Expert steps (generalists, specialists, attention LoRA) run on the user's train split with routers frozen; every τ
expert iterations, ``s`` router steps run on the validation split with experts frozen. Two AdamW optimisers over
disjoint parameter groups; by default no gradient ever crosses between the two objectives (``requires_grad`` is
switched per phase and both groups are cleared before each step). ``mimic_reference_gradients`` reproduces the
reference code instead: router gradients build up during expert steps and validation gradients on the experts carry
into the next expert step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from moetool.methods.comigs.model import ComigsForCausalLM
from moetool.recipe.comigs import ComigsTraining
from moetool.train.data import sample_batch

Split = Literal["train", "valid", "test"]


def balance_loss(logits: torch.Tensor, top_k: int, n_generalists: int, mode: str) -> torch.Tensor:
    """Load-balancing loss of one layer, ``logits [T, n]`` → scalar.

    ``f_j`` = share of tokens whose top-k contains j (paper eq. 7, so Σ f = k), ``P_j`` = mean router probability.
    - ``generalist_favoured`` with exactly one generalist (paper eq. 6):
      ``f_0 P_0 / ((n-1)^2 + 1) + Σ_{j≥1} (n-1) f_j P_j / ((n-1)^2 + 1)``; its minimum puts P_0 at 1/2.
    - ``uniform`` (and eq. 6 with ≠ 1 generalist): the Switch loss ``(n/k) Σ f_j P_j``, 1 when balanced.
    Note that with n = k = 2 (1G1S) every token picks both experts, f = (1, 1) and the loss is constant.
    """
    n = logits.shape[-1]
    if mode == "none" or n < 2:
        return logits.new_zeros(())
    probs = logits.float().softmax(dim=-1)  # [T, n]
    chosen = logits.topk(top_k, dim=-1).indices  # [T, k]
    f = F.one_hot(chosen, n).sum(dim=1).float().mean(dim=0)  # [n]; no gradient (argmax)
    p = probs.mean(dim=0)  # [n]
    if mode == "generalist_favoured" and n_generalists == 1:
        denom = (n - 1) ** 2 + 1
        w = torch.full((n,), (n - 1) / denom, device=logits.device)
        w[0] = 1.0 / denom
        return (w * f * p).sum()
    return (n / top_k) * (f * p).sum()


@dataclass
class UserData:
    """One user's token streams ``[N]``: train (expert steps), valid (router steps), test (evaluation only)."""

    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor


BatchReader = Callable[[Split, int], torch.Tensor]


class ClientTrainer:
    """One user's model, data and two optimisers; ``local_round`` runs the paper's local loop.

    Args:
        model: the user's CoMiGS model (base weights frozen here).
        data: its splits.
        training: the recipe's ``training`` section.
        total_iterations: expert iterations over the whole run (length of the cosine schedule).
        shared: parameter names that leave the device (generalists, maybe attention LoRA).
        bos_id: prepended to every sampled window (as the zoo models were trained), or None.
        seed: batch sampling seed of this user.
    """

    def __init__(
        self,
        model: ComigsForCausalLM,
        data: UserData,
        training: ComigsTraining,
        *,
        total_iterations: int,
        shared: list[str],
        bos_id: int | None,
        seed: int,
    ) -> None:
        self.model = model
        self.data = data
        self.cfg = training
        self.bos_id = bos_id
        self.seed = seed
        self.iteration = 0
        self.router_updates = 0
        self.reads: list[tuple[str, Split, int]] = []  # (phase, split, step) of every batch read: an audit trail
        named = dict(model.named_parameters())
        self.expert_names = [n for n in named if ".mlp.experts." in n or n.endswith((".lora_A", ".lora_B"))]
        self.router_names = [n for n in named if ".mlp.router." in n]
        self.shared = list(shared)
        for p in named.values():
            p.requires_grad_(False)
        self.expert_params = [named[n] for n in self.expert_names]
        self.router_params = [named[n] for n in self.router_names]
        betas = (0.9, 0.95)
        self.expert_opt = torch.optim.AdamW(
            self.expert_params, lr=training.expert_lr, betas=betas, weight_decay=training.weight_decay
        )
        lo, hi, steps = training.expert_min_lr, training.expert_lr, max(1, total_iterations)
        self.expert_sched = torch.optim.lr_scheduler.LambdaLR(
            self.expert_opt, lambda t: (lo + (hi - lo) * 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))) / hi
        )
        self.router_opt = (
            torch.optim.AdamW(self.router_params, lr=training.router_lr, weight_decay=training.weight_decay)
            if self.router_params
            else None
        )

    # data -----------------------------------------------------------------------------------------------------
    def batch(self, split: Split, step: int) -> torch.Tensor:
        """A ``[B, seq_len]`` batch of random windows of ``split``; a pure function of (seed, split, step)."""
        stream = getattr(self.data, split)
        salt = {"train": 0, "valid": 1, "test": 2}[split]
        return sample_batch(
            [stream], self.cfg.batch_size, self.cfg.seq_len, seed=self.seed * 3 + salt, step=step, bos_id=self.bos_id
        )

    # objectives -----------------------------------------------------------------------------------------------
    def objective(self, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(CE + λ·mean-over-layers LB, CE) on ``ids [B, T]``; the same objective for experts and routers."""
        out = self.model(input_ids=ids, labels=ids)
        ce = out.loss
        logits = self.model.router_logits()
        if logits and self.cfg.load_balancing != "none" and self.cfg.load_balancing_coef > 0:
            cfg = self.model.config
            lb = torch.stack(
                [balance_loss(x, cfg.experts_per_token, cfg.n_generalists, self.cfg.load_balancing) for x in logits]
            ).mean()
            return ce + self.cfg.load_balancing_coef * lb, float(ce.detach())
        return ce, float(ce.detach())

    def _phase(self, trainable: list[torch.nn.Parameter], frozen: list[torch.nn.Parameter]) -> None:
        if self.cfg.mimic_reference_gradients:
            for p in trainable + frozen:
                p.requires_grad_(True)
            return
        for p in trainable:
            p.requires_grad_(True)
        for p in frozen:
            p.requires_grad_(False)
            p.grad = None  # a frozen group never carries a gradient into its own next step

    def expert_step(self) -> float:
        """One expert step on a train batch (routers frozen). Returns the CE."""
        self.model.train()
        self._phase(self.expert_params, self.router_params)
        ids = self.batch("train", self.iteration)
        self.reads.append(("experts", "train", self.iteration))
        mimic = self.cfg.mimic_reference_gradients
        if not mimic:
            self.expert_opt.zero_grad(set_to_none=True)
        loss, ce = self.objective(ids)
        loss.backward()
        self.expert_opt.step()
        if mimic:  # nanoGPT-style clear after the step: whatever a router step leaves on the experts is kept
            self.expert_opt.zero_grad(set_to_none=True)
        self.expert_sched.step()
        return ce

    def router_step(self, step: int) -> float:
        """One router step on a validation batch (experts frozen); ``router_split: train`` is the '-tr' ablation."""
        assert self.router_opt is not None
        self.model.train()
        self._phase(self.router_params, self.expert_params)
        split: Split = "valid" if self.cfg.router_split == "valid" else "train"
        # router batches draw from their own step counter, so '-tr' sees fresh train windows, not the experts' ones
        ids = self.batch(split, 1_000_000 + step)
        self.reads.append(("routers", split, step))
        mimic = self.cfg.mimic_reference_gradients
        if not mimic:
            self.router_opt.zero_grad(set_to_none=True)
        loss, ce = self.objective(ids)
        loss.backward()
        self.router_opt.step()  # mimic: router grads summed over every expert step since the last clear
        if mimic:
            self.router_opt.zero_grad(set_to_none=True)
        return ce

    def local_round(self, iterations: int | None = None) -> dict[str, float]:
        """``iterations`` expert steps; after every τ-th (global count) one, ``s`` router steps. Mean CEs."""
        n = iterations or self.cfg.local_iterations
        ce_e: list[float] = []
        ce_r: list[float] = []
        for _ in range(n):
            ce_e.append(self.expert_step())
            self.iteration += 1
            if self.router_opt is not None and self.cfg.router_steps and self.iteration % self.cfg.router_every == 0:
                for _ in range(self.cfg.router_steps):
                    ce_r.append(self.router_step(self.router_updates))
                    self.router_updates += 1
        out = {"train_ce": sum(ce_e) / len(ce_e)}
        if ce_r:
            out["router_ce"] = sum(ce_r) / len(ce_r)
        return out

    # communication --------------------------------------------------------------------------------------------
    def shared_state(self) -> dict[str, torch.Tensor]:
        """Copies of the tensors that leave the device (nothing else is ever read for upload)."""
        named = dict(self.model.named_parameters())
        return {n: named[n].detach().clone() for n in self.shared}

    def load_shared(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the shared tensors with the server's; anything else in ``state`` is an error."""
        extra = set(state) - set(self.shared)
        if extra:
            raise ValueError(f"server sent tensors this user does not share: {sorted(extra)[:3]}")
        missing = set(self.shared) - set(state)
        if missing:
            raise ValueError(f"server did not send shared tensors: {sorted(missing)[:3]}")
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                if named[n].shape != t.shape:
                    raise ValueError(
                        f"{n}: server shape {list(t.shape)} differs from this user's {list(named[n].shape)}"
                    )
                named[n].copy_(t)

    # evaluation -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def perplexity(self, split: Split = "test", max_tokens: int = 16384) -> float:
        """exp(mean token NLL) over non-overlapping ``seq_len`` windows of ``split`` (first ``max_tokens``)."""
        self.model.eval()
        stream = getattr(self.data, split)[:max_tokens]
        body = self.cfg.seq_len - (1 if self.bos_id is not None else 0)
        nll, count = 0.0, 0
        windows = [stream[i : i + body] for i in range(0, len(stream) - 1, body)]
        windows = [w for w in windows if len(w) == body] or [stream[: max(2, len(stream))]]
        for i in range(0, len(windows), 16):
            ids = torch.stack(windows[i : i + 16])
            if self.bos_id is not None:
                ids = torch.cat([torch.full((ids.shape[0], 1), self.bos_id), ids], dim=1)
            logits = self.model(input_ids=ids).logits[:, :-1].float()
            tgt = ids[:, 1:]
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"))
            count += tgt.numel()
        return math.exp(nll / count)

    # device-local state (what a device keeps between rounds) ----------------------------------------------------
    def private_state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """(tensors, counters) restoring this trainer exactly: every trainable parameter and both optimisers'
        moments. Stays on the device (Flower keeps it in the node's ``context.state``)."""
        named = dict(self.model.named_parameters())
        tensors = {f"param/{n}": named[n].detach().clone() for n in self.expert_names + self.router_names}
        for tag, opt in (("expert_opt", self.expert_opt), ("router_opt", self.router_opt)):
            if opt is None:
                continue
            for idx, st in opt.state_dict()["state"].items():
                for k, v in st.items():
                    tensors[f"{tag}/{idx}/{k}"] = torch.as_tensor(v).detach().clone()
        counters = {
            "iteration": self.iteration,
            "router_updates": self.router_updates,
            "expert_sched": int(self.expert_sched.last_epoch),
        }
        return tensors, counters

    def restore(self, tensors: dict[str, torch.Tensor], counters: dict[str, int]) -> None:
        """Inverse of :meth:`private_state`."""
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, t in tensors.items():
                if key.startswith("param/"):
                    named[key.removeprefix("param/")].copy_(t)
        for tag, opt in (("expert_opt", self.expert_opt), ("router_opt", self.router_opt)):
            if opt is None:
                continue
            sd = opt.state_dict()
            state: dict[int, dict[str, torch.Tensor]] = {}
            for key, t in tensors.items():
                if key.startswith(f"{tag}/"):
                    _, idx, k = key.split("/")
                    state.setdefault(int(idx), {})[k] = t.clone()
            sd["state"] = state
            opt.load_state_dict(sd)
        self.iteration = int(counters["iteration"])
        self.router_updates = int(counters["router_updates"])
        self.expert_sched.last_epoch = int(counters["expert_sched"])
        sched = self.expert_sched
        for group, base, fn in zip(self.expert_opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * fn(sched.last_epoch)
